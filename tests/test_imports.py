"""The house's layering: the package import graph (every `agentrl` import, lazy ones included)
has no cycle, and lower layers never import higher ones."""

import ast
import graphlib
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "agentrl"


def package_graph() -> dict[str, set[str]]:
    """agentrl.<unit> -> the units it imports; a unit is a subpackage (rollout) or a module (config)."""
    def unit(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else "agentrl"

    graph: dict[str, set[str]] = defaultdict(set)
    for f in SRC.rglob("*.py"):
        module = ".".join(f.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("agentrl"):
                names = [node.module] + ([f"agentrl.{a.name}" for a in node.names] if node.module == "agentrl" else [])
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("agentrl")]
            else:
                continue
            for name in names:
                if name != "agentrl" and unit(name) != unit(module):
                    graph[unit(module)].add(unit(name))
    return graph


def test_no_import_cycle():
    graph = package_graph()
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError with the cycle
    assert {"config", "rollout", "select", "train", "cli"} <= set(graph) | {u for v in graph.values() for u in v}


def test_lower_layers_never_import_higher_ones():
    graph = package_graph()
    assert graph["config"] <= {"errors", "specs"}  # the config tree sits at the bottom
    assert graph["specs"] <= {"errors"}
    assert not graph["rollout"] & {"select", "train", "cli", "collect", "evaluate"}  # the runner takes its stages from the caller
    assert not graph["select"] & {"train", "cli", "collect"}
    assert not graph["env"] & {"rollout", "select", "train", "sampling", "cli"}
    assert "cli" not in {u for v in graph.values() for u in v}  # nothing imports the CLI


def test_one_machine_never_imports_ray():
    """Ray is imported only for --ray-address: the CLI, the loop, envs and samplers load without it."""
    import subprocess
    import sys

    code = ("import sys, agentrl.cli, agentrl.train.loop, agentrl.env, agentrl.sampling, agentrl.evaluate, agentrl.cluster; "
            "from agentrl.config import load_config; load_config(None, {'cluster.ray_address': 'local'}); "
            "assert 'ray' not in sys.modules, 'ray imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_learner_layouts_do_not_import_each_other():
    """remote.py (the learner process) and ray_learner.py (the Ray actor) share handoff.py; neither
    imports the other, lazily or not, except the factory's one-way choice in remote.make_learner."""
    def imports(name: str) -> set[str]:
        tree = ast.parse((SRC / "train" / f"{name}.py").read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    assert "agentrl.train.remote" not in imports("ray_learner")
    assert "agentrl.train.handoff" in imports("ray_learner") and "agentrl.train.handoff" in imports("remote")
    assert package_graph()["stats"] <= {"errors"}  # the statistics sit at the bottom


def test_bad_input_is_answered_before_torch_loads(tmp_path):
    """`--help`, a config that fails its own checks, a run directory train may not use, and sft's
    data, `--from` and output checks never import torch, transformers or peft (about 5 s on a 2-core machine): the one-line error comes at once."""
    import subprocess
    import sys

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    for argv in (["--help"], ["train", "--lr", "-1"], ["sft", "--out", "x", "--epochs", "0"], ["eval", "--split", "test"],
                 ["rollout", "--gate", "12,0.1", "--max-steps", "10"], ["train", "--out", str(tmp_path / "run")],
                 ["train", "--resume", str(tmp_path)], ["eval", "--model", "./no/such/model"],
                 ["sft", "--data", str(tmp_path), "--out", str(tmp_path / "ws")],  # a root without train games
                 ["sft", "--from", str(tmp_path / "none"), "--out", str(tmp_path / "ws")],  # no such rollout
                 ["sft", "--out", str(tmp_path / "run")]):  # a directory that holds something
        code = (f"import sys; sys.argv = ['agentrl'] + {argv!r}\nfrom agentrl.cli import main\ncode = 0\n"
                "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
                "heavy = sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules)\n"
                "assert not heavy, heavy\nsys.exit(code)")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == (0 if argv == ["--help"] else 2), (argv, proc.stderr)
