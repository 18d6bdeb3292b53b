"""The Generator (rollout/generator.py): the one rollout side that `agentrl rollout`, `agentrl
eval` and the training loop all call, with real components (a tiny model behind the hf sampler,
real ALFWorld games)."""

import pytest

from agentrl.config import load_config
from agentrl.env.synthetic import SyntheticEnv, synthetic_games, synthetic_messages
from agentrl.evaluate import summary
from agentrl.rollout import ModelPolicy, WalkthroughPolicy, run_lockstep
from agentrl.rollout.generator import EvalResult, Generator
from agentrl.sampling.base import SamplingParams
from agentrl.sampling.hf import HFSampler
from agentrl.train.loop import eval_row


def test_one_t_max_rule():
    """env.max_steps is every episode's default; the setting of the episodes' own kind wins;
    train's evals fall back to the rollouts' T_max."""
    cfg = load_config(None, {"rollout.gate": "off", "env.max_steps": 7})
    assert (cfg.t_max("rollout"), cfg.t_max("eval"), cfg.t_max("train_eval")) == (7, 7, 7)
    cfg = load_config(None, {"rollout.gate": "off", "env.max_steps": 7, "rollout.max_steps": 5, "eval.max_steps": 9})
    assert (cfg.t_max("rollout"), cfg.t_max("eval"), cfg.t_max("train_eval")) == (5, 9, 5)
    cfg = load_config(None, {"rollout.gate": "off", "env.max_steps": 7, "train.eval_max_steps": 3})
    assert (cfg.t_max("rollout"), cfg.t_max("train_eval")) == (7, 3)
    with pytest.raises(ValueError):
        cfg.t_max("sft")


def test_generate_is_the_lockstep_run_with_the_configs_policy(tiny_model, tokenizer):
    """generate = run_lockstep with the policy the config names (sampling settings, prompt, seed,
    T_max, signal steps): the same tokens, log-probs and actions; the seed changes the samples."""
    cfg = load_config(None, {"env.kind": "synthetic", "env.max_steps": 1, "env.workers": 0, "rollout.gate": "off",
                             "sampling.temperature": 1.0, "sampling.max_new_tokens": 8, "rollout.group_size": 3})
    games = synthetic_games("train", 2)
    with Generator(cfg, HFSampler(tiny_model, tokenizer)) as gen:
        got = gen.generate(games, seed=11)
        again = gen.roller(11)(games, 3, 0, [])
        other = gen.generate(games, seed=12)
    policy = ModelPolicy(HFSampler(tiny_model, tokenizer), SamplingParams(1.0, 1.0, 8), seed=11, messages=synthetic_messages)
    want = run_lockstep(games, policy, 1, group_size=3, make_env=SyntheticEnv)

    def tokens(r):
        return [(t.game.game_id, t.index, t.token_ids, [s.command for s in t.steps]) for t in r.trajectories]

    assert tokens(got) == tokens(want) == tokens(again) and len(got.trajectories) == 6
    assert all(t.stop_reason != "env_error" for t in got.trajectories)
    flat = lambda r: [lp for t in r.trajectories for lp in t.logprobs]  # noqa: E731
    assert flat(got) == pytest.approx(flat(want), abs=1e-5)
    assert tokens(other) != tokens(got)


def test_one_eval_record_two_projections(games):
    """`agentrl eval`'s summary.json and train's metrics row read one EvalResult: a game the env
    cannot run is in neither's success; both say the same numbers under their own keys."""
    cfg = load_config(None, {"env.workers": 0, "eval.policy": "walkthrough"})
    chosen = [games["pick_and_place_simple"], games["look_at_obj_in_light"]]
    with Generator(cfg, walkthrough=True) as gen:
        assert isinstance(gen.policy(0), WalkthroughPolicy) and gen.sampler is None
        result = gen.evaluate(chosen, "valid_seen", 4)
    assert isinstance(result, EvalResult) and result.max_steps == 4
    s, row = summary(result, cfg), eval_row(result, 3, 2)
    assert s["max_steps"] == 4 and s["split"] == row["split"] == "valid_seen"
    assert (row["success"], row["won"], row["tasks"]) == (s["overall"]["success_rate"], s["overall"]["won"], s["overall"]["episodes"])
    assert row["ci95"] == s["overall"]["ci95"]
    assert {k: v["success"] for k, v in row["by_task_type"].items()} == {k: v["success_rate"] for k, v in s["by_task_type"].items()}
    assert list(row) == ["kind", "iteration", "split", "tasks", "env_errors", "success", "won", "ci95", "outcomes",
                         "by_task_type", "eval_s", "adapter_version", "valid_action_rate", "mean_reply_tokens",
                         "replies_cut_rate", "looped_rate", "other_object_rate", "guarded_rate", "mean_episode_steps"]
    assert (row["kind"], row["iteration"], row["adapter_version"]) == ("eval", 3, 2)


def test_the_plan_sizes_a_store_that_holds_still_once(games, tiny_model, tokenizer):
    """Before an eval the Generator tells the sampler its plan (rows x the expected tokens), and a
    store takes that size before the first batch (one that holds still, the captured decode step's,
    with its bucket's padding rows and scratch slot); the episodes are the same either way. (How often it is
    reallocated afterwards depends on the observations the replies bring, so that is asserted on
    fixed prompts: test_static_decode's test_a_reserved_store_holds_still_and_changes_no_token.)"""
    from agentrl.rollout.plan import expected_context_tokens

    cfg = load_config(None, {"env.workers": 0, "sampling.max_new_tokens": 8})
    chosen = [games["pick_and_place_simple"], games["look_at_obj_in_light"], games["pick_clean_then_place_in_recep"]]
    results, sized = {}, []
    for static in ("on", "off"):
        sampler = HFSampler(tiny_model, tokenizer, static_decode=static)
        first_generate = sampler.generate

        def generate(requests, params, sampler=sampler, first_generate=first_generate):
            sized.append((static, sampler.store.slots, sampler.store.capacity))  # the store as the batch finds it
            return first_generate(requests, params)

        sampler.generate = generate
        with Generator(cfg, sampler) as gen:
            result = gen.evaluate(chosen, "valid_seen", 3)
            results[static] = ([t.token_ids for t in result.trajectories], gen.sampler.kv_memory())
    (tokens, memory), (eager_tokens, eager_memory) = results["on"], results["off"]
    assert tokens == eager_tokens
    plan = -(-expected_context_tokens(cfg, 3, tokenizer) // 512) * 512  # a store that holds still grows by 512
    assert sized[0] == ("on", 4 + 1, plan)  # bucket of 3 rows and the scratch slot, sized before the first batch
    # the eager engine's store (the CPU's) takes the plan too, without the bucket or the scratch slot:
    # there every growth copies the whole store
    eager_plan = -(-expected_context_tokens(cfg, 3, tokenizer) // 128) * 128
    assert next(s for s in sized if s[0] == "off") == ("off", 3, eager_plan)
    assert memory["peak_slots"] == 4 + 1 and memory["decode_steps_built"] >= 1 and eager_memory["decode_steps_built"] is None
    assert eager_memory["reallocations"] >= 2  # sized by the plan, given back at the end (and grown past it, if a row did)
