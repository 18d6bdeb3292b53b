"""Integration: real games from ../shared/data/alfworld and the prepared default model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentrl.config import OPTIONAL_SPLITS, SPLITS, TASK_TYPES
from agentrl.env.data import discover_games
from agentrl.rollout import WalkthroughPolicy, run_lockstep

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
LEARNING_MARGIN = 0.25  # held-out success points the synthetic run must gain


@pytest.mark.parametrize("split", SPLITS)
def test_walkthrough_wins_a_sample_of_each_split(split, data_root):
    if split in OPTIONAL_SPLITS and not (data_root / "json_2.1.1" / split).is_dir():
        pytest.skip(f"{split} ships with the full data only (../shared/data/alfworld-full)")
    sample = [discover_games(split, data_root, [t], limit=2)[-1] for t in TASK_TYPES]
    rollout = run_lockstep(sample, WalkthroughPolicy(), max_steps=30)
    trajs, stats = rollout.trajectories, rollout.stats
    assert [t.stop_reason for t in trajs] == ["won"] * len(sample)
    assert all(t.invalid_actions == 0 for t in trajs)
    assert stats.env_steps == sum(len(g.walkthrough) for g in sample)


def test_model_policy_runs_and_writes_results(tmp_path, default_model_dir, data_root):
    out = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "eval", "--split", "valid_unseen", "--limit", "2", "--max-steps", "3",
         "--max-new-tokens", "48", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    assert "overall" in proc.stdout
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 2
    for ep in episodes:
        assert ep["split"] == "valid_unseen" and ep["task_type"] in TASK_TYPES
        assert 1 <= ep["steps"] <= 3 and len(ep["actions"]) == ep["steps"] == len(ep["responses"])
        assert ep["stop_reason"] in ("won", "max_steps")
        assert 0 <= ep["invalid_actions"] <= ep["steps"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["overall"]["episodes"] == 2 and summary["policy"] == "model"
    assert summary["timing"]["step_tokens"] > 0 and summary["timing"]["generate_s"] > 0


def test_model_policy_tokens_are_exact(default_model_dir, data_root):
    """The trajectory's ids decode to the chat so far; the mask covers exactly the generated ids."""
    from agentrl.config import load_config
    from agentrl.rollout.generator import Generator

    cfg = load_config(None, {"sampling.max_new_tokens": 32, "env.workers": 0})
    policy = Generator(cfg).policy(cfg.seed, greedy=True)
    game = discover_games("valid_seen", data_root, ["pick_and_place_simple"], limit=1)[0]
    rollout = run_lockstep([game], policy, max_steps=2)
    (traj,) = rollout.trajectories
    tok = policy.sampler.tokenizer
    generated = [i for i, m in zip(traj.token_ids, traj.action_mask) if m]
    assert len(generated) == sum(traj.step_tokens) > 0
    assert len(traj.token_ids) == len(traj.action_mask) == len(traj.logprobs)
    assert all(lp <= 0 for lp, m in zip(traj.logprobs, traj.action_mask) if m)
    text = tok.decode(traj.token_ids)
    assert traj.initial_observation in text and traj.steps[0].observation in text
    from agentrl.prompt import load_prompts

    example_turns = len(load_prompts()[1][game.task_type])
    assert text.count("<|im_start|>assistant") == example_turns + 2  # the example's replies + 2 steps
    # each run of masked tokens is one step's reply: decoding it gives the recorded response
    runs, current = [], []
    for token, m in zip(traj.token_ids, traj.action_mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    assert [tok.decode(r, skip_special_tokens=True) for r in runs] == [s.response for s in traj.steps]
    # the sampler's log-probs (slot engine, the second turn continuing the first's KV) equal a
    # teacher-forced forward of the default model over the whole trajectory, to 1e-4 in fp32
    import pytest
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(policy.sampler.model(torch.tensor([traj.token_ids])).logits[0].float(), -1)
    expected = [logp[i - 1, t].item() for i, (t, m) in enumerate(zip(traj.token_ids, traj.action_mask)) if m]
    assert [lp for lp, m in zip(traj.logprobs, traj.action_mask) if m] == pytest.approx(expected, abs=1e-4)
    assert policy.sampler.store.live == 0  # the ended trajectory's slot was released


def test_prompt_examples_replay_to_a_win_in_the_engine(data_root):
    """Every in-context example is a real train walkthrough: same observations, ends won."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_examples.py"
    proc = subprocess.run([sys.executable, str(script), "--check", "--data", str(data_root)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6/6 example files pass" in proc.stdout


def test_tier1_ab_on_real_games(tmp_path, default_model_dir, data_root):
    """A tiny `rollout --tier1-ab`: both arms written, same seed -> identical first K steps. The
    OR-rule at tau_H = 0 makes the gate fire on every group still running at K (no episode of
    these games can be won in 2 steps), so the cut happens by construction, not by sampled luck."""
    import csv

    from agentrl.rollout import SIGNALS

    out = tmp_path / "t1"
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "rollout", "--tier1-ab", "--split", "valid_seen", "--tasks", "2", "-G", "2",
         "--max-steps", "5", "--gate", "2,0.6", "--gate-or-tau", "0", "--max-new-tokens", "16", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "tier1.json").read_text())
    assert report["tasks"] == 2 and report["gate"].startswith("2,0.6")
    assert report["baseline"]["groups_cut"] == 0
    assert len(report["wall_saving_ci95"]) == 2 and "Tier 1 A/B" in (out / "tier1.md").read_text()
    for arm in ("baseline", "gated"):  # each arm says what it ran on (machine.py)
        assert json.loads((out / arm / "summary.json").read_text())["machine"]["dtype"] == "float32"
    arms = {arm: [json.loads(line) for line in (out / arm / "trajectories.jsonl").read_text().splitlines()]
            for arm in ("baseline", "gated")}
    assert len(arms["baseline"]) == len(arms["gated"]) == 4
    for b, g in zip(arms["baseline"], arms["gated"]):
        assert (b["task_id"], b["trajectory"]) == (g["task_id"], g["trajectory"])
        assert b["step_records"][:2] == g["step_records"][:2]  # same seed: identical first K=2 steps
        first_k = sum(b["step_tokens"][:2])
        assert len(b["token_ids"]) == len(b["action_mask"]) == len(b["logprobs"])
        gen_b = [t for t, m in zip(b["token_ids"], b["action_mask"]) if m][:first_k]
        gen_g = [t for t, m in zip(g["token_ids"], g["action_mask"]) if m][:first_k]
        assert gen_b == gen_g
        assert g["group_cut"] and g["stop_reason"] == "gate_cut" and g["steps"] == 2  # every gated group cut at K
        assert not b["group_cut"] and b["steps"] > 2  # the baseline arm runs on
    rows = list(csv.DictReader((out / "baseline" / "groups.csv").open()))
    assert rows and set(["task_id", "task_type", "K", *SIGNALS, "rewards", "cut", "steps_generated"]) <= set(rows[0])
    assert {int(r["K"]) for r in rows} == {5}  # K rows beyond T_max are not written
    assert {r["task_id"] for r in rows} == {b["task_id"] for b in arms["baseline"]}
    # --tier1-baseline: the gated arm alone, paired with the baseline just written, reports what --tier1-ab did
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "rollout", "--tier1-baseline", str(out / "baseline"), "--split", "valid_seen",
         "--tasks", "2", "-G", "2", "--max-steps", "5", "--gate", "2,0.6", "--gate-or-tau", "0", "--max-new-tokens", "16",
         "--out", str(tmp_path / "gated-only")],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    alone = json.loads((tmp_path / "gated-only" / "tier1.json").read_text())
    assert alone["rows_matching_baseline"] == [4, 4]
    for key in ("groups_cut", "cuts_correct", "baseline_zero_variance_groups", "step_token_saving", "oracle_step_token_saving"):
        assert alone[key] == report[key], key
    assert alone["gated"]["step_tokens_total"] == report["gated"]["step_tokens_total"]


def test_train_on_real_games_then_report(tmp_path, default_model_dir, data_root):
    """`agentrl train` on real ALFWorld games with the default model (one short iteration, GiGPO's
    step-level advantages with the invalid-action reward), then `agentrl report` on the run: the
    real path of `make train`, end to end."""
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "--config", "configs/default.yaml", "--iterations", "1",
         "--tasks", "1", "-G", "2", "--max-steps", "2", "--gate", "2,0.12", "--eval-tasks", "1",
         "--eval-max-steps", "2", "--max-new-tokens", "24", "--advantage", "gigpo", "--invalid-action-reward", "-0.01", "--out", str(run)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["iteration"]) for r in rows] == [("eval", 0), ("iteration", 1), ("eval", 1)]
    assert all(r["mean_episode_steps"] <= 2 for r in rows if r["kind"] == "eval")  # --eval-max-steps
    it = rows[1]
    assert it["groups"] == 1 and it["step_tokens_generated"] > 0 and it["rollout_s"] > 0
    assert it["advantage_mass"]["kept_groups"] + it["advantage_mass"]["cut_groups"] == 1
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["advantage"] == "gigpo" and saved["reward"]["invalid_action"] == -0.01
    assert (run / "checkpoints" / "latest").read_text().strip() == "it00001"
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "report", str(run)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert (run / "report" / "report.md").is_file() and (run / "report" / "heldout_success.png").stat().st_size > 0


def test_grpo_learns_the_synthetic_task(tmp_path, default_model_dir):
    """The learning test: GRPO on the default model raises held-out greedy success on the
    synthetic choice task (configs/synthetic.yaml) clearly above where it starts. Three
    iterations, evaluated before and after (measured: 6.2% -> 96.9% at iteration 3)."""
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "--config", "configs/synthetic.yaml", "--iterations", "3",
         "--eval-every", "3", "--out", str(run)],
        capture_output=True, text=True, timeout=1200, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]
    before, after = evals[0]["success"], evals[-1]["success"]
    print(f"held-out success {before:.3f} -> {after:.3f}")
    assert after >= before + LEARNING_MARGIN, (before, after)


def test_a_short_warm_start_learns_to_act_on_held_out_games(tmp_path, default_model_dir, data_root):
    """The learning test of `agentrl sft` (about 2.5 min): 16 train walkthroughs, one epoch (8
    optimizer steps), then greedy episodes on 4 held-out look_at/pick games (T_max 8) for the warm
    start and the base model. Measured (2026-12-02): valid-action rate 0.59 vs 0.00, wins 0/4 vs 0/4,
    8.7 vs 25.2 tokens a reply; 24 walkthroughs at T_max 12 gave 0.60 vs 0.00 in 1.4x the time (48 at
    T_max 20, earlier: 0.45 vs 0.00, wins 1/4 vs 0/4, twice that). The assertion is on the
    valid-action rate (a margin no CPU's float results can close) and on wins not falling; one won
    game is too thin a margin to assert strictly (issue 13)."""
    cfg = tmp_path / "sft.yaml"
    cfg.write_text("model: {name: default}\nlearner: {lora_r: 32, lora_alpha: 64}\nsampling: {max_new_tokens: 32}\n"
                   "sft: {games: 16, epochs: 1, lr: 5.0e-4, batch_games: 2, heldout_games: 0}\n")

    def agentrl(*args):
        p = subprocess.run([sys.executable, "-m", "agentrl.cli", *map(str, args)], capture_output=True, text=True,
                           timeout=1200, cwd=REPO)
        assert p.returncode == 0, p.stderr
        return p

    agentrl("sft", "--config", cfg, "--out", tmp_path / "ws")
    overall = {}
    for name, extra in (("warm", ["--adapter", tmp_path / "ws"]), ("base", [])):
        agentrl("eval", "--config", cfg, "--split", "valid_seen", "--task-type", "look_at_obj_in_light",
                "--task-type", "pick_and_place_simple", "--limit", "4", "--max-steps", "8", "--out", tmp_path / name, *extra)
        overall[name] = json.loads((tmp_path / name / "summary.json").read_text())["overall"]
    warm, base = overall["warm"], overall["base"]
    print(f"valid-action rate {base['valid_action_rate']} -> {warm['valid_action_rate']}, wins {base['won']} -> {warm['won']}")
    assert warm["valid_action_rate"] >= base["valid_action_rate"] + 0.2, (base, warm)
    assert warm["won"] >= base["won"] and warm["mean_reply_tokens"] < base["mean_reply_tokens"]
