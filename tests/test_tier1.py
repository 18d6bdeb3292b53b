"""The Tier 1 report (collect.tier1_report) on constructed per-group records, and its pairing of a
gated rollout with an earlier ungated one written to disk (`rollout --tier1-baseline`): the
numbers worked by hand, and the mismatches refused in one line. The real path, on real games:
tests/test_integration.py::test_tier1_ab_on_real_games."""

import json

import pytest

from agentrl.collect import oracle_saved_tokens, tier1_against, tier1_markdown, tier1_report
from agentrl.errors import UserError
from agentrl.specs import parse_gate

G = 2


def group(task, rewards, tokens, cut=False, audited=False, cost=10.0):
    return {"task_id": task, "task_type": "pick_and_place_simple", "rewards": rewards, "cut": cut, "audited": audited,
            "cut_step": 3 if cut else None, "env_steps": 10, "step_tokens": tokens, "generate_s": cost, "env_s": 0.0,
            "cost_s": cost, "wall_s": cost}


def summary(groups):
    rewards = [r for g in groups for r in g["rewards"]]
    return {"groups": len(groups), "trajectories": len(rewards), "groups_cut": sum(g["cut"] for g in groups),
            "zero_variance_groups": sum(len(set(g["rewards"])) == 1 for g in groups),
            "success_rate": sum(rewards) / len(rewards), "won": sum(r > 0 for r in rewards),
            "wall_s": sum(g["cost_s"] for g in groups), "generate_s": 0.0, "env_s": 0.0, "env_steps": 10 * len(groups),
            "step_tokens": sum(g["step_tokens"] for g in groups), "per_group": groups}


# baseline: a all-fail (100 tokens), b informative (100), c all-success (200); gated: a cut (40), b cut (40), c ran (200)
BASE = summary([group("a", [0, 0], 100), group("b", [0, 1], 100), group("c", [1, 1], 200)])
GATED = summary([group("a", [0, 0], 40, cut=True, cost=4.0), group("b", [0, 1], 40, cut=True, cost=4.0),
                 group("c", [1, 1], 200)])


def test_the_report_by_hand():
    rep = tier1_report(BASE, GATED, "3,auto", seed=0, oracle_tokens=60 + 120)
    assert rep["groups_cut"] == 2 and rep["cuts_correct"] == 1 and rep["cut_precision"] == 0.5
    assert rep["informative_groups_cut"] == 1 and rep["baseline_zero_variance_groups"] == 2
    assert rep["step_token_saving"] == pytest.approx(1 - 280 / 400)
    assert rep["oracle_step_token_saving"] == pytest.approx(180 / 400)
    assert rep["wall_saving"] == pytest.approx(1 - 18 / 30)
    lo, hi = rep["step_token_saving_ci95"]
    assert lo <= rep["step_token_saving"] <= hi
    assert rep["cut_precision_ci95"][0] < 0.5 < rep["cut_precision_ci95"][1]
    text = tier1_markdown(rep)
    assert "Step-token saving 30.0%" in text and "saves 45.0%" in text and "took 67% of it" in text
    # what a classifier gate (K,auto:S1+S2) reports at the end reads as one line
    from agentrl.select.classifier_gate import ClassifierGate

    gate = ClassifierGate(3, ["prefix_edit_distance_mean", "obs_unique_ratio"])
    assert "Classifier gate on 2 signals: at the end nothing cut (fitted on 0 labelled groups" in tier1_markdown(rep | {"auto": gate.report()})


def test_the_oracle_cuts_the_zero_variance_groups_after_K():
    rows = [{"task_id": "a", "reward": 0.0, "step_tokens": [5, 6, 7]}, {"task_id": "a", "reward": 0.0, "step_tokens": [5, 9]},
            {"task_id": "b", "reward": 0.0, "step_tokens": [5, 6, 7]}, {"task_id": "b", "reward": 1.0, "step_tokens": [5, 6]}]
    assert oracle_saved_tokens(rows, 1) == 6 + 7 + 9  # group a only, the steps after the first
    assert oracle_saved_tokens(rows, 3) == 0


def write_run(path, s, actions):
    path.mkdir()
    (path / "summary.json").write_text(json.dumps(s))
    rows = [{"task_id": g["task_id"], "trajectory": i, "won": r > 0, "reward": float(r), "actions": actions(g, i),
             "step_tokens": [g["step_tokens"] // (G * 5)] * 5}
            for g in s["per_group"] for i, r in enumerate(g["rewards"])]
    (path / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_gated_rollout_paired_with_an_earlier_ungated_one(tmp_path):
    """The pairing reads the baseline's summary and rows: the same report as from the records,
    the oracle from its rows, and how many rows took the baseline's actions (a cut row: its prefix)."""
    long = lambda g, i: [f"go to {g['task_id']} {i}", "look", "look", "inventory", "look"]  # noqa: E731
    write_run(tmp_path / "base", BASE, long)
    write_run(tmp_path / "gated", GATED, lambda g, i: long(g, i)[:2] if g["cut"] else long(g, i))
    rep = tier1_against(tmp_path / "base", GATED, tmp_path / "gated", parse_gate("3,auto"), seed=0)
    assert rep["rows_matching_baseline"] == [6, 6] and rep["baseline_dir"] == str(tmp_path / "base")
    # oracle at K 3: the two zero-variance groups' rows keep 3 of their 5 steps (a: 10 per step, c: 20)
    assert rep["oracle_step_token_saving"] == pytest.approx((2 * 2 * 10 + 2 * 2 * 20) / 400)
    assert {k: rep[k] for k in ("groups_cut", "cuts_correct", "step_token_saving")} == \
           {k: tier1_report(BASE, GATED, "3,auto", 0)[k] for k in ("groups_cut", "cuts_correct", "step_token_saving")}


@pytest.mark.parametrize("change, message", [
    (lambda s: s | {"groups_cut": 1}, "must be ungated"),
    (lambda s: s | {"per_group": s["per_group"][::-1]}, "not the same tasks"),
    (lambda s: s | {"trajectories": 4}, "G differs"),
])
def test_a_baseline_that_does_not_pair_is_refused(tmp_path, change, message):
    write_run(tmp_path / "base", change(BASE), lambda g, i: ["look"])
    write_run(tmp_path / "gated", GATED, lambda g, i: ["look"])
    with pytest.raises(UserError, match=message):
        tier1_against(tmp_path / "base", GATED, tmp_path / "gated", parse_gate("3,auto"), seed=0)


def test_not_a_rollout_directory_is_refused(tmp_path):
    with pytest.raises(UserError, match="cannot read"):
        tier1_against(tmp_path, GATED, tmp_path, parse_gate("3,auto"), seed=0)
