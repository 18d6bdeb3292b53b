"""Tier 2 off-policy A/B on a small hand-written buffer: loading, positions and views, the seeded
plan both arms share, the gate on recorded d_K, and the Table 4 analogue (tiny random Llama)."""

import copy
import csv
import json

import pytest

from agentrl.config import Config, LearnerConfig
from agentrl.errors import UserError
from agentrl.rollout.signals import SIGNALS
from agentrl.select.cut import gate_rule
from agentrl.specs import GateSpec
from agentrl.train.offpolicy import (
    action_spans,
    build_batch,
    load_buffer,
    make_view,
    offpolicy_markdown,
    plan_steps,
    run_offpolicy_ab,
)

PROMPT = "You are in the middle of a room. Your task is to: put a clean mug in coffeemachine.\n"
REPLIES = [
    "Thought: the mug may be on the countertop.\nAction: go to countertop 1",
    "Action: take mug 1 from countertop 1",
    "Action: go to sinkbasin 1",
]
OBS = ["On the countertop 1, you see a mug 1.", "You pick up the mug 1 from the countertop 1."]
COMMANDS = ["go to countertop 1", "take mug 1 from countertop 1", "go to sinkbasin 1"]

# task_id -> (rewards, recorded d_K at K=2, cut during the rollout)
GROUPS = {
    "t0": ([1, 0, 0, 1], 0.5, False),
    "t1": ([0, 0, 0, 0], 0.0, False),  # zero variance, below the gate
    "t2": ([1, 1, 0, 0], 0.05, False),  # below the gate
    "t3": ([1, 0, 1, 0], 0.12, False),  # exactly d_L: strict, not cut
    "t4": ([0, 0, 0, 0], 0.0, True),  # cut in the buffer: skipped
}
GATE = GateSpec(2, 0.12)
RULE = gate_rule(GATE)  # what decides: the fixed threshold


def encode(tokenizer, n_replies, variant=0):
    """Exact tokens as the rollout builds them: prompt, a_1, o_1, a_2, ...; spans of the replies.
    `variant` changes the object numbers so trajectories of a group differ in their tokens."""
    ids, mask, spans = [], [], []

    def add(text, generated):
        piece = tokenizer(text, add_special_tokens=False).input_ids
        if generated:
            spans.append((len(ids), len(ids) + len(piece)))
        ids.extend(piece)
        mask.extend([int(generated)] * len(piece))

    add(PROMPT, False)
    for k in range(n_replies):
        if k:
            add("\n" + OBS[k - 1] + "\n", False)
        add(REPLIES[k].replace(" 1", f" {variant + 1}"), True)
    return ids, mask, spans


def record(tokenizer, task_id, index, reward, n_replies, commands=None, group_cut=False):
    ids, mask, _ = encode(tokenizer, n_replies, variant=index)
    commands = commands or COMMANDS[:n_replies]
    return {
        "task_id": task_id, "trajectory": index, "reward": float(reward), "won": bool(reward),
        "stop_reason": "won" if reward else "max_steps",
        "token_ids": ids, "action_mask": mask, "logprobs": [-0.5 if m else 0.0 for m in mask],
        "step_tokens": [], "actions": commands,
        "step_records": [{"command": c, "action": c or "xyzzy", "observation": f"obs {j}"} for j, c in enumerate(commands)],
        "initial_observation": PROMPT, "group_cut": group_cut, "group_cut_step": 2 if group_cut else None,
    }


def write_buffer(tmp_path, tokenizer, groups=GROUPS, with_csv=True):
    lines = []
    for tid, (rewards, _, cut) in groups.items():
        for i, r in enumerate(rewards):
            lines.append(json.dumps(record(tokenizer, tid, i, r, 1 + i % 3, group_cut=cut)))
    path = tmp_path / "trajectories.jsonl"
    path.write_text("\n".join(lines) + "\n")
    if with_csv:
        with (tmp_path / "groups.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["task_id", "task_type", "K", *SIGNALS, "rewards", "cut"])
            w.writeheader()
            for tid, (rewards, d, cut) in groups.items():
                for K, dk in ((2, d), (5, 0.9)):
                    w.writerow({"task_id": tid, "task_type": "pick_clean_then_place_in_recep", "K": K,
                                **{s: 0.0 for s in SIGNALS}, "prefix_edit_distance_mean": dk,
                                "rewards": ";".join(map(str, rewards)), "cut": int(cut)})
    return path


def config(seed=3):
    cfg = Config(seed=seed)
    cfg.learner = LearnerConfig(lora_r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], micro_batch=4, lr=1e-3)
    return cfg


# ---------------------------------------------------------------- loading
def test_load_buffer_groups_and_recorded_d_K(tmp_path, tokenizer):
    buf = load_buffer(write_buffer(tmp_path, tokenizer))
    assert [g.task_id for g in buf] == ["t0", "t1", "t2", "t3"]  # file order, cut group skipped
    assert buf.skipped_cut == 1 and buf.has_groups_csv
    assert [g.rewards for g in buf] == [[float(r) for r in GROUPS[t][0]] for t in ("t0", "t1", "t2", "t3")]
    assert [g.d_K(2) for g in buf] == [0.5, 0.0, 0.05, 0.12]
    assert [g.gate_fires(RULE) for g in buf] == [False, True, True, False]  # d_K == d_L does not fire
    assert load_buffer(tmp_path).skipped_cut == 1  # the directory works too


def test_d_K_computed_from_step_records_without_groups_csv(tmp_path, tokenizer):
    from agentrl.rollout.lockstep import action_symbol
    from agentrl.rollout.trajectory import Step
    from agentrl.train.offpolicy import action_symbol as ours

    cmds = [COMMANDS[:2], COMMANDS[:2], [COMMANDS[0], None]]  # third: an invalid second action
    lines = [json.dumps(record(tokenizer, "g", i, i % 2, 2, commands=c)) for i, c in enumerate(cmds)]
    (tmp_path / "trajectories.jsonl").write_text("\n".join(lines) + "\n")
    (g,) = load_buffer(tmp_path / "trajectories.jsonl")
    assert g.d_K(1) == 0.0
    assert g.d_K(2) == pytest.approx(1 / 3)  # pairs: 0, 1/2, 1/2
    assert g.trajectories[2].symbols[1] == "invalid:xyzzy"
    for c, a in ((None, "xyzzy"), ("go to sinkbasin 1", "go to sink")):
        assert ours(c, a) == action_symbol(Step("", a, c, "", False, False))


@pytest.mark.parametrize("content, match", [
    (None, "not found"),
    ("this is not json\n", "not a JSON line"),
    ('{"task_id": "a", "reward": 1, "action_mask": [1]}\n', "missing token_ids"),
])
def test_bad_buffer_input(tmp_path, content, match):
    path = tmp_path / "trajectories.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=match):
        load_buffer(path)


def test_group_of_one_and_all_cut_are_user_errors(tmp_path, tokenizer):
    path = tmp_path / "trajectories.jsonl"
    path.write_text(json.dumps(record(tokenizer, "solo", 0, 1, 1)) + "\n")
    with pytest.raises(UserError, match="at least 2"):
        load_buffer(path)
    write_buffer(tmp_path, tokenizer, {"t4": GROUPS["t4"]})
    with pytest.raises(UserError, match="cut during the rollout"):
        load_buffer(path)


# ---------------------------------------------------------------- positions, views, plan
def test_action_spans_are_maximal_runs():
    assert action_spans([0, 1, 1, 0, 1, 0, 0, 1, 1, 1]) == [(1, 3), (4, 5), (7, 10)]
    assert action_spans([1, 1]) == [(0, 2)] and action_spans([0, 0]) == []


def test_positions_and_truncated_view(tmp_path, tokenizer):
    buf = load_buffer(write_buffer(tmp_path, tokenizer))
    t = buf[0].trajectories[2]  # 3 replies
    _, _, spans = encode(tokenizer, 3, variant=2)
    assert t.spans == spans
    view = make_view(t, [0, 1])
    assert len(view.token_ids) == spans[1][1]  # ends right after the last sampled reply
    assert view.token_ids == t.token_ids[: spans[1][1]] and len(view.logprobs) == len(view.token_ids)
    assert action_spans(view.action_mask) == spans[:2]
    assert [tokenizer.decode(view.token_ids[s:e]) for s, e in spans[:2]] == [r.replace(" 1", " 3") for r in REPLIES[:2]]
    view = make_view(t, [2, 0])  # a skipped middle reply keeps its tokens but not its mask
    assert len(view.token_ids) == len(t.token_ids)
    assert view.positions == [0, 2] and action_spans(view.action_mask) == [spans[0], spans[2]]

    plan = plan_steps(buf, steps=5, groups_per_step=3, positions=2, seed=0)
    for step in plan:
        assert len(set(step.groups)) == 3  # no replacement within a step
        for gi, per_traj in zip(step.groups, step.positions):
            for traj, pos in zip(buf[gi].trajectories, per_traj):
                n = len(traj.spans)
                assert len(pos) == min(2, n) and len(set(pos)) == len(pos) and all(0 <= p < n for p in pos)
    again = plan_steps(buf, steps=5, groups_per_step=3, positions=2, seed=0)
    assert [(s.groups, s.positions) for s in plan] == [(s.groups, s.positions) for s in again]


def test_zero_variance_group_gets_zero_advantage_and_gate_drops(tmp_path, tokenizer):
    buf = load_buffer(write_buffer(tmp_path, tokenizer))
    plan = plan_steps(buf, steps=1, groups_per_step=4, positions=8, seed=1)[0]
    batch, kept, dropped = build_batch(buf, plan, [False] * 4)
    assert sorted(kept) == [0, 1, 2, 3] and not dropped
    adv = {}
    for view, a in batch:
        adv.setdefault(view.task_id, []).append(a)
    assert adv["t1"] == [0.0] * 4  # zero variance
    assert all(a != 0.0 for a in adv["t0"]) and sum(adv["t0"]) == pytest.approx(0.0, abs=1e-9)
    assert sum(v.items for v, _ in batch) == 4 * (1 + 2 + 3 + 1)  # all positions: P=8 >= spans
    batch, kept, dropped = build_batch(buf, plan, [g.gate_fires(RULE) for g in buf])
    assert sorted(buf[i].task_id for i in dropped) == ["t1", "t2"] and {v.task_id for v, _ in batch} == {"t0", "t3"}


# ---------------------------------------------------------------- the A/B
def loader(tiny_model):
    return lambda: copy.deepcopy(tiny_model)


def test_ab_gated_arm_drops_low_d_K_groups_on_the_same_sequence(tmp_path, tokenizer, tiny_model):
    buf = load_buffer(write_buffer(tmp_path, tokenizer))
    seen = []
    rep = run_offpolicy_ab(config(seed=1), buf, steps=2, groups_per_step=3, positions=2, gate=GATE,
                           model_loader=loader(tiny_model), progress=lambda arm, s, n, row: seen.append((arm, s, n)))
    base, gated = rep["arms"]["baseline"], rep["arms"]["gated"]
    assert seen == [(a, s, 2) for a in ("baseline", "gated") for s in (1, 2)]
    assert [r["sampled"] for r in base["per_step"]] == [r["sampled"] for r in gated["per_step"]]
    plan = plan_steps(buf, 2, 3, 2, seed=1)
    assert [r["sampled"] for r in base["per_step"]] == [[buf[i].task_id for i in s.groups] for s in plan]
    for r in gated["per_step"]:
        assert r["cut"] == [t for t in r["sampled"] if t in ("t1", "t2")]  # exactly the d_K < d_L groups
    assert all(r["cut"] == [] for r in base["per_step"]) and base["groups_cut"] == 0
    assert {t for r in gated["per_step"] for t in r["cut"]} == {"t1", "t2"}  # this seed draws both
    # cutting t1 (zero variance) saves no learner compute (A = 0 is skipped anyway); cutting t2 does
    assert gated["forward_tokens"] < base["forward_tokens"]
    assert gated["groups_cut"] > 0 and gated["groups_cut"] + gated["groups_used"] == base["groups_used"] == 6
    spans = {t: [len(x.spans) for x in g.trajectories] for t, g in zip([g.task_id for g in buf], buf)}
    want = sum(min(2, n) for r in base["per_step"] for t in r["sampled"] for n in spans[t])
    assert base["items"] == want and gated["items"] < base["items"]
    assert base["wall_s"] > 0 and base["steps_stepped"] == 2 and base["grad_norm_mean"] > 0
    assert rep["gate"] == "2,0.12" and rep["seed"] == 1 and rep["buffer"]["skipped_cut"] == 1
    assert rep["buffer"]["below_gate"] == 2
    assert rep["change"]["items_pct"] < 0 and rep["change"]["grad_norm_ratio"] > 0
    json.dumps(rep)  # JSON-serialisable as is

    md = offpolicy_markdown(rep)
    assert "| | baseline | gated | change |" in md
    for row in ("| total step wall-clock (s) |", "| train items |", "| groups cut |", "| mean gradient L2 norm |"):
        assert row in md
    assert f"| train items | {base['items']} | {gated['items']} |" in md


def test_ab_arms_start_identical(tmp_path, tokenizer, tiny_model):
    """With a gate that never fires, both arms do the same work from the same start: same losses and norms."""
    buf = load_buffer(write_buffer(tmp_path, tokenizer))
    rep = run_offpolicy_ab(config(seed=5), buf, steps=2, groups_per_step=2, positions=1, gate=GateSpec(2, 0.0),
                           model_loader=loader(tiny_model))
    base, gated = rep["arms"]["baseline"]["per_step"], rep["arms"]["gated"]["per_step"]
    assert [r["items"] for r in base] == [r["items"] for r in gated]
    assert any(b["stepped"] for b in base)  # the comparison below is not vacuous
    for b, g in zip(base, gated):
        assert b["stepped"] == g["stepped"]
        if b["stepped"]:
            assert b["grad_l2_norm"] > 1e-3  # a real gradient, not a cancellation
            assert g["loss"] == pytest.approx(b["loss"], rel=1e-5)
            assert g["grad_l2_norm"] == pytest.approx(b["grad_l2_norm"], rel=1e-5)


def test_ab_argument_errors(tmp_path, tokenizer):
    buf = load_buffer(write_buffer(tmp_path, tokenizer))

    def no_model():
        raise AssertionError("no model should load on bad arguments")

    with pytest.raises(UserError, match="--ab needs a gate"):
        run_offpolicy_ab(config(), buf, 1, 2, 8, None, model_loader=no_model)
    with pytest.raises(UserError, match="exceeds the buffer's 4 usable groups"):
        run_offpolicy_ab(config(), buf, 1, 5, 8, GATE, model_loader=no_model)
    with pytest.raises(UserError, match="--positions"):
        run_offpolicy_ab(config(), buf, 1, 2, 0, GATE, model_loader=no_model)
    with pytest.raises(UserError, match="malformed gate"):
        run_offpolicy_ab(config(), buf, 1, 2, 8, "ten", model_loader=no_model)
