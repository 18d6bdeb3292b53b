"""`agentrl report`: per-run numbers, the baseline/gated pair (paper Table 5), figures, bad input."""

from __future__ import annotations

import json

import pytest

from agentrl.errors import UserError
from agentrl.io import read_jsonl
from agentrl.report import build_report, load_run, report_markdown

CONFIG = """seed: {seed}
model:
  name: default
rollout:
  tasks: 4
  group_size: 8
  gate: {gate}
train:
  iterations: 3
  eval_split: valid_seen
"""


def iteration(i, elapsed, grad, cut, zero_var, reward, **extra):
    return {"kind": "iteration", "iteration": i, "groups": 4, "groups_cut": cut, "zero_variance_groups": zero_var,
            "zero_variance_all_fail": zero_var, "zero_variance_all_success": 0, "zero_adv_fraction": zero_var / 4,
            "grad_l2_norm": grad, "loss": 0.1, "train_reward": reward, "step_tokens_generated": 1000,
            "step_tokens_trained": 1000 - 100 * cut, "trajectories_trained": 8 * (4 - cut), "rollout_s": 20.0,
            "train_s": 10.0, "swap_s": 1.0, "eval_s": 0.0, "iteration_s": 31.0, "elapsed_s": elapsed,
            "adapter_version": i, "logprob_gap": 0.01, "skipped_update": False, **extra}


def evaluation(i, success, split="valid_seen", won=None):
    row = {"kind": "eval", "iteration": i, "split": split, "tasks": 8, "success": success,
           "by_task_type": {"pick_and_place_simple": {"episodes": 8, "success": success}}, "eval_s": 5.0,
           "adapter_version": i}
    if won is not None:  # the games won of g0..g7: per-game outcomes, as agentrl train writes them
        row["outcomes"] = {f"g{k}": int(k in won) for k in range(8)}
    return row


def write_run(path, seed, gate, rows, torn=False):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(CONFIG.format(seed=seed, gate=gate))
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (path / "metrics.jsonl").write_text(text + ('{"kind": "iteration", "iterat' if torn else ""))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("runs")
    baseline = write_run(tmp_path / "baseline", 7, "off", [  # a bare YAML off reads as False: still "off"
        evaluation(0, 0.25),
        iteration(1, 100.0, 2.0, 0, 2, 0.5),
        iteration(2, 200.0, 2.0, 0, 1, None),
        {"kind": "heartbeat", "t": 1},
        iteration(3, 300.0, 2.0, 0, 1, 0.25, unknown_key="ignored"),
        evaluation(3, 0.5, won={0, 1, 2, 3}),
        evaluation(3, 0.0, split="train"),  # not the held-out split
    ])
    gated = write_run(tmp_path / "gated", 7, '"10,0.12"', [
        iteration(1, 80.0, 3.0, 2, 0, 1.0, train_success=0.5, step_tokens_generated=900, rollout_s=16.0),
        evaluation(0, 0.25),
        iteration(2, 160.0, 3.0, 1, 1, 0.5, train_success=0.25, step_tokens_generated=950, rollout_s=16.0),
        evaluation(2, 0.75),
        iteration(3, 240.0, 3.0, 0, 0, 0.0, train_success=0.0, rollout_s=16.0),
        evaluation(3, 0.625, won={0, 1, 2, 4, 5}),
    ], torn=True)
    return baseline, gated


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return build_report(list(runs), out), out


def test_pair_is_the_papers_table5(runs, report):
    baseline, gated = runs
    rep, _ = report
    (pair,) = rep["pairs"]
    assert pair["seed"] == 7 and pair["gate"] == "10,0.12" and pair["cut_groups"] == "drop"  # the default: the paper's
    assert pair["baseline"] == str(baseline) and pair["gated"] == str(gated)
    assert pair["wall_clock_change_pct"] == pytest.approx(-20.0)  # 240 / 300 - 1
    assert pair["groups_cut"] == 3
    assert pair["grad_norm_ratio"] == pytest.approx(1.5) and pair["grad_norm_iterations"] == 3
    assert pair["heldout_delta_pts"] == pytest.approx(12.5)  # final evals 0.625 - 0.5
    assert pair["heldout_iteration"] == 3
    assert (pair["zero_variance_groups_baseline"], pair["zero_variance_groups_gated"]) == (4, 1)
    # the Tier 3 measure: rollout step-tokens 2,850 against 3,000, rollout seconds 48 against 60
    assert (pair["step_tokens_baseline"], pair["step_tokens_gated"], pair["iterations_compared"]) == (3000, 2850, 3)
    assert pair["step_tokens_saved_pct"] == pytest.approx(5.0)
    assert pair["rollout_s_change_pct"] == pytest.approx(-20.0)
    assert (pair["train_success_baseline"], pair["train_success_gated"]) == (None, pytest.approx(0.25))
    # the final evals paired on the same 8 games: g4, g5 won by the gated arm alone, g3 by the baseline alone
    assert pair["heldout_paired"] == {"iteration": 3, "split": "valid_seen", "games": 8, "difference_points": 12.5,
                                      "mcnemar_p": 1.0, "won_only_by_gated": 2, "won_only_by_baseline": 1}


def test_the_pair_says_how_the_cut_groups_entered_the_loss(runs, tmp_path):
    """`advantage.cut_groups: zero` (cut groups in N at A = 0) changes what the grad-norm ratio
    means, so Table 5 names it beside the gate."""
    import shutil

    baseline, gated = runs
    zero = tmp_path / "gated-zero"
    shutil.copytree(gated, zero)
    (zero / "config.yaml").write_text(CONFIG.format(seed=7, gate='"10,0.12"') + "advantage:\n  cut_groups: zero\n")
    rep = build_report([baseline, zero], tmp_path / "out")
    (pair,) = rep["pairs"]
    assert pair["cut_groups"] == "zero"
    assert "10,0.12 · cut groups in N (zero)" in report_markdown(rep)


def test_the_grad_norm_ratio_is_of_the_steps_mean_where_both_runs_recorded_it(runs, tmp_path):
    """An update of several optimizer steps (raft's 16) records its first step's |g| and the mean
    over every step; the pair's ratio is of the means where both arms have them on every
    iteration, and falls back to the first step's (which every run has) where one arm lacks them."""
    baseline, gated = runs

    def with_means(src, name, gate, mean):
        rows = [{**r, "grad_l2_norm_mean": mean(r)} if r.get("kind") == "iteration" else r
                for r in read_jsonl(src / "metrics.jsonl")]
        return write_run(tmp_path / name, 7, gate, rows)

    b = with_means(baseline, "b-mean", "off", lambda r: 4.0)
    g = with_means(gated, "g-mean", '"10,0.12"', lambda r: 2.0 if r["iteration"] < 3 else 5.0)  # the first steps' ratio is 1.5
    rep = build_report([b, g], tmp_path / "out")
    (pair,) = rep["pairs"]
    assert pair["grad_norm_ratio"] == pytest.approx(0.75) and pair["grad_norm_iterations"] == 3  # (2 + 2 + 5) / 3 / 4
    assert pair["grad_norm"] == "mean over the update's steps"
    assert "| 3 | 0.750 (steps' mean) |" in report_markdown(rep)

    (pair,) = build_report([baseline, g], tmp_path / "mixed")["pairs"]  # the baseline predates the mean
    assert pair["grad_norm_ratio"] == pytest.approx(1.5) and pair["grad_norm"] == "the update's first step"


def test_per_run_numbers(report):
    rep, _ = report
    b, g = rep["runs"]
    assert (b["gate"], b["seed"], b["iterations"], b["iterations_planned"]) == ("off", 7, 3, 3)
    assert (b["final_heldout_success"], b["final_heldout_iteration"]) == (0.5, 3)
    assert (g["final_heldout_success"], g["best_heldout_success"], g["best_heldout_iteration"]) == (0.625, 0.75, 2)
    assert g["initial_heldout_success"] == 0.25
    assert b["wall_clock_s"] == 300.0 and g["wall_clock_s"] == 240.0
    assert b["mean_s_per_iteration"] == {"rollout": 20.0, "train": 10.0, "swap": 1.0, "eval": 0.0, "iteration": 31.0}
    assert b["mean_train_reward"] == pytest.approx(0.375)  # the null reward is left out
    assert g["mean_train_reward"] == pytest.approx(0.5)
    assert g["mean_train_success"] == pytest.approx(0.25)  # every trajectory, the cut ones as lost: below the uncut reward
    assert b["mean_train_success"] is None  # a run written before the metric
    assert (g["groups"], g["groups_cut"], g["zero_variance_groups"]) == (12, 3, 1)
    assert (g["step_tokens_generated"], g["step_tokens_trained"]) == (2850, 2700)


def test_files_and_markdown(report):
    rep, out = report
    names = {p.split("/")[-1] for p in rep["figures"]}
    assert names == {"heldout_success.png", "wall_clock.png", "train_reward.png", "cut_vs_zero_variance.png",
                     "zero_adv_grad_norm.png"}
    for p in rep["figures"]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(rep))
    md = (out / "report.md").read_text()
    assert md == report_markdown(rep)
    assert ("| gated | baseline | 7 | 10,0.12 | 3 / 3 | 5.0% (3,000 → 2,850 in 3 iterations) | -20.0% | -20.0% | 3 | 1.500 (first step) | "
            "+12.5 pts @3 (paired on 8, p = 1) | – → 0.250 | 4 → 1 |") in md
    assert not list(out.glob(".*.tmp")) and not list(out.glob(".*.png"))


def test_torn_last_line_is_skipped_with_a_warning(runs, caplog):
    run = load_run(runs[1])
    assert [r["iteration"] for r in run.iterations] == [1, 2, 3]
    assert any("torn last line" in w for w in run.warnings)
    assert "torn last line" in caplog.text


def test_table5_compares_the_iterations_both_arms_ran(runs, tmp_path):
    """A baseline stopped after 2 iterations: step-tokens and rollout seconds over iterations 1-2 of
    both arms, not 2 against 3; held-out success at iteration 2, the last both evaluated (the gated
    arm's 0.75 against 0.5), not the gated arm's iteration 3 against the baseline's 2; unpaired,
    since the gated arm's eval at 2 kept no per-game outcomes."""
    short = write_run(tmp_path / "short", 7, "off", [evaluation(0, 0.25), iteration(1, 100.0, 2.0, 0, 0, 0.5),
                                                     iteration(2, 200.0, 2.0, 0, 0, 0.5), evaluation(2, 0.5, won={0})])
    (pair,) = build_report([short, runs[1]], tmp_path / "out")["pairs"]
    assert (pair["step_tokens_baseline"], pair["step_tokens_gated"], pair["iterations_compared"]) == (2000, 1850, 2)
    assert pair["step_tokens_saved_pct"] == pytest.approx(7.5)
    assert pair["rollout_s_change_pct"] == pytest.approx(-20.0)  # 32 s against 40
    assert (pair["heldout_iteration"], pair["heldout_delta_pts"]) == (2, pytest.approx(25.0))
    assert pair["heldout_paired"] is None
    assert "| +25.0 pts @2 |" in report_markdown(build_report([short, runs[1]], tmp_path / "out2"))


def test_no_pair_without_a_same_seed_baseline(runs, tmp_path):
    other = write_run(tmp_path / "other", 8, "off", [iteration(1, 50.0, 1.0, 0, 0, 0.0)])
    rep = build_report([runs[1], other], tmp_path / "out")
    assert rep["pairs"] == []
    assert "Table 5" not in report_markdown(rep)


def test_one_run_defaults_to_run_report(runs):
    rep = build_report([runs[0]])
    assert (runs[0] / "report" / "report.md").is_file()
    assert rep["pairs"] == [] and len(rep["figures"]) == 5


def test_bad_runs(tmp_path):
    with pytest.raises(UserError, match="run directory not found: .*nope"):
        build_report([tmp_path / "nope"], tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no metrics.jsonl"):
        build_report([tmp_path / "empty"], tmp_path / "out")
    write_run(tmp_path / "evals_only", 0, "off", [evaluation(0, 0.1)])
    with pytest.raises(UserError, match="no iteration lines"):
        build_report([tmp_path / "evals_only"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli(runs, tmp_path):
    from typer.testing import CliRunner

    from agentrl.cli import app

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["report", str(runs[0]), str(runs[1]), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "Table 5" in result.output and "wrote report.md" in result.output
    assert (out / "report.json").is_file() and len(list(out.glob("*.png"))) == 5
    result = CliRunner().invoke(app, ["report", str(tmp_path / "nope")])
    assert isinstance(result.exception, UserError)


def test_heldout_success_reads_with_its_interval_and_the_paired_verdict(tmp_path):
    """The report's held-out cells carry the 95% Wilson interval and the game count; with per-game
    outcomes the first and last evals are paired (exact McNemar) into one verdict line."""
    games = [f"g{i}" for i in range(12)]
    first = {**evaluation(0, 2 / 12), "tasks": 12, "won": 2, "outcomes": {g: float(i < 2) for i, g in enumerate(games)}}
    last = {**evaluation(2, 10 / 12), "tasks": 12, "won": 10, "outcomes": {g: float(i < 10) for i, g in enumerate(games)}}
    run = write_run(tmp_path / "run", 1, "off", [first, iteration(1, 10.0, 1.0, 0, 0, 0.5),
                                                 iteration(2, 20.0, 1.0, 0, 0, 0.5), last])
    rep = build_report([run], tmp_path / "report")
    (r,) = rep["runs"]
    assert r["initial_heldout"] == "16.7% [4.7, 44.8] of 12" and r["final_heldout"] == "83.3% [55.2, 95.3] of 12"
    # 8 games won only at iteration 2, none only at 0: p = 2 / 2^8
    assert r["heldout_verdict"].endswith("+66.7 points; 8 games newly won, 0 lost; exact McNemar p = 0.0078): a gain beyond noise")
    md = (tmp_path / "report" / "report.md").read_text()
    assert "83.3% [55.2, 95.3] of 12 @2" in md and "- run: held-out success, iteration 0 -> 2" in md


def test_heldout_cells_of_older_runs_without_counts(report):
    rep, _ = report
    b, g = rep["runs"]
    assert g["final_heldout"] == "62.5% [30.6, 86.3] of 8"  # eval rows before `won`: the count from tasks x success
    assert b["heldout_verdict"] is None  # no per-game outcomes: nothing to pair


def test_the_curve_starts_at_the_base_model(tmp_path):
    """A run with the base model's eval (train.eval_base): the report's curve reads base ->
    iteration 0 (warm start) -> iteration 2, each with its interval and the paired change from the
    point before, and the warm start's gain gets its own verdict line."""
    games = [f"g{i}" for i in range(12)]

    def row(kind, it, won):
        return {**evaluation(it, won / 12), "kind": kind, "tasks": 12, "won": won,
                "outcomes": {g: float(i < won) for i, g in enumerate(games)}}

    run = write_run(tmp_path / "run", 1, "off", [row("base_eval", 0, 0), row("eval", 0, 9),
                                                 iteration(1, 10.0, 1.0, 0, 0, 0.5), iteration(2, 20.0, 1.0, 0, 0, 0.5),
                                                 row("eval", 2, 10)])
    with open(run / "config.yaml", "a") as f:
        f.write("  init_adapter: /warm\n")
    rep = build_report([run], tmp_path / "report")
    (r,) = rep["runs"]
    assert [(c["what"], c["heldout"]) for c in r["curve"]] == [
        ("base model", "0.0% [0.0, 24.2] of 12"), ("iteration 0 (warm start)", "75.0% [46.8, 91.1] of 12"),
        ("iteration 2", "83.3% [55.2, 95.3] of 12")]
    assert [c["change_pts"] for c in r["curve"]][:2] == [None, 75.0] and r["curve"][2]["change_pts"] == pytest.approx(100 / 12)
    assert r["warm_start_verdict"].startswith("held-out success, base model -> warm start (iteration 0): 0.0% -> 75.0%")
    assert r["warm_start_verdict"].endswith("a gain beyond noise")
    assert r["initial_heldout"] == "75.0% [46.8, 91.1] of 12"  # iteration 0 is still the warm start's eval
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| base model | 0.0% [0.0, 24.2] of 12 |" in md and "- run: held-out success, base model -> warm start" in md


def test_table5_pooled_over_seeds(tmp_path):
    """Three seeds of a baseline and a gated arm: step-tokens saved over all six iterations with a
    bootstrap over them, the held-out differences' mean with a t interval over the seeds, the
    gated arm's share of groups cut ranked against the ungated arm's train success (Spearman, worked
    by hand below); a gate setup at one seed only (the `zero` arm) and a setup with a seed twice
    are not pooled."""
    import math
    import shutil

    from agentrl.stats import bootstrap_saved

    gated_tokens = {7: (600, 800), 8: (700, 700), 9: (500, 900)}
    finals = {7: (0.5, 0.625), 8: (0.5, 0.5), 9: (0.25, 0.5)}  # (baseline, gated) held-out at iteration 2
    success = {7: (0.2, 0.4), 8: (0.3, 0.5), 9: (0.1, 0.6)}  # the ungated arm's train success, iterations 1 and 2
    cuts = {7: (3, 2), 8: (3, 1), 9: (4, 0)}  # groups the gate cut, of 4
    dirs = []
    for seed, tokens in gated_tokens.items():
        b, g = finals[seed]
        dirs.append(write_run(tmp_path / f"off{seed}", seed, "off", [
            iteration(1, 100.0, 2.0, 0, 1, 0.5, train_success=success[seed][0]),
            iteration(2, 200.0, 2.0, 0, 1, 0.5, train_success=success[seed][1]), evaluation(2, b)]))
        dirs.append(write_run(tmp_path / f"gated{seed}", seed, "10,nowin", [
            iteration(1, 80.0, 2.0, cuts[seed][0], 1, 0.5, step_tokens_generated=tokens[0], rollout_s=10.0, train_success=0.0),
            iteration(2, 160.0, 2.0, cuts[seed][1], 1, 0.5, step_tokens_generated=tokens[1], rollout_s=10.0), evaluation(2, g)]))
    zero = shutil.copytree(tmp_path / "gated7", tmp_path / "zero7")
    (zero / "config.yaml").write_text(CONFIG.format(seed=7, gate="10,nowin") + "advantage:\n  cut_groups: zero\n")
    rep = build_report([*dirs, zero], tmp_path / "out")
    assert len(rep["pairs"]) == 4
    (pool,) = rep["seed_pools"]
    assert (pool["gate"], pool["cut_groups"], pool["seeds"], pool["iterations_compared"]) == ("10,nowin", "drop", [7, 8, 9], 6)
    assert (pool["step_tokens_baseline"], pool["step_tokens_gated"]) == (6000, 4200)
    assert pool["step_tokens_saved_pct"] == pytest.approx(30.0)
    lo, hi = bootstrap_saved([1000] * 6, [600, 800, 700, 700, 500, 900])
    assert pool["step_tokens_saved_ci95"] == pytest.approx([100 * lo, 100 * hi]) and 10 < 100 * lo < 30 < 100 * hi < 50
    assert bootstrap_saved([1000] * 4, [700] * 4) == pytest.approx([0.3, 0.3])  # every iteration saves 30%
    assert pool["rollout_s_change_pct"] == pytest.approx(-50.0)  # 10 s against 20 each iteration
    held = pool["heldout_delta_over_seeds"]  # +12.5, 0, +25: mean 12.5, sd 12.5, t(0.975, 2) 4.3027
    half = 4.302652729749464 * 12.5 / math.sqrt(3)
    assert pool["heldout_iteration"] == 2 and held["mean"] == pytest.approx(12.5)
    assert held["ci95"] == pytest.approx([12.5 - half, 12.5 + half])
    # success 0.2 0.4 0.3 0.5 0.1 0.6 -> ranks 2 4 3 5 1 6; cut share .75 .5 .75 .25 1 0 -> ranks 4.5 3 4.5 2 6 1:
    # rank deviations' products sum to -17, their squares to 17.5 and 17 (the gated arm's own success is not read)
    rho = pool["cut_share_vs_train_success"]
    assert rho["points"] == 6 and rho["rho"] == pytest.approx(-17 / math.sqrt(17.5 * 17)) and rho["p"] < 0.01
    md = report_markdown(rep)
    assert "Table 5 pooled" in md and "| 10,nowin | 7, 8, 9 | 6 | 30.0% [" in md and "+12.5 pts [-18.6, +43.6] @2 |" in md
    assert "| ρ -0.99 (p = " in md and ", 6 iterations) |" in md
    again = shutil.copytree(tmp_path / "gated8", tmp_path / "gated8b")  # seed 8 twice: which pair would count?
    assert build_report([*dirs, again], tmp_path / "out2")["seed_pools"] == []
