"""agentrl analyze on a synthetic groups table with known answers."""

import csv
import json
import subprocess
import sys

import pytest

from agentrl.analysis.gate import analyze, read_groups
from agentrl.errors import UserError
from agentrl.rollout.signals import SIGNALS

# K=10, G=2: d_K separates perfectly; two zero-variance groups (d 0.0, 0.05), two informative (0.3, 0.5)
GROUPS = [("t1", 0.0, "0;0"), ("t2", 0.05, "1;1"), ("t3", 0.3, "1;0"), ("t4", 0.5, "0;1")]


def write_table(path, groups=GROUPS, K=10):
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["task_id", "task_type", "K", *SIGNALS, "rewards", "cut", "steps_generated"])
        w.writeheader()
        for i, (tid, d, rewards) in enumerate(groups):
            row = {s: 0.5 for s in SIGNALS} | {"prefix_edit_distance_mean": d, "termination_fraction": 0.0}
            w.writerow(row | {"task_id": tid, "task_type": "pick_and_place_simple" if i % 2 else "look_at_obj_in_light",
                              "K": K, "rewards": rewards, "cut": 0, "steps_generated": 20})
    return path


def test_known_answers(tmp_path):
    a = analyze(write_table(tmp_path / "g.csv"), tmp_path / "out", t_max=30, precision_floor=0.8)
    d = next(r for r in a.correlation if r["metric"] == "prefix_edit_distance_mean")
    assert d["auroc"] == 1.0 and d["spearman_rho"] == pytest.approx(0.894427, abs=1e-5)
    const = next(r for r in a.correlation if r["metric"] == "unique_action_ratio")
    assert const["auroc"] == 0.5 and const["spearman_rho"] != const["spearman_rho"]  # constant signal: rho undefined
    at = {r["d_L"]: r for r in a.sweep}
    assert (at[0.1]["cut"], at[0.1]["TP"], at[0.1]["FP"], at[0.1]["precision"], at[0.1]["recall"]) == (2, 2, 0, 1.0, 1.0)
    assert at[0.1]["safe_pct"] == pytest.approx(100 * 2 * 20 / (4 * 30)) and at[0.1]["adv_l2_kept"] == pytest.approx(1.0)
    assert (at[0.4]["cut"], at[0.4]["FP"]) == (3, 1) and at[0.4]["precision"] == pytest.approx(2 / 3)
    assert at[0.4]["raw_pct"] == pytest.approx(50.0) and at[0.4]["adv_l2_kept"] == pytest.approx(2 ** -0.5, abs=1e-4)
    assert (a.operating["K"], a.operating["d_L"]) == (10, 0.06)
    cal = {r["method"]: r for r in a.calibration}
    assert cal["oracle"]["cut"] == 2 and cal["oracle"]["precision"] == 1.0
    assert cal["gate"]["precision"] == 1.0 and cal["random"]["cut"] == 2 and cal["random"]["precision"] < 1.0
    assert {r["task_type"]: r["auroc_d_K"] for r in a.by_type} == {"look_at_obj_in_light": 1.0, "pick_and_place_simple": 1.0}
    for name in ("correlation.csv", "gate_sweep.csv", "calibration.csv", "by_task_type.csv", "bootstrap.csv",
                 "signals_heatmap.png", "d_K_histogram.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    op = json.loads((tmp_path / "out" / "operating_point.json").read_text())
    assert op["point"]["d_L"] == 0.06
    boot = {r["statistic"]: r for r in a.bootstrap}
    assert boot["safe_pct"]["ci95_low"] <= boot["safe_pct"]["estimate"] <= boot["safe_pct"]["ci95_high"]


def test_gigpo_mass_kept_by_each_cut_comes_from_the_trajectories_beside_the_table(tmp_path):
    """With trajectories.jsonl beside groups.csv the sweep also says how much of GiGPO's advantage
    mass a cut keeps: t2 is all-success (no GRPO signal) but won in 1 and 2 steps, so under GiGPO
    cutting it drops mass. Hand numbers (gamma 0.95): t2's step group s0 has returns 1 and 0.95,
    A = +-0.7071, mass 1; t3, t4 (1 step each, one win): A_E = A_S = +-0.7071, mass 4 each; t1: 0."""
    def record(task, reward, n_steps):
        steps = [{"observation": f"{task} obs {k}", "valid": True} for k in range(n_steps)]
        return {"task_id": task, "reward": reward, "initial_observation": "s0", "step_records": steps,
                "step_tokens": [3] * n_steps}

    recs = [record("t1", 0.0, 2), record("t1", 0.0, 2), record("t2", 1.0, 1), record("t2", 1.0, 2),
            record("t3", 1.0, 1), record("t3", 0.0, 1), record("t4", 0.0, 1), record("t4", 1.0, 1)]
    (tmp_path / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    a = analyze(write_table(tmp_path / "groups.csv"), tmp_path / "out", t_max=30)
    at = {r["d_L"]: r for r in a.sweep}
    assert at[0.1]["adv_l2_kept"] == pytest.approx(1.0)  # GRPO: the cut groups had nothing
    assert at[0.1]["gigpo_l2_kept"] == pytest.approx((8 / 9) ** 0.5, abs=1e-4)  # GiGPO: t2's step signal is dropped
    assert at[0.4]["gigpo_l2_kept"] == pytest.approx((4 / 9) ** 0.5, abs=1e-4)
    assert at[0.02]["gigpo_l2_kept"] == pytest.approx(1.0)  # nothing cut
    plain = analyze(write_table(tmp_path / "alone" / "groups.csv") if (tmp_path / "alone").mkdir() is None else None,
                    tmp_path / "out2", t_max=30)
    assert all(r["gigpo_l2_kept"] != r["gigpo_l2_kept"] for r in plain.sweep)  # no trajectories: NaN


def test_the_bootstrap_aurocs_equal_mann_whitney_u_on_each_resample():
    """The bootstrap's AUROCs, counted over the distinct scores all at once, are scipy's
    Mann-Whitney U / (n_pos * n_neg) on each resample exactly: ties, a resample without one
    class (NaN), a NaN score (NaN), an empty table."""
    import numpy as np
    from scipy.stats import mannwhitneyu

    from agentrl.analysis.gate import auroc, aurocs

    def reference(score, positive):
        a, b = score[positive], score[~positive]
        return float("nan") if len(a) == 0 or len(b) == 0 else mannwhitneyu(a, b).statistic / (len(a) * len(b))

    rng = np.random.default_rng(0)
    for trial in range(60):
        n = int(rng.integers(1, 30))
        score = rng.integers(0, 4, n).astype(float) if trial % 2 else rng.normal(size=n)  # ties, then none
        if trial % 5 == 0:
            score[rng.integers(0, n)] = np.nan
        positive = rng.random(n) < 0.5
        draws = rng.integers(0, n, size=(40, n))
        want = np.array([reference(score[i], positive[i]) for i in draws])
        np.testing.assert_array_equal(aurocs(score, positive, draws), want)
        assert auroc(score, positive) == pytest.approx(reference(score, positive), nan_ok=True)
    assert auroc(np.array([0.1, 0.2, 0.2, 0.9]), np.array([False, False, True, True])) == 0.875  # (1 + 0.5 + 2) / 4
    assert np.isnan(auroc(np.zeros(0), np.zeros(0, dtype=bool)))


@pytest.mark.parametrize(
    "text, message",
    [
        ("task_id,K\nx,1\n", "missing columns"),
        (None, r"g.csv:3: bad value"),
        ("", "missing columns"),
    ],
)
def test_malformed_tables(tmp_path, text, message):
    p = tmp_path / "g.csv"
    if text is None:
        write_table(p)
        lines = p.read_text().splitlines()
        lines[2] = lines[2].replace(",10,", ",ten,")
        p.write_text("\n".join(lines) + "\n")
    else:
        p.write_text(text)
    with pytest.raises(UserError, match=message):
        read_groups(p)


def test_cli_analyze_bad_table_is_one_line(tmp_path):
    p = tmp_path / "g.csv"
    p.write_text("task_id,K\nx,1\n")
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "analyze", str(p), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "missing columns" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_cli_analyze_prints_the_operating_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "analyze", str(write_table(tmp_path / "g.csv")),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, env={"COLUMNS": "200", "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    assert "operating point (precision >= 0.8): K=10, d_L=0.06" in proc.stdout


def test_signal_table_ranks_each_signal_against_each_outcome_kind(tmp_path):
    """Constructed: d_K separates informative groups from all-fail ones but not from the
    all-success one (it converged less than one informative group); termination_fraction marks
    the all-success group (one of its rows finished early); the OR-rule of the two cuts both
    zero-variance kinds. s2 finished by K (tau 1): the gate never looks at it, so it is counted
    nowhere (with it, d_K's AUROC would be 7/8 and d_K < 0.3 would cut three groups)."""
    groups = [("f1", 0.0, 0.0, "0;0"), ("f2", 0.05, 0.0, "0;0"), ("s1", 0.4, 0.5, "1;1"),
              ("i1", 0.3, 0.0, "1;0"), ("i2", 0.5, 0.0, "0;1"), ("s2", 0.0, 1.0, "1;1")]
    path = tmp_path / "g.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["task_id", "task_type", "K", *SIGNALS, "rewards", "cut", "steps_generated"])
        w.writeheader()
        for tid, d, tau, rewards in groups:
            w.writerow({s: 0.5 for s in SIGNALS} | {"prefix_edit_distance_mean": d, "termination_fraction": tau,
                       "task_id": tid, "task_type": "look_at_obj_in_light", "K": 5, "rewards": rewards, "cut": 0,
                       "steps_generated": 10})
    a = analyze(path, tmp_path / "out", t_max=30, precision_floor=0.8)
    row = {r["signal"]: r for r in a.signals}
    d = row["prefix_edit_distance_mean"]
    assert (d["N"], d["running"], d["informative"], d["all_fail"], d["all_success"]) == (6, 5, 2, 2, 1)
    assert d["auroc_vs_all_fail"] == 1.0 and d["auroc_vs_all_success"] == 0.5  # 0.3 < 0.4 < 0.5: one of two pairs
    assert d["auroc"] == pytest.approx(5 / 6)  # 2 x 3 pairs, 5 ordered right
    assert d["auroc_ci95_low"] <= d["auroc"] <= d["auroc_ci95_high"]
    assert (d["best_cut"], d["best_precision"]) == (2, 1.0)  # d_K < 0.3 cuts f1, f2 (not s2: finished)
    assert d["best_safe_pct"] == pytest.approx(100 * 2 * 25 / (6 * 30))  # a share of all six groups
    assert d["best_tokens_pct"] != d["best_tokens_pct"]  # no trajectories beside the table: not measured
    tau = row["termination_fraction"]  # oriented 1 - tau: s1 (tau 0.5) is the most converged
    assert tau["auroc_vs_all_success"] == 1.0 and tau["auroc_vs_all_fail"] == pytest.approx(0.5)
    assert row["or_rule"]["best_cut"] == 3 and row["or_rule"]["best_precision"] == 1.0
    d_l, tau_h = (float(x.split("<" if "<" in x else ">=")[1]) for x in row["or_rule"]["best_threshold"].split(" or "))
    assert 0.05 < d_l <= 0.3 and tau_h == 0.5  # a rule that cuts f1, f2 (d_K) and s1 (tau), never i2
    assert (tmp_path / "out" / "signals.csv").stat().st_size > 0


def test_savings_are_measured_in_step_tokens_and_a_finished_group_is_never_cut(tmp_path):
    """Constructed, K 2, G 2, trajectories.jsonl beside the table (step-tokens per env step):
    a all-fail, running, [1,2,3,4,5] per row: 30 tokens, 24 after step 2; b all-success, both rows
    won by step 2, [10,10]: 40, none after (tau 1: the gate never looks); c informative, [2,2,2]
    won and [2,2,2,2,2] lost: 16, 8 after; d all-success still running, [1,1,1] each: 6, 2 after.
    92 step-tokens in all. d_K < 0.2 takes a and d (b is below it too but finished): 26 of 92
    measured, against the paper's formula 2 (30 - 2) / (4 x 30); the oracle saves the same."""
    groups = [("a", 0.0, 0.0, "0;0", [[1, 2, 3, 4, 5]] * 2), ("b", 0.0, 1.0, "1;1", [[10, 10]] * 2),
              ("c", 0.5, 0.0, "1;0", [[2, 2, 2], [2, 2, 2, 2, 2]]), ("d", 0.1, 0.0, "1;1", [[1, 1, 1]] * 2)]
    path = tmp_path / "groups.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["task_id", "task_type", "K", *SIGNALS, "rewards", "cut", "steps_generated"])
        w.writeheader()
        for tid, d, tau, rewards, _ in groups:
            w.writerow({s: 0.5 for s in SIGNALS} | {"prefix_edit_distance_mean": d, "termination_fraction": tau,
                       "task_id": tid, "task_type": "look_at_obj_in_light", "K": 2, "rewards": rewards, "cut": 0,
                       "steps_generated": 10})
    recs = [{"task_id": tid, "reward": float(r), "initial_observation": "s0", "step_tokens": toks,
             "step_records": [{"observation": f"{tid} {k}", "valid": True} for k in range(len(toks))]}
            for tid, _, _, rewards, rows in groups for r, toks in zip(rewards.split(";"), rows)]
    (tmp_path / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    a = analyze(path, tmp_path / "out", t_max=30, precision_floor=0.8)
    at = {r["d_L"]: r for r in a.sweep}
    r = at[0.2]
    assert (r["N"], r["running"], r["cut"], r["TP"], r["precision"], r["recall"]) == (4, 3, 2, 2, 1.0, 1.0)
    assert r["tokens_pct"] == pytest.approx(100 * 26 / 92) and r["tokens_safe_pct"] == pytest.approx(100 * 26 / 92)
    assert r["safe_pct"] == pytest.approx(100 * 2 * 28 / (4 * 30))
    assert at[0.6]["cut"] == 3 and at[0.6]["tokens_pct"] == pytest.approx(100 * 34 / 92)  # c too: raw, not safe
    assert at[0.6]["tokens_safe_pct"] == pytest.approx(100 * 26 / 92)
    d = next(x for x in a.signals if x["signal"] == "prefix_edit_distance_mean")
    assert d["oracle_tokens_pct"] == pytest.approx(100 * 26 / 92) and d["best_tokens_pct"] == pytest.approx(100 * 26 / 92)
    cal = {x["method"]: x for x in a.calibration}
    assert cal["oracle"]["cut"] == 2  # b is zero-variance but finished: nothing to cut
    fixed = {x["signal"]: x for x in a.signals if x["best_threshold"] == "fixed"}  # the rules as a user runs them
    assert (fixed["nowin"]["best_cut"], fixed["nowin"]["best_precision"]) == (3, pytest.approx(2 / 3))  # a, c, d: no row ended
    assert fixed["nowin"]["best_tokens_pct"] == pytest.approx(100 * 34 / 92)
    assert (fixed["d_K<0.12"]["best_cut"], fixed["d_K<0.12"]["best_precision"]) == (2, 1.0)  # a, d (b finished)


def test_the_classifier_row_reads_the_signals_together(tmp_path):
    """Constructed: a group is zero-variance when d_K + obs_unique_ratio < 0.8 and informative when
    it is > 1.2 (a diagonal boundary). Each signal alone overlaps; the cross-fitted classifier on
    the seven ranks every group right, so it beats both and cuts at full precision."""
    path = tmp_path / "g.csv"
    grid = [round(0.05 + 0.1 * i, 2) for i in range(10)]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["task_id", "task_type", "K", *SIGNALS, "rewards", "cut", "steps_generated"])
        w.writeheader()
        for i, (d, obs) in enumerate((d, o) for d in grid for o in grid if abs(d + o - 1.0) > 0.2):
            rewards = "1;0" if d + obs > 1.0 else ("0;0" if i % 2 else "1;1")
            w.writerow({s: 0.5 for s in SIGNALS} | {"prefix_edit_distance_mean": d, "obs_unique_ratio": obs,
                       "termination_fraction": 0.0, "task_id": f"t{i}", "task_type": "look_at_obj_in_light", "K": 5,
                       "rewards": rewards, "cut": 0, "steps_generated": 10})
    row = {r["signal"]: r for r in analyze(path, tmp_path / "out", t_max=30, precision_floor=0.8).signals}
    combined, d, obs = row["classifier"], row["prefix_edit_distance_mean"], row["obs_unique_ratio"]
    assert d["auroc"] < 1.0 and obs["auroc"] < 1.0
    assert combined["auroc"] == 1.0 and combined["best_precision"] == 1.0
    assert combined["best_cut"] == combined["N"] - combined["informative"]  # every zero-variance group, nothing else
    assert row["classifier+guard"]["auroc"] == 1.0  # no row had ended: the guard spares nothing


def test_the_guarded_classifier_row_never_cuts_a_group_with_a_win(tmp_path):
    """Constructed, K 5: six all-fail groups and four informative ones that already had a win by K
    (termination 0.5) share d_K 0.1; six informative ones without a win sit at d_K 0.9. The guarded
    row's best cut is the six all-fail groups, at precision 1."""
    path = tmp_path / "g.csv"
    groups = [(0.1, 0.0, "0;0")] * 6 + [(0.1, 0.5, "1;0")] * 4 + [(0.9, 0.0, "0;1")] * 6
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["task_id", "task_type", "K", *SIGNALS, "rewards", "cut", "steps_generated"])
        w.writeheader()
        for i, (d, tau, rewards) in enumerate(groups):
            w.writerow({s: 0.5 for s in SIGNALS} | {"prefix_edit_distance_mean": d, "termination_fraction": tau,
                       "task_id": f"t{i}", "task_type": "look_at_obj_in_light", "K": 5, "rewards": rewards, "cut": 0,
                       "steps_generated": 10})
    guard = {r["signal"]: r for r in analyze(path, tmp_path / "out", t_max=30, precision_floor=0.8).signals}["classifier+guard"]
    assert (guard["best_cut"], guard["best_precision"], guard["best_recall"]) == (6, 1.0, 1.0)


def test_a_table_written_before_issue_49_lacks_two_signals_and_still_reads(tmp_path):
    """groups.csv from before the invalid-action and NLL signals has the seed paper's seven: analyze
    reads it and ranks only the signals it has (the classifier too)."""
    from agentrl.specs import PAPER_SIGNALS

    path = write_table(tmp_path / "g.csv")
    rows = list(csv.DictReader(path.open()))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[c for c in rows[0] if c in PAPER_SIGNALS or c not in SIGNALS])
        w.writeheader()
        w.writerows({k: v for k, v in r.items() if k in w.fieldnames} for r in rows)
    assert list(read_groups(path).signals) == list(PAPER_SIGNALS)
    a = analyze(path, tmp_path / "out", t_max=30, precision_floor=0.8)
    assert {r["signal"] for r in a.signals} >= set(PAPER_SIGNALS)
    assert not {r["signal"] for r in a.signals} & {"invalid_action_fraction", "reply_nll_mean"}


def test_precision_at_half_the_all_fail_groups(tmp_path):
    """Constructed, K 5: four all-fail groups (d 0.1, 0.2, 0.6, 0.7), one all-success (0.3), three
    informative (0.4, 0.5, 0.8). Cutting half the all-fail groups takes d_K < 0.2+: precision 1.0
    (f1, f2); the d_K row says so, and a signal that is constant cannot reach half without
    cutting everything (precision 5/8)."""
    groups = [("f1", 0.1, "0;0"), ("f2", 0.2, "0;0"), ("f3", 0.6, "0;0"), ("f4", 0.7, "0;0"), ("s1", 0.3, "1;1"),
              ("i1", 0.4, "1;0"), ("i2", 0.5, "0;1"), ("i3", 0.8, "1;0")]
    a = analyze(write_table(tmp_path / "g.csv", groups, K=5), tmp_path / "out", t_max=30, precision_floor=0.8)
    row = {r["signal"]: r for r in a.signals}
    assert row["prefix_edit_distance_mean"]["all_fail_r50_precision"] == 1.0
    assert 0.2 < row["prefix_edit_distance_mean"]["all_fail_r50_threshold"] <= 0.3
    assert row["action_entropy"]["all_fail_r50_precision"] == pytest.approx(5 / 8)  # 0.5 everywhere: all or nothing


def test_several_tables_are_pooled_and_a_task_in_two_is_refused(tmp_path):
    """Two chunks of one measurement (disjoint tasks) read as one table: the same numbers as one
    file holding both; the same task in two tables would count twice and is refused in one line."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    one = analyze(write_table(tmp_path / "g.csv"), tmp_path / "o1", t_max=30, precision_floor=0.8)
    a = write_table(tmp_path / "a" / "groups.csv", GROUPS[:2])
    b = write_table(tmp_path / "b" / "groups.csv", GROUPS[2:])
    two = analyze([a, b], tmp_path / "o2", t_max=30, precision_floor=0.8)
    same = lambda x, y: json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True)  # noqa: E731 (NaN == NaN)
    assert same(two.operating, one.operating) and same(two.signals, one.signals) and same(two.sweep, one.sweep)
    with pytest.raises(UserError, match="t1 is in .* and in"):
        analyze([a, a], tmp_path / "o3", t_max=30)
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "analyze", str(a), str(b), "--out", str(tmp_path / "o4")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "2 tables pooled" in " ".join(proc.stdout.split())


def test_tier1_nowin_cuts_the_groups_without_a_win_by_K_and_counts_their_tokens(tmp_path, capsys, monkeypatch):
    """benchmarks/tier1_nowin.py on constructed trajectories: an all-fail group running past K is
    cut, an informative group whose first win comes after K is cut too (the rule's cost), one won
    by K is not, nor a group that ended by K; the oracle takes only the zero-variance groups still
    running."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "tier1_nowin.py"
    spec = importlib.util.spec_from_file_location("tier1_nowin", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = []
    for task, trajs in {"fail": [(0, 12), (0, 12)], "late": [(1, 12), (0, 12)], "early": [(1, 2), (0, 12)],
                        "done": [(1, 3), (1, 2)]}.items():
        for won, steps in trajs:
            rows.append({"task_id": task, "reward": float(won), "steps": steps, "step_tokens": [10] * steps})
    (tmp_path / "trajectories.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    G = bench.load([tmp_path], exclude={"done"})
    assert len(G) == 3  # fail, late, early
    m = bench.at_K(G, 10)
    assert m["cut"].tolist() == [True, True, False] and m["running"].tolist() == [True, True, True]
    assert m["after"].tolist() == [40.0, 40.0, 20.0] and m["oracle"].tolist() == [40.0, 0.0, 0.0]
    assert bench.at_K(bench.load([tmp_path], exclude=set()), 3)["cut"].tolist() == [True, True, False, False]
    monkeypatch.setattr(sys, "argv", ["tier1_nowin.py", str(tmp_path), "--exclude", "done", "--k", "10", "--resamples", "50"])
    bench.main()
    out = capsys.readouterr().out
    assert "3 groups, 6 trajectories: won 2 = 33.3%" in out and "nowin: cut 2, precision 0.50" in out
