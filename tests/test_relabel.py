"""DAgger (`agentrl sft --relabel`): the PDDL planner labels the states a trajectory reached
(env/planner.py), and those states become examples with the exact context the policy saw
(train/relabel.py). Real ALFWorld train games from ../shared, the real planner, the default
model's tokenizer; the trajectories are made by the rollout's own policy driven by scripted
replies (sft's ExpertSampler), so no test depends on what a model samples."""

from __future__ import annotations

import json

import pytest

from agentrl.env.planner import LABEL, label_commands, planner_labels, spread

GAME_INDEX = 5  # a look_at_obj_in_light train game: three walkthrough steps, a planner call in tens of ms


@pytest.fixture(scope="module")
def game(data_root):
    from agentrl.env import find_games

    g = find_games("alfworld", "train", data_root)[GAME_INDEX]
    assert list(g.walkthrough) == ["go to dresser 1", "use desklamp 1", "take alarmclock 2 from dresser 1"]
    return g


def labels(record) -> dict[int, str]:
    return {i: s[LABEL] for i, s in enumerate(record.steps) if LABEL in s}


def test_the_states_after_the_first_departure_are_spread_to_the_end():
    assert spread(2, 10, 4) == [4, 7, 9]  # n - 1 of steps 3..9, the last one included
    assert spread(8, 10, 4) == [9]  # fewer remain than asked
    assert spread(9, 10, 4) == [] and spread(0, 30, 1) == []


def test_the_walkthrough_keeps_to_the_plan_and_nothing_is_labelled(game):
    r = label_commands(game, list(game.walkthrough), 4)
    assert r.won and r.error is None and labels(r) == {}
    assert [s["command"] for s in r.steps] == list(game.walkthrough)


def test_a_detour_is_labelled_where_it_leaves_the_plan_and_not_where_it_rejoins(game):
    w = list(game.walkthrough)
    commands = [w[0], "look", None, "inventory", w[1], w[2]]  # None: an invalid reply, the engine's no-op
    r = label_commands(game, commands, 4)
    assert r.won
    # the planner wrote the walkthrough: where the detour leaves it, the label is its next step; the
    # states chosen after it (2, 4, 5) are labelled where the policy's command differs (2) and not
    # where it took the planner's own (4, 5); step 3 was not chosen
    assert labels(r) == {1: w[1], 2: w[1]}
    admissible = [r.reset["admissible"]] + [s["admissible"] for s in r.steps]
    assert all(cmd in admissible[i] for i, cmd in labels(r).items())  # each label was a command of its state


def test_a_loop_is_labelled_at_n_states_with_the_way_back(game):
    w = list(game.walkthrough)
    commands = [w[0], "go to bed 1", "look", "go to bed 1", "look", "go to bed 1", "look"]
    r = label_commands(game, commands, 3)
    assert not r.won
    # the first departure, then n - 1 = 2 states spread over steps 2..6 (3 and 6): at the bed the
    # planner sends the agent back to the dresser the lamp and the clock are on
    assert labels(r) == {1: w[1], 3: w[0], 6: w[0]}


def test_the_planner_runs_on_a_pool_worker_and_its_labels_are_kept(game, tmp_path):
    from agentrl.env.pool import EnvPool
    from agentrl.env.replay import ReplayCache

    w = list(game.walkthrough)
    trajectories = [("a", game, [w[0], "look", w[1], w[2]]), ("b", game, list(w))]
    cache = ReplayCache(tmp_path)
    with EnvPool(1) as pool:
        records = planner_labels(trajectories, pool, cache, 4)
    assert labels(records["a"]) == labels(label_commands(game, trajectories[0][2], 4)) == {1: w[1]}
    assert labels(records["b"]) == {} and records["b"].won

    class NoEnvs:  # a second call is answered from the cache: no env is asked for
        workers = 1

        def submit(self, op, items):
            raise AssertionError(f"{op} asked of the envs")

    again = planner_labels(trajectories, NoEnvs(), cache, 4)
    assert {k: labels(v) for k, v in again.items()} == {k: labels(v) for k, v in records.items()}
    with EnvPool(1) as pool:
        changed = planner_labels([("a", game, trajectories[0][2])], pool, cache, 2)  # another n: another key
    assert labels(changed["a"]) == {1: w[1]}


# ---------------------------------------------------------------- the examples
def scripted_record(cfg, game, commands, tokenizer, split="train") -> dict:
    """A real trajectory record of `game` whose replies are `commands` (the rollout's own policy
    and renderer, driven by scripted replies; the real engine)."""
    from agentrl.env import prompt_options
    from agentrl.rollout import ModelPolicy, run_lockstep
    from agentrl.sampling.base import SamplingParams
    from agentrl.train.sft import ExpertSampler

    sampler = ExpertSampler(tokenizer, {game.game_id: tuple(commands)}, "action")
    policy = ModelPolicy(sampler, SamplingParams(0.0, 1.0, 64), seed=0, **prompt_options(cfg))
    t = run_lockstep([game], policy, max_steps=len(commands), fuzzy_threshold=cfg.env.fuzzy_threshold).trajectories[0]
    rec = t.record()
    rec["split"] = split
    return rec


@pytest.fixture
def cfg(data_root):
    from agentrl.config import load_config
    from agentrl.train.sft import sft_prompt

    return sft_prompt(load_config(None, {"data.root": str(data_root), "env.workers": 0, "sft.relabel_states": 3,
                                         "sft.relabel_from": "start"}))


def write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_each_labelled_state_is_the_exact_context_then_the_planners_reply(cfg, game, tokenizer, tmp_path):
    from agentrl.prompt import ChatRenderer
    from agentrl.train.relabel import relabelled_states

    w = list(game.walkthrough)
    loop = [w[0], "go to bed 1", "look", "go to bed 1", "look", "go to bed 1", "look"]
    records = [scripted_record(cfg, game, loop, tokenizer), scripted_record(cfg, game, w, tokenizer)]
    assert records[1]["won"] and not records[0]["won"]
    f = write(tmp_path / "r" / "trajectories.jsonl", records)
    out = relabelled_states([tmp_path / "r"], cfg, tokenizer, tmp_path / "cache")
    assert (out.trajectories, out.labelled, out.skipped) == (2, 1, [])  # the walkthrough's trajectory kept to the plan
    eot = ChatRenderer(tokenizer).end_of_turn_ids
    rec = records[0]
    assert [s[0].rsplit("/", 1)[1] for s in out.sequences] == ["1", "3", "6"]
    for (example_id, task_type, ids, mask), (step, label) in zip(out.sequences, [(1, w[1]), (3, w[0]), (6, w[0])]):
        start = rec["reply_starts"][step]
        reply = tokenizer(f"Action: {label}", add_special_tokens=False).input_ids + eot
        assert ids == rec["token_ids"][:start] + reply  # the policy's exact context, then the taught reply
        assert mask == [0] * start + [1] * len(reply)
        assert task_type == game.task_type and example_id.startswith(f"{game.game_id}#0@0:1/")
    assert out.summary() == {"relabel": [str(f)], "trajectories": 2, "labelled": 1, "states": 3, "skipped": 0}


def test_labels_begin_where_the_trajectory_has_seen_the_tasks_object(cfg, game, tokenizer, tmp_path):
    """relabel_from seen (the default): before the object is seen, the planner's next command is
    where the object lies, which the policy cannot know; nothing before it is labelled, and a
    trajectory that never saw it has nothing to label."""
    import dataclasses

    from agentrl.env.planner import object_seen_at
    from agentrl.train.relabel import relabelled_states

    w = list(game.walkthrough)
    wander = ["go to bed 1", "look", w[0], "go to bed 1", "look", "go to bed 1"]  # the clock is seen at the dresser
    never = ["go to bed 1", "look", "go to bed 1"]
    records = [scripted_record(cfg, game, wander, tokenizer), scripted_record(cfg, game, never, tokenizer)]
    observations = [s["observation"] for s in records[0]["step_records"]]
    assert "alarmclock" in observations[2] and not any("alarmclock" in o for o in observations[:2])
    assert object_seen_at(game, records[0]["initial_observation"], observations) == 3
    assert object_seen_at(game, records[1]["initial_observation"], [s["observation"] for s in records[1]["step_records"]]) is None
    write(tmp_path / "r.jsonl", records)
    seen = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, relabel_from="seen"))
    out = relabelled_states([tmp_path / "r.jsonl"], seen, tokenizer, tmp_path / "cache")
    steps = [int(s[0].rsplit("/", 1)[1]) for s in out.sequences]
    assert steps and min(steps) == 3  # from the first state that has seen it, and none before
    assert out.unseen == 1 and out.summary()["never_saw_the_object"] == 1
    everywhere = relabelled_states([tmp_path / "r.jsonl"], cfg, tokenizer, tmp_path / "cache")  # relabel_from start
    assert min(int(s[0].rsplit("/", 1)[1]) for s in everywhere.sequences) == 0 and everywhere.unseen == 0


def test_a_trajectory_the_engine_answers_otherwise_is_skipped(cfg, game, tokenizer, tmp_path):
    from agentrl.train.relabel import relabelled_states

    rec = scripted_record(cfg, game, ["go to bed 1", "look"], tokenizer)
    rec["step_records"][1]["observation"] = "You are somewhere else."
    write(tmp_path / "t.jsonl", [rec])
    out = relabelled_states([tmp_path / "t.jsonl"], cfg, tokenizer, tmp_path / "cache")
    assert out.sequences == [] and out.skipped == [(f"{game.game_id}#0@0:1", "the engine answers its commands "
                                                    "otherwise than it recorded (another game file or engine)")]


def test_held_out_games_other_data_and_a_history_window_are_refused_in_one_line(cfg, game, tokenizer, tmp_path):
    import dataclasses

    from agentrl.errors import UserError
    from agentrl.train.relabel import relabelled_states

    rec = scripted_record(cfg, game, ["look"], tokenizer)
    for split in ("valid_seen", "valid_unseen", "valid_train"):
        write(tmp_path / f"{split}.jsonl", [{**rec, "split": split}])
        with pytest.raises(UserError, match=rf"{split}.jsonl:1: a {split} trajectory: .*held-out games are never taught"):
            relabelled_states([tmp_path / f"{split}.jsonl"], cfg, tokenizer, tmp_path)
    write(tmp_path / "other.jsonl", [{**rec, "task_id": "no-such-game/trial_0"}])
    with pytest.raises(UserError, match=r"game no-such-game/trial_0 is not in the train split of .*: point --data"):
        relabelled_states([tmp_path / "other.jsonl"], cfg, tokenizer, tmp_path)
    write(tmp_path / "ok.jsonl", [rec])
    windowed = dataclasses.replace(cfg, prompt=dataclasses.replace(cfg.prompt, history=2))
    with pytest.raises(UserError, match=r"--relabel needs the whole episode in context \(prompt.history 0\)"):
        relabelled_states([tmp_path / "ok.jsonl"], windowed, tokenizer, tmp_path)
    write(tmp_path / "eval.jsonl", [{k: v for k, v in rec.items() if k != "reply_starts"}])
    with pytest.raises(UserError, match=r"eval.jsonl:1: not a trajectory record \(needs .*reply_starts"):
        relabelled_states([tmp_path / "eval.jsonl"], cfg, tokenizer, tmp_path)


# ---------------------------------------------------------------- agentrl sft --relabel --init-adapter
def init_adapter(model_dir, tmp_path, prompt) -> str:
    """A LoRA adapter of the tiny model with non-zero B (a policy that differs from the base)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from agentrl.config import write_adapter_record

    torch.manual_seed(1)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    out = tmp_path / "policy"
    peft_model.save_pretrained(out)
    write_adapter_record(out, prompt)
    return str(out)


def test_sft_relabel_trains_the_walkthroughs_and_the_labelled_states_from_the_init_adapter(
        cfg, game, tokenizer, tiny_actor_dir, tmp_path, monkeypatch):
    import dataclasses

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from agentrl.config import effective_prompt
    from agentrl.train import sft

    w = list(game.walkthrough)
    rec = scripted_record(cfg, game, [w[0], "go to bed 1", "look", "go to bed 1", "look", "go to bed 1", "look"], tokenizer)
    f = write(tmp_path / "r" / "trajectories.jsonl", [rec])
    adapter = init_adapter(tiny_actor_dir, tmp_path, effective_prompt(cfg))
    run_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=str(tiny_actor_dir)),
                                  learner=dataclasses.replace(cfg.learner, lora_r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                                  sft=dataclasses.replace(cfg.sft, games=1, epochs=1, heldout_games=0, lr=1e-3, init_adapter=adapter))
    trained, began, real_nll, real_learner = [], {}, sft.masked_nll_sum, sft.sft_learner

    def spy(model, batch, masks):
        for (r, s, n), m in zip(batch.spans, masks):
            trained.append((batch.input_ids[r, s : s + n].tolist(), list(m)))
        return real_nll(model, batch, masks)

    def learner_spy(c, model):
        learner = real_learner(c, model)
        began.update({k: v.detach().clone() for k, v in learner.model.named_parameters() if "lora_B" in k})
        return learner

    monkeypatch.setattr(sft, "masked_nll_sum", spy)
    monkeypatch.setattr(sft, "sft_learner", learner_spy)
    out = tmp_path / "dagger"
    summary = sft.run_sft(run_cfg, out, model=AutoModelForCausalLM.from_pretrained(tiny_actor_dir), tokenizer=tokenizer,
                          cache_dir=tmp_path / "sft-data", relabel=[tmp_path / "r"])
    from agentrl.train.relabel import relabelled_states

    states = relabelled_states([f], run_cfg, tokenizer, tmp_path)
    assert len(states.sequences) == 3
    for _, _, ids, mask in states.sequences:  # each labelled state was trained on, once (one epoch)
        assert trained.count((ids, mask)) == 1
    assert len(trained) == 4  # and the one walkthrough
    assert summary["sft"]["dagger"] == {"relabel": [str(f)], "trajectories": 1, "labelled": 1, "states": 3, "skipped": 0}
    assert summary["sft"]["examples"] == 4 and summary["sft"]["init_adapter"] == adapter
    saved = load_file(f"{adapter}/adapter_model.safetensors")
    assert len(began) == len([k for k in saved if "lora_B" in k]) > 0
    assert all(any(torch.equal(v, s) for s in saved.values() if s.shape == v.shape) for v in began.values())  # began from it
    assert summary["recipe"]["relabel"] == {"files": [states.files[0]["sha256"]], "states": 3, "from": "start"}
    assert len(summary["recipe"]["init_adapter"]) == 64
    assert sft.reusable(run_cfg, out, relabel=[f]) is not None  # the same files: reusable
    write(f, [rec, rec])
    assert sft.reusable(run_cfg, out, relabel=[f]) is None  # other contents: built again


def test_a_warm_start_without_dagger_keeps_its_recipe(cfg):
    from agentrl.train.sft import recipe

    r = recipe(cfg)
    assert "relabel" not in r and "init_adapter" not in r  # warm starts built before the options stay reusable
    assert "relabel_states" not in r["sft"] and "init_adapter" not in r["sft"]


def test_init_adapter_of_another_prompt_and_from_with_relabel_are_refused_in_one_line(cfg, tiny_actor_dir, tmp_path):
    import dataclasses

    from agentrl.errors import UserError
    from agentrl.train.sft_plan import check_init_adapter

    c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=str(tiny_actor_dir)),
                            learner=dataclasses.replace(cfg.learner, lora_r=4, target_modules=["q_proj", "v_proj"]))
    adapter = init_adapter(tiny_actor_dir, tmp_path, {"example": "type", "reply": "react", "admissible": False, "history": 0})
    with pytest.raises(UserError, match=r"--init-adapter .*policy was trained with the prompt .* and sft teaches"):
        check_init_adapter(dataclasses.replace(c, sft=dataclasses.replace(c.sft, init_adapter=adapter)))
    with pytest.raises(UserError, match=r"--init-adapter .*nowhere: no such directory"):
        check_init_adapter(dataclasses.replace(c, sft=dataclasses.replace(c.sft, init_adapter=str(tmp_path / "nowhere"))))


def test_sft_from_and_relabel_together_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    write(tmp_path / "r" / "trajectories.jsonl", [{"task_id": "t"}])
    p = subprocess.run([sys.executable, "-m", "agentrl.cli", "sft", "--out", str(tmp_path / "o"), "--from", str(tmp_path / "r"),
                        "--relabel", str(tmp_path / "r")], capture_output=True, text=True)
    assert p.returncode == 2 and "--from and --relabel make different data sets" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
