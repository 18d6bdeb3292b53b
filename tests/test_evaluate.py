"""`agentrl eval --split heldout`: both held-out splits with one model load, on real ALFWorld games
(the tiny actor model of conftest; the walkthrough policy through the CLI)."""

import json
import subprocess
import sys


def test_heldout_plays_both_splits_as_each_alone_and_writes_their_union(tmp_path, tiny_actor_dir):
    """Each split's episodes are the ones a run of that split alone plays (one generator serves
    both); its files sit in OUT/<split>, the union's summary.json in OUT and no episodes.jsonl
    there, so `agentrl compare` pools the splits game by game."""
    from agentrl.compare import game_outcomes
    from agentrl.config import load_config
    from agentrl.evaluate import prepare_eval, run_eval, run_evals

    over = {"model.name": str(tiny_actor_dir), "eval.limit": 2, "eval.max_steps": 2, "sampling.max_new_tokens": 12,
            "env.workers": 0}
    cfg = load_config(None, over | {"eval.split": "heldout"})
    games, generator = prepare_eval(cfg)
    assert list(games) == ["valid_seen", "valid_unseen"] and all(len(g) == 2 for g in games.values())
    seen = []
    results = run_evals(cfg, tmp_path / "both", games, generator, on_split=lambda s, n: seen.append((s, n)))
    assert seen == [("valid_seen", 2), ("valid_unseen", 2)]
    assert list(results) == ["valid_seen", "valid_unseen", "heldout"]

    rows = {s: [json.loads(x) for x in (tmp_path / "both" / s / "episodes.jsonl").read_text().splitlines()]
            for s in ("valid_seen", "valid_unseen")}
    assert {s: {r["split"] for r in v} for s, v in rows.items()} == {"valid_seen": {"valid_seen"}, "valid_unseen": {"valid_unseen"}}
    union = json.loads((tmp_path / "both" / "summary.json").read_text())
    assert union["split"] == "heldout" and union["overall"]["episodes"] == union["overall"]["games"] == 4
    assert union["overall"]["won"] == sum(r["won"] for v in rows.values() for r in v)
    assert union["timing"]["env_steps"] == sum(results[s].stats.env_steps for s in ("valid_seen", "valid_unseen"))
    assert not (tmp_path / "both" / "episodes.jsonl").exists()
    assert union["machine"]["dtype"] == "float32" and union["machine"]["cpu_capability"]  # the numerics it ran at
    assert len(game_outcomes(tmp_path / "both")[0]) == 4

    alone = run_eval(load_config(None, over | {"eval.split": "valid_unseen"}), tmp_path / "alone")
    assert [t.summary()["actions"] for t in alone.trajectories] == [t.summary()["actions"] for t in results["valid_unseen"].trajectories]


def test_heldout_from_the_command_line(tmp_path):
    """The CLI prints each split's table and the union's, and says where the files went."""
    out = tmp_path / "e"
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "eval", "--policy", "walkthrough", "--split", "heldout",
                           "--limit", "1", "--env-workers", "0", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for title in ("valid_seen · policy walkthrough", "valid_unseen · policy walkthrough", "heldout · policy walkthrough"):
        assert title in proc.stdout
    assert (out / "valid_seen" / "episodes.jsonl").is_file() and (out / "valid_unseen" / "episodes.jsonl").is_file()
    assert json.loads((out / "summary.json").read_text())["overall"]["episodes"] == 2
    assert "agentrl compare" in proc.stdout
