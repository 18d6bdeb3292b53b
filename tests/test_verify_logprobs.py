"""`agentrl rollout --verify-logprobs` (issue 48, item 3): real rollouts of a tiny model on real
ALFWorld games, teacher-forced through the learner's own log-prob path. The tests assert on the
gap machinery (which token, which statistic, which bound), never on what the model samples."""

import copy
import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from agentrl.collect import prepare_rollout, run_rollout
from agentrl.config import load_config
from agentrl.errors import UserError
from agentrl.specs import parse_tolerance
from agentrl.train.verify import RESULT_FILE, check_logprobs, precision, verifier, verify_rollout

SMALL = {"rollout.split": "valid_seen", "rollout.tasks": 2, "rollout.group_size": 2, "rollout.gate": "off",
         "sampling.max_new_tokens": 6, "sampling.temperature": 1.0, "env.workers": 0,
         "prompt.example": "none"}  # no in-context example: a third of the tokens to teacher-force


def small_config(model_dir, **extra):
    return load_config(None, SMALL | {"model.name": str(model_dir), "rollout.max_steps": 2} | extra)


def roll(cfg, out):
    games, generator = prepare_rollout(cfg)
    return run_rollout(cfg, games, generator, out)


@pytest.fixture(scope="module")
def rollout(tiny_actor_dir, tmp_path_factory):
    """(cfg, rollout, out): 2 real games x G 2, T_max 2, fp32 on the CPU, as `agentrl rollout` writes it."""
    cfg = small_config(tiny_actor_dir)
    out = tmp_path_factory.mktemp("rollout")
    return cfg, roll(cfg, out), out


@pytest.fixture(scope="module")
def learner(rollout):
    return verifier(rollout[0])


def corrupt(trajectories, k: int, step: int, token: int, by: float = 0.5):
    """A copy with the sampler's log-prob of one action token moved; returns (copy, its position)."""
    trajs = copy.deepcopy(trajectories)
    t = trajs[k]
    position = t.reply_starts[step] + token
    assert t.action_mask[position] == 1
    t.logprobs[position] -= by
    return trajs, position


def test_tolerance_specs():
    assert parse_tolerance("auto") is None and parse_tolerance(None) is None
    assert parse_tolerance("1e-3") == parse_tolerance(1e-3) == {"max": 1e-3}
    assert parse_tolerance(" mean=5e-3, p99.9=0.05 ") == {"mean": 5e-3, "p99.9": 0.05}
    for bad, pattern in (("p99=1", r"unknown statistic 'p99'"), ("max=-1", r"max must be a number >= 0"),
                         ("mean=x", r"mean must be a number >= 0, got 'x'"), ("max=1,max=2", r"max given twice")):
        with pytest.raises(UserError, match=pattern):
            load_config(None, {"rollout.verify_tolerance": bad})


def test_the_precision_is_the_lower_side(rollout, learner):
    """fp32 only when the sampler's weights and the learner's forward both are (then the largest gap is judged)."""
    from types import SimpleNamespace

    import torch

    cfg = rollout[0]
    assert precision(cfg, learner) == "fp32"
    assert precision(load_config(None, {"model.dtype": "bfloat16"}), learner) == "bf16"
    autocast = SimpleNamespace(cfg=SimpleNamespace(autocast="bf16"), device=torch.device("cpu"), model=SimpleNamespace(dtype=torch.float32))
    assert precision(cfg, autocast) == "bf16"


def test_a_real_rollout_passes_in_fp32(rollout):
    """The hf sampler's log-probs are the learner's teacher-forced ones: every action token within
    1e-4; the statistics cover every action token written, and the JSON says what was printed."""
    cfg, r, out = rollout
    check = verify_rollout(cfg, [("", r.trajectories)], out)
    assert check.precision == "fp32" and check.tolerance == {"max": 1e-4}
    assert check.passed and check.max <= 1e-4 and 0 <= check.mean <= check.p99_9 <= check.max
    assert check.tokens == sum(sum(t.action_mask) for t in r.trajectories) > 0
    written = [json.loads(ln) for ln in (out / "trajectories.jsonl").read_text().splitlines()]
    assert check.trajectories == len(written) == 4
    assert json.loads((out / RESULT_FILE).read_text()) == json.loads(json.dumps(check.record()))
    w = check.worst  # the worst token is named as trajectories.jsonl holds it
    rec = next(x for x in written if x["task_id"] == w.game_id and x["trajectory"] == w.trajectory)
    assert rec["logprobs"][w.position] == w.sampler and rec["reply_starts"][w.step - 1] + w.token == w.position


def test_one_corrupted_logprob_fails_and_is_named(rollout, learner):
    """One sampler log-prob moved by 0.5: the largest gap is that token's, the check fails on it,
    and the one line names its game, trajectory, step, token and both log-probs."""
    _, r, _ = rollout
    last = len(r.trajectories[3].reply_starts) - 1
    token = r.trajectories[3].step_tokens[last] - 1  # the reply's last token (a reply has one at least)
    trajs, position = corrupt(r.trajectories, 3, last, token)
    check = check_logprobs(learner, [("", trajs)], {"max": 1e-4}, "fp32")
    t, w = trajs[3], check.worst
    assert not check.passed and check.over == ["max"]
    assert (w.game_id, w.trajectory, w.step, w.token, w.position) == (t.game.game_id, t.index, last + 1, token, position)
    assert w.sampler == t.logprobs[position] and w.gap == pytest.approx(0.5, abs=1e-4) == check.max
    line = check.failure()
    assert "\n" not in line and f"game {t.game.game_id} trajectory {t.index} step {last + 1} token {token} " in line
    assert f"sampler {w.sampler:.6f}" in line and f"learner {w.learner:.6f}" in line and "max gap 0.5 > 0.0001" in line
    # the mean is the sum over every action token: one token's 0.5 moves it by 0.5 / tokens
    assert check.mean == pytest.approx(0.5 / check.tokens, abs=1e-5)
    assert replace(check, tolerance={"mean": 0.6 / check.tokens}).passed
    assert replace(check, tolerance={"mean": 0.4 / check.tokens, "p99.9": 1.0}).over == ["mean"]


def test_tier1_arms_are_named_and_a_nan_fails(rollout, learner):
    _, r, _ = rollout
    trajs, _ = corrupt(r.trajectories, 0, 0, 0, by=float("nan"))
    check = check_logprobs(learner, [("baseline", r.trajectories[:1]), ("gated", trajs[:1])], {"mean": 1.0}, "bf16")
    assert check.trajectories == 2 and check.worst.where == "gated" and "worst: gated/game " in check.failure()
    assert check.over == ["mean"] and check.max == check.mean == float("inf")


def test_history_windows_are_checked_as_the_learner_trains_them(tiny_actor_dir, tmp_path):
    """prompt.history 1, T_max 3: each reply is checked against its own window (the third reply's
    leaves the first turn out), and a corrupted token is found at its place in the whole trajectory."""
    cfg = small_config(tiny_actor_dir, **{"prompt.history": 1, "rollout.max_steps": 3, "rollout.tasks": 1})
    r = roll(cfg, tmp_path)
    check = verify_rollout(cfg, [("", r.trajectories)], tmp_path)
    assert check.passed and check.tokens == sum(sum(t.action_mask) for t in r.trajectories)
    trajs = [t for t in r.trajectories if len(t.reply_starts) == 3]
    assert trajs, "every trajectory of a tiny model runs T_max: none wins or ends early"
    k = r.trajectories.index(trajs[0])
    bad, position = corrupt(r.trajectories, k, 2, 0)
    learner = verifier(cfg)
    assert learner.history == 1
    w = check_logprobs(learner, [("", bad)], {"max": 1e-4}, "fp32").worst
    assert (w.trajectory, w.step, w.token, w.position) == (bad[k].index, 3, 0, position)


def test_the_learner_serves_the_rollouts_adapter(tiny_actor_dir, tmp_path):
    """A rollout with --adapter (the hf sampler merges it): the learner starts from that adapter and
    agrees to 1e-4; the base model's learner on the same trajectories does not (a stale adapter shows)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_actor_dir),
                          LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft.save_pretrained(tmp_path / "adapter")
    cfg = small_config(tiny_actor_dir, **{"model.adapter": str(tmp_path / "adapter"), "rollout.max_steps": 1})
    r = roll(cfg, tmp_path / "out")
    check = verify_rollout(cfg, [("", r.trajectories)], tmp_path / "out")
    assert check.passed and check.max <= 1e-4
    base = check_logprobs(verifier(small_config(tiny_actor_dir)), [("", r.trajectories)], {"max": 1e-4}, "fp32")
    assert not base.passed and base.mean > 1e-3


CORRUPTING = """
import sys
import agentrl.sampling as sampling

real = sampling.make_sampler


class Corrupting:
    '''The real sampler, with the log-prob of the last token of the first reply of trajectory 1 it sees moved by 2.'''

    def __init__(self, inner):
        self.inner, self.tokenizer, self.done = inner, inner.tokenizer, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, requests, params):
        out = self.inner.generate(requests, params)
        for r, c in zip(requests, out):
            if not self.done and r.key is not None and r.key[1] == 1 and c.logprobs:
                c.logprobs[-1] -= 2.0
                self.done = True
        return out


sampling.make_sampler = lambda cfg, *a, **k: Corrupting(real(cfg, *a, **k))
from agentrl.cli import main

main()
"""


def test_the_cli_exits_1_with_one_line_naming_the_worst(tiny_actor_dir, tmp_path):
    out, config = tmp_path / "out", tmp_path / "small.yaml"
    config.write_text("prompt:\n  example: none\n")
    args = ["rollout", "--model", str(tiny_actor_dir), "--split", "valid_seen", "--tasks", "2", "-G", "2",
            "--max-steps", "2", "--max-new-tokens", "6", "--gate", "off", "--env-workers", "0",
            "--verify-logprobs", "--out", str(out), "--config", str(config)]
    proc = subprocess.run([sys.executable, "-c", CORRUPTING, *args], capture_output=True, text=True,
                          env=os.environ | {"COLUMNS": "200"}, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and len([ln for ln in proc.stderr.splitlines() if "log-prob" in ln]) == 1, proc.stderr
    result = json.loads((out / RESULT_FILE).read_text())
    w = result["worst"]
    assert not result["passed"] and result["over"] == ["max"] and w["gap"] == pytest.approx(2.0, abs=1e-4)
    assert (w["trajectory"], w["step"]) == (1, 1)
    rec = next(json.loads(ln) for ln in (out / "trajectories.jsonl").read_text().splitlines()
               if json.loads(ln)["task_id"] == w["game_id"] and json.loads(ln)["trajectory"] == 1)
    assert w["position"] == rec["reply_starts"][0] + rec["step_tokens"][0] - 1 and rec["logprobs"][w["position"]] == w["sampler"]
    assert re.fullmatch(rf"error: log-prob check failed \(fp32\): max gap 2 > 0\.0001; worst: game {re.escape(w['game_id'])} "
                        rf"trajectory 1 step 1 token {w['token']} \(token_ids\[{w['position']}\]\): sampler -?\d+\.\d{{6}}, "
                        rf"learner -?\d+\.\d{{6}}", errors[0]), errors[0]
    assert "passed" not in proc.stdout and "failed" in proc.stdout  # the statistics, printed before the error


def test_the_cli_passes_and_prints_the_statistics(tiny_actor_dir, tmp_path):
    from typer.testing import CliRunner

    from agentrl.cli import app

    out, config = tmp_path / "out", tmp_path / "small.yaml"
    config.write_text("prompt:\n  example: none\n")
    result = CliRunner().invoke(app, ["rollout", "--model", str(tiny_actor_dir), "--split", "valid_seen", "--tasks", "1",
                                      "-G", "2", "--max-steps", "1", "--max-new-tokens", "4", "--gate", "off",
                                      "--env-workers", "0", "--verify-logprobs", "--verify-tolerance", "max=1e-4",
                                      "--out", str(out), "--config", str(config)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    printed = " ".join(result.output.split())  # the console may wrap lines (its width is fixed when first imported)
    assert re.search(r"log-prob check \(fp32, \d+ action tokens of 2 trajectories\): \|sampler - learner\| largest \S+, "
                     r"p99\.9 \S+, mean \S+; tolerance max <= 0\.0001: passed", printed), result.output
    assert json.loads((out / RESULT_FILE).read_text())["passed"] is True
