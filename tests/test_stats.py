"""Wilson intervals, exact McNemar and the paired comparison against hand-worked cases, and
`agentrl compare` on two eval outputs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.errors import UserError
from agentrl.stats import mcnemar_exact, paired, rate_text, wilson


def test_wilson_matches_the_closed_form():
    # Wilson 95%: (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n), z = 1.959964
    z = 1.959963984540054
    for k, n in ((1, 6), (0, 10), (12, 140), (140, 140)):
        p = k / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        assert wilson(k, n) == pytest.approx((max(0.0, centre - half), min(1.0, centre + half)), abs=1e-9)
    lo, hi = wilson(1, 6)  # the example: 1 game of 6 reads as 3%..56%
    assert round(100 * lo) == 3 and round(100 * hi) == 56
    assert wilson(0, 0) is None
    assert rate_text(1, 6) == "1/6 = 16.7% [3.0, 56.4]"


def test_exact_mcnemar_by_hand():
    # b = 1 won only by A, c = 7 only by B: p = 2 * P(X <= 1), X ~ Bin(8, 1/2) = 2 * 9/256
    assert mcnemar_exact(1, 7) == pytest.approx(18 / 256)
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64)  # 0 of 6 discordant the other way: p = 0.03125
    assert mcnemar_exact(3, 3) == pytest.approx(1.0)
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(7, 1) == mcnemar_exact(1, 7)  # two-sided


def test_paired_comparison_counts_discordant_games_only():
    a = {"g1": 1, "g2": 0, "g3": 0, "g4": 1, "g5": 0, "x": 1}
    b = {"g1": 1, "g2": 1, "g3": 1, "g4": 0, "g5": 0, "y": 0}
    r = paired(a, b)
    assert r["games"] == 5 and (r["only_in_a"], r["only_in_b"]) == (1, 1)
    assert (r["won_a"], r["won_b"]) == (2, 3)
    assert r["difference_points"] == pytest.approx(20.0)
    assert (r["won_only_by_a"], r["won_only_by_b"]) == (["g4"], ["g2", "g3"])
    assert r["mcnemar_p"] == pytest.approx(1.0)  # 1 vs 2: p = 2 * P(X <= 1 | Bin(3, 1/2)) = 2 * 4/8 = 1
    assert r["ci95_a"] == pytest.approx(wilson(2, 5))


def test_shares_are_compared_game_by_game_with_the_sign_test():
    """Shares won (N sampled episodes per game, or several seeds' evals averaged): a game counts
    for the side with the larger share, the test is the exact sign test over those games (for 0/1
    outcomes exactly McNemar), and the side with shares gets a bootstrap interval over games while
    the side of 0/1 keeps Wilson's (the same warm start reads the same in every comparison)."""
    from agentrl.stats import bootstrap_mean

    a = {f"g{i}": 0.0 for i in range(8)} | {"w": 1.0}
    b = {f"g{i}": 0.5 for i in range(6)} | {"g6": 0.0, "g7": 1.0, "w": 0.5}
    r = paired(a, b)
    assert r["test"] == "exact sign test over games"
    assert r["won_only_by_b"] == [f"g{i}" for i in range(6)] + ["g7"] and r["won_only_by_a"] == ["w"]
    assert r["mcnemar_p"] == pytest.approx(2 * 9 / 256)  # 1 vs 7: as by hand above
    assert r["difference_points"] == pytest.approx(100 * (3.0 + 1.0 + 0.5 - 1.0) / 9)
    assert r["ci95_b"] == pytest.approx(tuple(bootstrap_mean([b[g] for g in sorted(b)])))
    assert r["ci95_a"] == pytest.approx(wilson(1, 9))
    lo, hi = r["ci95_b"]
    assert lo < r["success_b"] < hi
    assert bootstrap_mean([1.0, 1.0]) == [1.0, 1.0] and bootstrap_mean([]) == [0.0, 0.0]
    assert paired({"x": 1, "y": 0}, {"x": 0, "y": 1})["test"] == "exact McNemar"


def write_eval(path, outcomes, split="valid_seen"):
    path.mkdir(parents=True)
    rows = [{"task_id": g, "split": split, "task_type": t, "won": bool(w)} for g, t, w in outcomes]
    (path / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_compare_command_prints_and_writes_the_paired_result(tmp_path):
    games = [(f"g{i}", "heat" if i % 2 else "cool", 0) for i in range(10)]
    write_eval(tmp_path / "a", games)
    write_eval(tmp_path / "b", [(g, t, int(g in {"g1", "g2", "g3", "g4", "g5", "g6"})) for g, t, _ in games])
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "compare", str(tmp_path / "a"), str(tmp_path / "b"),
                           "--out", str(tmp_path / "cmp")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "B is above A by 60.0 points on 10 paired games (McNemar p = 0.0312 < 0.05)" in " ".join(proc.stdout.split())
    r = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert r["overall"]["won_only_by_b"] == [f"valid_seen/g{i}" for i in range(1, 7)]
    assert set(r["by_task_type"]) == {"cool", "heat"} and r["by_task_type"]["heat"]["won_b"] == 3
    bad = subprocess.run([sys.executable, "-m", "agentrl.cli", "compare", str(tmp_path / "a"), str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "no episodes.jsonl" in bad.stderr


def test_a_log_gets_the_task_types_and_the_verdict_whole(tmp_path):
    """Printed into a log (not a terminal) with no COLUMNS set, the table is 120 columns wide, not
    rich's 80, which cut the task types to `pick_…` and wrapped the verdict; COLUMNS still wins."""
    import os

    kind = "pick_clean_then_place_in_recep"
    games = [(f"g{i}", kind, 0) for i in range(10)]
    write_eval(tmp_path / "a", games)
    write_eval(tmp_path / "b", [(g, t, int(g in {"g1", "g2", "g3", "g4", "g5", "g6"})) for g, t, _ in games])
    cmd = [sys.executable, "-m", "agentrl.cli", "compare", str(tmp_path / "a"), str(tmp_path / "b")]
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    log = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert log.returncode == 0, log.stderr
    lines = log.stdout.splitlines()
    assert any(f"{kind} (10)" in ln for ln in lines) and max(map(len, lines)) <= 120
    assert "B is above A by 60.0 points on 10 paired games (McNemar p = 0.0312 < 0.05)" in lines
    narrow = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env | {"COLUMNS": "80"})
    assert kind not in narrow.stdout and max(map(len, narrow.stdout.splitlines())) <= 80


def test_compare_pools_several_evals_of_one_side_per_game(tmp_path):
    """`agentrl compare A B1 B2`: two seeds of one policy against a reference, a game counting as
    the share of B's evals that won it; B's evals must hold the same games."""
    games = [(f"g{i}", "heat", 0) for i in range(8)]
    write_eval(tmp_path / "a", games)
    write_eval(tmp_path / "s0", [(g, t, int(g in {"g0", "g1", "g2", "g3", "g4", "g5"})) for g, t, _ in games])
    write_eval(tmp_path / "s1", [(g, t, int(g in {"g0", "g1", "g2", "g6"})) for g, t, _ in games])
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "compare", str(tmp_path / "a"), str(tmp_path / "s0"),
                           str(tmp_path / "s1"), "--out", str(tmp_path / "cmp")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # shares 1, 1, 1, .5, .5, .5, .5, 0 against 0: 7 games better for B, none for A: p = 2/128
    assert "B is above A by 62.5 points on 8 paired games (sign test p = 0.0156 < 0.05)" in " ".join(proc.stdout.split())
    r = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert r["b_evals"] == 2 and r["overall"]["success_b"] == pytest.approx(5 / 8)
    write_eval(tmp_path / "short", games[:5])
    bad = subprocess.run([sys.executable, "-m", "agentrl.cli", "compare", str(tmp_path / "a"), str(tmp_path / "s0"),
                          str(tmp_path / "short")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "hold different games" in bad.stderr


def test_compare_reads_a_directory_of_splits_as_one_eval(tmp_path):
    """bench_learning's eval/RUN/ holds one eval per split: compared as one, games named by split,
    so the same game id in two splits is two games; a side with one split leaves the other out."""
    games = [(f"g{i}", "heat", 0) for i in range(4)]
    for split in ("valid_seen", "valid_unseen"):
        write_eval(tmp_path / "a" / split, games, split)
    write_eval(tmp_path / "b" / "valid_seen", [(g, t, 1) for g, t, _ in games], "valid_seen")
    write_eval(tmp_path / "b" / "valid_unseen", [(g, t, int(g == "g0")) for g, t, _ in games], "valid_unseen")
    from agentrl.compare import compare, game_outcomes
    full = compare(tmp_path / "a", tmp_path / "b")
    r = full["overall"]
    assert r["games"] == 8 and r["won_b"] == 5 and r["won_only_by_b"][-1] == "valid_unseen/g0"
    assert r["mcnemar_p"] == pytest.approx(2 / 32)
    # each split paired apart too: 4 against 0 (p = 2/16), 1 against 0 (p = 1)
    seen, unseen = full["by_split"]["valid_seen"], full["by_split"]["valid_unseen"]
    assert (seen["games"], seen["won_b"], seen["mcnemar_p"]) == (4, 4, pytest.approx(2 / 16))
    assert (unseen["games"], unseen["won_only_by_b"], unseen["mcnemar_p"]) == (4, ["valid_unseen/g0"], pytest.approx(1.0))
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "compare", str(tmp_path / "a"), str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=120, env=os.environ | {"COLUMNS": "160"})
    assert proc.returncode == 0, proc.stderr
    rows = {ln.split("│")[1].strip(): ln for ln in proc.stdout.splitlines() if ln.count("│") > 2}
    assert {"valid_seen (4)", "valid_unseen (4)", "overall (8)"} <= set(rows) and "0.125" in rows["valid_seen (4)"]
    one = compare(tmp_path / "a", tmp_path / "b" / "valid_seen")
    assert one["overall"]["games"] == 4 and one["overall"]["only_in_a"] == 4 and "by_split" not in one
    write_eval(tmp_path / "c" / "x", games)
    write_eval(tmp_path / "c" / "y", games)  # the same split twice: not one eval per split
    with pytest.raises(UserError, match="valid_seen/g0 is in both"):
        game_outcomes(tmp_path / "c")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no episodes.jsonl"):
        game_outcomes(tmp_path / "empty")


def test_kept_outcomes_compare_as_the_eval_they_came_from(tmp_path):
    """scripts/keep_outcomes.py: what a measurement keeps of an eval in the repo (its games'
    outcomes, no transcripts) pairs and pools in `agentrl compare` exactly as the eval itself;
    an episode the env failed is no outcome there, as in compare."""
    import importlib.util

    from agentrl.compare import compare, game_outcomes
    spec = importlib.util.spec_from_file_location("keep_outcomes", Path(__file__).parents[1] / "scripts" / "keep_outcomes.py")
    keep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(keep)
    for split, won in (("valid_seen", {"g1"}), ("valid_unseen", {"g0", "g2"})):
        rows = [{"task_id": f"g{i}", "split": split, "task_type": "heat", "won": f"g{i}" in won, "steps": 3,
                 "trajectory": {"steps": ["long"]}, "stop_reason": "won" if f"g{i}" in won else "max_steps"}
                for i in range(3)] + [{"task_id": "g9", "split": split, "task_type": "cool", "won": False,
                                       "stop_reason": "env_error"}]
        (tmp_path / "eval" / split).mkdir(parents=True)
        (tmp_path / "eval" / split / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert keep.main([str(tmp_path / "eval"), str(tmp_path / "kept" / "a.jsonl")]) == 0
    kept = [json.loads(line) for line in (tmp_path / "kept" / "a.jsonl").read_text().splitlines()]
    assert [(r["split"], r["task_id"]) for r in kept] == [(s, f"g{i}") for s in ("valid_seen", "valid_unseen") for i in range(3)]
    assert all(set(r) == {"split", "task_id", "task_type", "won"} for r in kept)
    assert game_outcomes(tmp_path / "kept" / "a.jsonl") == game_outcomes(tmp_path / "eval")
    r = compare(tmp_path / "eval", [tmp_path / "kept" / "a.jsonl", tmp_path / "eval"])["overall"]
    assert (r["games"], r["difference_points"], r["won_only_by_a"], r["won_only_by_b"]) == (6, 0.0, [], [])
    assert keep.main([str(tmp_path / "nope"), str(tmp_path / "x.jsonl")]) == 1 and not (tmp_path / "x.jsonl").exists()


def test_the_run_summary_says_whether_success_moved_beyond_noise():
    from agentrl.stats import eval_text, learning_verdict

    games = [f"g{i}" for i in range(10)]
    first = {"kind": "eval", "iteration": 0, "tasks": 10, "won": 1, "success": 0.1,
             "outcomes": {g: int(g == "g0") for g in games}}
    moved = {"kind": "eval", "iteration": 5, "tasks": 10, "won": 7, "success": 0.7,
             "outcomes": {g: int(g in {"g0", "g1", "g2", "g3", "g4", "g5", "g6"}) for g in games}}
    same = {**moved, "won": 2, "success": 0.2, "outcomes": {g: int(g in {"g1", "g2"}) for g in games}}
    assert eval_text(first) == "10.0% [1.8, 40.4] of 10"
    line = learning_verdict([moved, first])  # in any order: first and last by iteration
    assert "10.0% -> 70.0% on the same 10 games (+60.0 points; 6 games newly won, 0 lost; exact McNemar p = 0.031)" in line
    assert line.endswith("a gain beyond noise")
    assert learning_verdict([first, same]).endswith("not beyond noise")  # +2 -1: p = 1
    one = {**moved, "won": 2, "success": 0.2, "outcomes": {g: int(g in {"g0", "g1"}) for g in games}}
    assert "(+10.0 points; 1 game newly won, 0 lost;" in learning_verdict([first, one])
    assert learning_verdict([first]) is None


def test_eval_with_samples_runs_n_episodes_per_game_and_bootstraps_over_games(tmp_path, tiny_actor_dir):
    """`agentrl eval --samples 3` on the synthetic task with a real (tiny) model: 3 episodes per
    game, sampled (not greedy), the interval a bootstrap over games; the compare command reads
    the shares won per game."""
    from agentrl.config import load_config
    from agentrl.evaluate import run_eval, summary

    cfg = load_config(None, {"model.name": str(tiny_actor_dir), "env.kind": "synthetic", "env.max_steps": 1,
                             "rollout.gate": "off", "eval.limit": 4, "eval.samples": 3, "sampling.temperature": 1.0, "sampling.max_new_tokens": 16})
    result = run_eval(cfg, tmp_path / "e")
    s = summary(result, cfg)
    assert s["samples"] == 3 and s["temperature"] == 1.0
    assert s["overall"]["episodes"] == 12 and s["overall"]["games"] == 4
    assert sorted({t.index for t in result.trajectories}) == [0, 1, 2]
    lo, hi = s["overall"]["ci95"]
    assert 0.0 <= lo <= s["overall"]["success_rate"] <= hi <= 1.0
    from agentrl.compare import game_outcomes

    shares, _ = game_outcomes(tmp_path / "e")
    assert len(shares) == 4 and all(v in (0.0, 1 / 3, 2 / 3, 1.0) for v in shares.values())
    assert sum(shares.values()) * 3 == pytest.approx(s["overall"]["won"])


def test_seed_interval_by_hand():
    """The mean of the seeds' differences and its Student t interval: zero's three seeds in
    docs/measurements/tier3.md (-0.4, -2.2, -0.4 points): sd = sqrt(1.08), t(0.975, 2) = 4.3027."""
    from agentrl.stats import seed_interval

    r = seed_interval([-0.4, -2.2, -0.4])
    half = 4.302652729749464 * math.sqrt(1.08) / math.sqrt(3)
    assert r["seeds"] == 3 and r["mean"] == pytest.approx(-1.0) and r["sd"] == pytest.approx(math.sqrt(1.08))
    assert r["ci95"] == pytest.approx((-1.0 - half, -1.0 + half))
    assert round(r["ci95"][0], 1) == -3.6 and round(r["ci95"][1], 1) == 1.6
    assert seed_interval([2.0])["ci95"] is None and seed_interval([1.0, 1.0])["ci95"] == pytest.approx((1.0, 1.0))


def test_compare_pairs_two_arms_seed_by_seed(tmp_path):
    """`agentrl compare A0 A1 A2 vs B0 B1 B2`: each side pooled per game as with several B, and
    seed s of A paired with seed s of B, with the mean difference and a t interval over the seeds;
    unequal seed counts, `vs` twice and an empty side are one-line errors."""
    games = [(f"g{i}", "heat", 0) for i in range(10)]
    wins = {"a0": {"g0", "g1"}, "a1": {"g0"}, "a2": {"g0", "g1", "g2"},
            "b0": {"g0", "g1", "g3", "g4"}, "b1": {"g0", "g5", "g6"}, "b2": {"g0", "g1", "g2", "g3", "g4", "g7"}}
    for name, won in wins.items():
        write_eval(tmp_path / name, [(g, t, int(g in won)) for g, t, _ in games])
    arms = [str(tmp_path / n) for n in ("a0", "a1", "a2")] + ["vs"] + [str(tmp_path / n) for n in ("b0", "b1", "b2")]
    cli = [sys.executable, "-m", "agentrl.cli", "compare"]
    proc = subprocess.run(cli + arms + ["--out", str(tmp_path / "cmp")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert (r["a_evals"], r["b_evals"]) == (3, 3)
    assert r["overall"]["success_a"] == pytest.approx(6 / 30) and r["overall"]["success_b"] == pytest.approx(13 / 30)
    pairs = r["by_seed"]["pairs"]
    assert [p["difference_points"] for p in pairs] == pytest.approx([20.0, 20.0, 30.0])
    assert [(p["won_only_by_a"], p["won_only_by_b"]) for p in pairs] == [(0, 2), (0, 2), (0, 3)]
    d = r["by_seed"]["difference_points"]  # mean 23.33, sd 5.774, t(0.975, 2) 4.3027
    half = 4.302652729749464 * math.sqrt(100 / 3) / math.sqrt(3)
    assert d["mean"] == pytest.approx(70 / 3) and d["ci95"] == pytest.approx((70 / 3 - half, 70 / 3 + half))
    out = " ".join(proc.stdout.split())
    assert "over 3 seeds, B - A: +23.3 points, 95% t interval over the seeds [+9.0, +37.7]: B is above A" in out
    for bad, why in ((arms[:4] + arms[5:], "3 evals of A against 2 of B"), (arms[:4] + arms[3:], "`vs` twice"),
                     (arms[:4], "nothing after `vs`")):
        proc = subprocess.run(cli + bad, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and why in proc.stderr, proc.stderr
    from agentrl.compare import compare
    assert "by_seed" not in compare(tmp_path / "a0", [tmp_path / "b0", tmp_path / "b1"])  # one A: B pooled, no pairs


def test_rank_correlation_by_hand_and_where_there_is_no_ranking():
    """Spearman's rho: a perfectly falling relation reads -1, a rising one +1 whatever its shape;
    fewer than 3 points or a constant side give none (the pooled report row then prints -)."""
    from agentrl.stats import rank_correlation

    down = rank_correlation([0.1, 0.2, 0.3, 0.4], [0.9, 0.5, 0.4, 0.0])
    assert down["points"] == 4 and down["rho"] == pytest.approx(-1.0)
    assert rank_correlation([1, 2, 3, 4], [1, 8, 27, 64])["rho"] == pytest.approx(1.0)
    assert rank_correlation([1, 2], [2, 1]) is None and rank_correlation([1, 2, 3], [0.5] * 3) is None
    assert rank_correlation([0.3] * 3, [1, 2, 3]) is None


def test_compare_says_when_the_two_sides_ran_at_other_numerics(tmp_path):
    """The same config gives bf16 on one CPU and fp32 on another (bf16-if-native): comparing such
    evals says so, from each eval's summary.json machine record; the same numerics, or an eval
    without one (kept outcomes, older evals), say nothing."""
    from agentrl.compare import compare

    games = [(f"g{i}", "heat", i % 2) for i in range(6)]
    bf16 = {"dtype": "bfloat16", "device": "cpu", "cpu_capability": "AVX512"}
    fp32 = {"dtype": "float32", "device": "cpu", "cpu_capability": "AVX2"}
    for name, record in (("a", bf16), ("b", fp32), ("c", bf16), ("d", None)):
        write_eval(tmp_path / name, games)
        if record:
            (tmp_path / name / "summary.json").write_text(json.dumps({"machine": record}))
    assert compare(tmp_path / "a", tmp_path / "b")["numerics"] == {"a": ["bfloat16 on cpu (AVX512)"],
                                                                   "b": ["float32 on cpu (AVX2)"]}
    assert "numerics" not in compare(tmp_path / "a", tmp_path / "c")
    assert "numerics" not in compare(tmp_path / "a", tmp_path / "d")
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "compare", str(tmp_path / "a"), str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "A ran at bfloat16 on cpu (AVX512), B at float32 on cpu (AVX2)" in " ".join(proc.stderr.split())
