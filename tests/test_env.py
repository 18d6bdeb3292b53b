import json

import pytest
import torch

from agentrl.env.alfworld import NOTHING_HAPPENS, AlfworldEnv
from agentrl.env.data import read_game
from agentrl.rollout import WalkthroughPolicy, run_lockstep


def test_reset_gives_task_and_admissible_commands(games):
    env = AlfworldEnv(games["pick_and_place_simple"])
    first = env.reset()
    assert "Your task is to:" in first.observation and not first.observation.startswith("-=")
    assert any(c.startswith("go to ") for c in first.admissible)
    assert not first.won and not first.done
    env.close()


def test_invalid_action_is_a_noop(games):
    env = AlfworldEnv(games["pick_and_place_simple"])
    first = env.reset()
    res = env.step(None)
    assert res.observation == NOTHING_HAPPENS and res.admissible == first.admissible and not res.done
    res = env.step("fly to the moon")  # not admissible: never reaches the engine
    assert res.observation == NOTHING_HAPPENS and res.admissible == first.admissible
    env.close()


def test_walkthrough_wins_and_reset_restarts(games):
    game = games["pick_clean_then_place_in_recep"]
    env = AlfworldEnv(game)
    env.reset()
    for i, command in enumerate(game.walkthrough):
        res = env.step(command)
        assert res.won == (i == len(game.walkthrough) - 1)
    assert res.done
    again = env.reset()
    assert not again.won and "Your task is to:" in again.observation
    env.close()


def test_corrupt_game_marks_only_its_trajectory(tmp_path, games):
    good = games["look_at_obj_in_light"]
    data = json.loads(good.path.read_text())
    broken = tmp_path / "look_at_obj_in_light-X-None-Y-1" / "trial_0" / "game.tw-pddl"
    broken.parent.mkdir(parents=True)
    broken.write_text(json.dumps(data | {"pddl_problem": "(define (problem broken"}))
    bad_game = read_game(broken, "valid_seen")
    rollout = run_lockstep([bad_game, good], WalkthroughPolicy(), max_steps=30)
    trajs, stats = rollout.trajectories, rollout.stats
    assert trajs[0].stop_reason == "env_error" and str(broken) in trajs[0].error
    assert trajs[1].won
    assert stats.env_steps == len(good.walkthrough)


def test_max_steps_counts_invalid_actions(games):
    game = games["pick_two_obj_and_place"]

    class Babbler:
        def start(self, traj): ...
        def act(self, trajs): return ["Thought: hmm" for _ in trajs]
        def observe(self, traj, obs): ...
        def finish(self, trajs): ...

    rollout = run_lockstep([game], Babbler(), max_steps=4)
    (traj,) = rollout.trajectories
    assert traj.stop_reason == "max_steps" and len(traj.steps) == 4
    assert traj.invalid_actions == 4 and not traj.won
    assert all(s.observation == NOTHING_HAPPENS for s in traj.steps)


REPLAY = """
import json, sys
from agentrl.env.data import read_game
from agentrl.env.alfworld import AlfworldEnv
from pathlib import Path
game = read_game(Path(sys.argv[1]), "valid_seen")
env = AlfworldEnv(game)
first = env.reset()
steps = [env.step(a) for a in game.walkthrough]
print(json.dumps([[first.observation, first.admissible]] + [[r.observation, r.admissible, r.won] for r in steps]))
"""


def test_envs_of_one_game_are_cheap_independent_and_identical_to_uncached(games):
    """The per-process caches (PDDL->SAS translation, parsed grammar) change nothing a player
    sees: a group of envs of one game replays the walkthrough exactly as textworld does
    without the caches (run in a subprocess with AGENTRL_NO_GAME_CACHE=1), and stepping one env
    of the group leaves the others where they were."""
    import os
    import subprocess
    import sys

    game = games["pick_heat_then_place_in_recep"]
    proc = subprocess.run([sys.executable, "-c", REPLAY, str(game.path)], capture_output=True, text=True, timeout=300,
                          env=os.environ | {"AGENTRL_NO_GAME_CACHE": "1"})
    assert proc.returncode == 0, proc.stderr
    uncached = json.loads(proc.stdout.strip().splitlines()[-1])

    group = [AlfworldEnv(game) for _ in range(4)]
    firsts = [env.reset() for env in group]
    assert all([f.observation, f.admissible] == uncached[0] for f in firsts)
    for i, env in enumerate(group[:2]):  # env 0 plays through while envs 1-3 wait, then env 1
        steps = [env.step(a) for a in game.walkthrough]
        assert [[r.observation, r.admissible, r.won] for r in steps] == uncached[1:]
        assert steps[-1].won
        if i == 0:
            assert group[1].step("look").observation == group[2].step("look").observation  # untouched by env 0
    for env in group:
        env.close()


WALKS = """
import json, random, sys
walk, paths = int(sys.argv[1]), sys.argv[2:]  # read first: the engine's imports rewrite sys.argv
from agentrl.env.data import read_game
from agentrl.env.alfworld import AlfworldEnv
from pathlib import Path
seen = []
for i, path in enumerate(paths):
    game, rng = read_game(Path(path), "valid_seen"), random.Random(i)
    for plan in (game.walkthrough, None):
        env = AlfworldEnv(game)
        r = env.reset()
        seen.append([r.observation, r.admissible])
        for t in range(len(plan) if plan else walk):
            command = plan[t] if plan else rng.choice(r.admissible)
            r = env.step(command)
            seen.append([command, r.observation, r.admissible, r.won])
            if r.done:
                break
        env.close()
print(json.dumps(seen))
"""


def test_the_cheap_derivation_sees_what_textworld_sees(games):
    """Deriving a step's text without textworld's deep copies (`_install_cheap_derivation`)
    changes nothing a player sees: on real games of four task types, each walkthrough and a
    seeded random walk of admissible commands (open, take, heat, cool, clean, toggle: states the
    walkthrough never reaches) give the same observations, admissible lists and wins as
    textworld's own code (a subprocess with AGENTRL_NO_GAME_CACHE=1); and the memoised parse
    hands each caller symbols of its own."""
    import os
    import subprocess
    import sys

    from textworld.envs.pddl import textgen

    picked = ["pick_cool_then_place_in_recep", "pick_clean_then_place_in_recep", "look_at_obj_in_light",
              "pick_two_obj_and_place"]
    args = ["20"] + [str(games[t].path) for t in picked]

    def walks(env: dict) -> list:
        proc = subprocess.run([sys.executable, "-c", WALKS, *args], capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    ours = walks({k: v for k, v in os.environ.items() if k != "AGENTRL_NO_GAME_CACHE"})
    theirs = walks(os.environ | {"AGENTRL_NO_GAME_CACHE": "1"})
    assert len(ours) > 4 * 20 and ours == theirs
    assert sum(1 for s in ours if len(s) == 4 and s[3]) >= 4  # every walkthrough won

    AlfworldEnv(games["look_at_obj_in_light"]).close()  # installs the caches in this process
    template = "go to [{r.name | receptacleatlocation(r:receptacle, lend:location)}]"
    a, b = (textgen._parse_and_convert(template, rule_name="symbols") for _ in range(2))
    assert [type(x) for x in a] == [textgen.TerminalSymbol, textgen.ListSymbol]
    assert a[1] is not b[1] and a[1].symbol is not b[1].symbol  # nested symbols copied too
    a[1].symbol.context = {"state": None}
    assert b[1].symbol.context == {}  # one caller's context is not another's


def test_the_cheap_queries_keep_textworlds_order(games):
    """`_install_cheap_queries` sorts a signature's facts with a key compared in C and chains the
    state's facts in C: on a real game's state a few walkthrough commands in, every signature's
    facts come in the order textworld's `Proposition.__lt__` gives and the state's facts in the
    order its own generator yields; so do constructed facts whose arguments differ only in type
    or in number. The installed textworld is the one the replaced method was copied from (else
    textworld's own code runs, correct but slower, and this test says so)."""
    import random

    from textworld.logic import Proposition, State, Variable

    from agentrl.env import alfworld

    game = games["pick_clean_then_place_in_recep"]
    env = AlfworldEnv(game)
    env.reset()
    for command in game.walkthrough[:4]:
        env.step(command)
    assert State._all_applicable_assignments.__module__ == "agentrl.env.alfworld", "textworld changed: see _QUERY_SOURCES"
    inner = env._env
    while not hasattr(inner, "_pddl_state"):
        inner = vars(inner)["_wrapped_env"]
    state = inner._pddl_state
    assert list(state.facts) == [p for facts in state._facts.values() for p in facts] and len(list(state.facts)) > 50
    for facts in state._facts.values():
        assert sorted(facts, key=alfworld._fact_order) == sorted(facts)  # Proposition.__lt__, textworld's
    env.close()

    names, types = ["a", "b", "a 1"], ["object", "receptacle", "o"]
    made = [Proposition(n, [Variable(random.Random(i * 7 + k).choice(names), t) for k, t in enumerate(types[: 1 + i % 3])])
            for i, n in enumerate(["in", "on", "in", "at"] * 6)]
    made += [Proposition("in", [Variable("a", "receptacle")]), Proposition("in", [Variable("a", "object")])]
    made = list(dict.fromkeys(made))  # distinct, as in a state's sets
    assert sorted(made, key=alfworld._fact_order) == sorted(made)


def test_games_share_one_grammar_parse_and_keep_their_own_task(games):
    """A game's GameLogic is built from one memoised parse of the grammar with a stand-in task and
    the game's own task rule (`logic_sharing_the_grammar`): on a real game of each task type its
    actions, every grammar rule (the task sentence included) and its types are what textworld's
    own parse gives, the six games cost one parse, and each has its own types. A grammar without
    a task rule is parsed whole, as textworld does. The installed textworld is the one the
    builder repeats (else textworld's parse runs, correct but slower, and this test says so)."""
    import functools

    from textworld.envs.pddl.logic import GameLogic

    from agentrl.env import alfworld

    def seen(logic) -> str:
        actions = {k: (a.name, a.template, a.feedback_rule, a.pddl, a.grammar) for k, a in logic.actions.items()}
        rules = [(k, [(r.lhs, repr(r.rhs), r.weight, r.condition) for r in v]) for k, v in logic.grammar._rules.items()]
        return repr((logic.domain, actions, rules, logic.types._types))

    AlfworldEnv(games["look_at_obj_in_light"]).close()  # installs the caches (the memoised symbol parse)
    assert alfworld._logic_sources_match(), "textworld changed: see _LOGIC_SOURCES"
    shared = functools.lru_cache(maxsize=8)(lambda domain, grammar: GameLogic(domain=domain, grammar=grammar))
    built, tasks = [], set()
    for game in games.values():
        data = json.loads(game.path.read_text())
        theirs = GameLogic(domain=data["pddl_domain"], grammar=data["grammar"])
        ours = alfworld.logic_sharing_the_grammar(GameLogic, shared, data["pddl_domain"], data["grammar"])
        assert seen(ours) == seen(theirs)
        tasks.add(repr(ours.grammar._rules["task"][0].rhs))
        built.append(ours)
    assert shared.cache_info().misses == 1 and len(tasks) == len(games)
    assert len({id(logic.types) for logic in built}) == len(built)

    data = json.loads(games["pick_two_obj_and_place"].path.read_text())
    no_task = alfworld._TASK_RULE.sub('"no_task": []', data["grammar"])
    assert no_task != data["grammar"]
    whole = alfworld.logic_sharing_the_grammar(GameLogic, shared, data["pddl_domain"], no_task)
    assert seen(whole) == seen(GameLogic(domain=data["pddl_domain"], grammar=no_task)) and "task" not in whole.grammar._rules
    assert shared.cache_info().misses == 1  # not from the shared parse


def test_the_first_reset_keeps_the_state_its_load_built(games):
    """The first reset after a load takes the PddlState the load built (`_install_first_reset`)
    instead of building it again: it is that object, holding the facts a state built afresh from
    the problem holds; a reset after commands builds a new state, back at the start (the same
    observation and admissible commands as the first reset), and a game the walkthrough wins
    after it is won again. What a player sees against textworld's own code is the walkthrough and
    random-walk test's (resets included)."""
    from textworld.envs.pddl import logic as pddl_logic

    game = games["pick_heat_then_place_in_recep"]
    env = AlfworldEnv(game)
    inner = env._env
    while not hasattr(inner, "_pddl_state"):
        inner = vars(inner)["_wrapped_env"]
    loaded = inner._pddl_state
    first = env.reset()
    assert inner._pddl_state is loaded
    afresh = pddl_logic.PddlState(inner.downward_lib, inner._game_data["pddl_problem"], inner._logic)
    assert sorted(map(str, loaded.facts)) == sorted(map(str, afresh.facts)) and len(list(afresh.facts)) > 50
    for command in game.walkthrough[:3]:
        env.step(command)
    again = env.reset()
    assert inner._pddl_state is not loaded
    assert (again.observation, again.admissible) == (first.observation, first.admissible)
    for command in game.walkthrough:
        res = env.step(command)
    assert res.won
    env.close()


def test_a_closed_envs_planner_library_is_reused_not_kept(games):
    """textworld loads a 34 MB copy of fast_downward's library per env and never unloads it (its
    file, deleted, stays allocated while mapped: a long-lived worker filled the disk). A closed
    env's copy goes to the next env: making and closing envs one after another maps one copy, and
    an env on a reused copy plays its walkthrough as a fresh process does (uncached, textworld's own)."""
    import os
    import subprocess
    import sys

    def copies() -> set[str]:
        return {line.split()[5] for line in open("/proc/self/maps") if "libdownward" in line and len(line.split()) > 5}

    order = ["look_at_obj_in_light", "pick_and_place_simple", "pick_clean_then_place_in_recep", "pick_two_obj_and_place"]
    before = None
    for t in order:
        env = AlfworldEnv(games[t])
        env.reset()
        before = before or copies()
        env.close()
        env.close()  # twice: harmless
    assert len(copies() - before) == 0  # the later envs took the first one's copy

    game = games["pick_heat_then_place_in_recep"]
    env = AlfworldEnv(game)  # on a reused copy
    first = env.reset()
    steps = [env.step(a) for a in game.walkthrough]
    env.close()
    proc = subprocess.run([sys.executable, "-c", REPLAY, str(game.path)], capture_output=True, text=True, timeout=300,
                          env=os.environ | {"AGENTRL_NO_GAME_CACHE": "1"})
    assert proc.returncode == 0, proc.stderr
    fresh = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [[first.observation, first.admissible]] + [[r.observation, r.admissible, r.won] for r in steps] == fresh
    assert steps[-1].won


def test_the_translation_is_kept_on_disk_and_read_back_equal(games, tmp_path):
    """The PDDL->SAS translation of a real game is computed once, kept on disk, and read back
    equal by a later call (any process); a damaged file is translated again and rewritten, and a
    cache that cannot be written costs only the translation."""
    import fast_downward

    from agentrl.env.alfworld import _kept_on_disk

    data = json.loads(games["look_at_obj_in_light"].path.read_text())
    real = getattr(fast_downward.pddl2sas, "__wrapped__", fast_downward.pddl2sas)  # under agentrl's in-process cache
    calls = []

    def translate(*args, **kwargs):
        calls.append(kwargs.get("optimize", False))
        return real(*args, **kwargs)

    kept = _kept_on_disk(translate, tmp_path / "pddl2sas")
    task, sas = kept(data["pddl_domain"], data["pddl_problem"])
    files = list((tmp_path / "pddl2sas").rglob("*.pkl.z"))
    assert len(files) == 1 and calls == [False]
    again_task, again_sas = _kept_on_disk(translate, tmp_path / "pddl2sas")(data["pddl_domain"], data["pddl_problem"])
    assert calls == [False] and again_sas == sas  # read back, not translated
    assert [a.name for a in again_task.actions] == [a.name for a in task.actions]
    kept(data["pddl_domain"], data["pddl_problem"], optimize=True)  # another option: another entry
    assert calls == [False, True] and len(list((tmp_path / "pddl2sas").rglob("*.pkl.z"))) == 2

    files[0].write_bytes(b"not a pickle")
    assert kept(data["pddl_domain"], data["pddl_problem"])[1] == sas and calls == [False, True, False]
    assert kept(data["pddl_domain"], data["pddl_problem"])[1] == sas and calls == [False, True, False]  # rewritten

    (tmp_path / "blocked").write_text("a file where the cache directory would be")
    assert _kept_on_disk(translate, tmp_path / "blocked")(data["pddl_domain"], data["pddl_problem"])[1] == sas


PLANNED = """
import json, sys
path, plans = sys.argv[1], sys.argv[2] == "plans"  # read first: the engine's imports rewrite sys.argv
import fast_downward, textworld
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
from agentrl.env import alfworld
translate, calls = fast_downward.pddl2sas, []

def counted(*args, **kwargs):  # what reaches fast_downward's translator
    calls.append(bool(kwargs.get("optimize")))
    return translate(*args, **kwargs)

fast_downward.pddl2sas = counted
alfworld.install_game_caches()
alfworld._install_lib_pool()
infos = textworld.EnvInfos(won=True, admissible_commands=True, policy_commands=plans)
env = textworld.start(path, request_infos=infos, wrappers=[AlfredDemangler(), AlfredInfos])
state = env.reset()
seen = [[state["admissible_commands"], state.get("policy_commands")]]
for command in json.load(open(path))["walkthrough"][:2] + ["look"]:
    state, _, _ = env.step(command)
    seen.append([command, state["admissible_commands"], state.get("policy_commands"), state["won"]])
print(json.dumps({"calls": calls, "seen": seen}))
"""


def test_the_planners_task_is_translated_only_when_it_plans(games, tmp_path):
    """textworld translates a game twice, plainly and pruned for its planner; agentrl's envs leave
    the planner's translation until a plan is asked for (`planner_task_on_demand`), which agentrl
    never does. From an empty cache root: a game played without plans is translated once; asked for
    `policy_commands` at every step, it gives the same plans and the same game as textworld's own
    eager load (AGENTRL_NO_GAME_CACHE=1), before and after steps."""
    import os
    import subprocess
    import sys

    path = str(games["look_at_obj_in_light"].path)

    def played(plans: bool, **env) -> dict:  # each from an empty cache root
        root = tmp_path / f"cache{len(list(tmp_path.iterdir()))}"
        proc = subprocess.run([sys.executable, "-c", PLANNED, path, "plans" if plans else "none"], capture_output=True,
                              text=True, timeout=300, env=os.environ | {"AGENTRL_CACHE": str(root)} | env)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    textworlds = played(True, AGENTRL_NO_GAME_CACHE="1")
    assert textworlds["calls"] == [False, True, False, True]  # textworld: both translations at load and at reset
    without_plans, with_plans = played(False, AGENTRL_NO_GAME_CACHE=""), played(True, AGENTRL_NO_GAME_CACHE="")
    assert without_plans["calls"] == [False]  # one translation: the first reset keeps the load's state
    assert with_plans["calls"] == [False, True]  # the planner's, at its first plan
    assert with_plans["seen"] == textworlds["seen"] and textworlds["seen"][0][1]  # the same plans, the same game
    assert [s[:2] + s[3:] for s in without_plans["seen"][1:]] == [s[:2] + s[3:] for s in textworlds["seen"][1:]]


def test_an_eval_run_in_slices_equals_one_run(games):
    """Evaluations larger than the sampler's KV budget run in slices of games, one after another:
    the episodes (which do not interact) and the summed statistics are those of one run."""
    from agentrl.env.pool import LocalEnvs
    from agentrl.rollout import LockstepConfig, Progress, run_in_slices

    chosen = [games[t] for t in ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep")]
    whole = run_lockstep(chosen, WalkthroughPolicy(), max_steps=30)
    resets = []
    sliced = run_in_slices(chosen, 2, WalkthroughPolicy(), LockstepConfig(30), LocalEnvs(AlfworldEnv),
                           Progress(on_reset=lambda k, n: resets.append((k, n))))
    assert [t.game.game_id for t in sliced.trajectories] == [g.game_id for g in chosen]
    assert [(t.won, [s.command for s in t.steps]) for t in sliced.trajectories] == \
           [(t.won, [s.command for s in t.steps]) for t in whole.trajectories]
    assert (sliced.stats.env_steps, sliced.stats.step_tokens) == (whole.stats.env_steps, whole.stats.step_tokens)
    assert resets[-1] == (3, 3)  # progress counts across slices


def test_an_eval_is_sliced_by_the_samplers_kv_budget(tiny_model, tokenizer):
    from agentrl.config import load_config
    from agentrl.rollout.generator import Generator
    from agentrl.sampling.hf import HFSampler
    from agentrl.rollout.plan import TOKENS_PER_STEP, expected_context_tokens
    from agentrl.sampling.compat import kv_bytes_per_token

    cfg = load_config(None, {"env.workers": 0})
    per_row = expected_context_tokens(cfg, 30, tokenizer) * kv_bytes_per_token(tiny_model.config, torch.float32)
    generator = Generator(cfg, HFSampler(tiny_model, tokenizer, kv_budget_gb=10.5 * per_row / (1 << 30)))
    assert generator.slice_size(140, 30) == 10 and generator.slice_size(8, 30) is None
    assert Generator(cfg, walkthrough=True).slice_size(140, 30) is None
    # admissible actions: every step brings a real observation, so rows are planned longer and fewer fit
    admissible = load_config(None, {"env.workers": 0, "sampling.action_space": "admissible"})
    assert expected_context_tokens(admissible, 30, tokenizer) - expected_context_tokens(cfg, 30, tokenizer) == (TOKENS_PER_STEP['admissible'] - TOKENS_PER_STEP['free']) * 30
    longer = expected_context_tokens(admissible, 30, tokenizer) / expected_context_tokens(cfg, 30, tokenizer)
    assert Generator(admissible, generator.sampler).slice_size(140, 30) == int(10.5 / longer) < 10


def test_eval_rows_fixes_the_slices_and_refuses_what_the_kv_budget_cannot_hold(tiny_model, tokenizer):
    """`eval.rows` (`agentrl eval --rows N`): slices of N whatever the free memory (auto's budget
    follows it, and which episodes share a batch moves bf16 numerics: a greedy result repeats only
    at the same slicing); more than the KV budget holds is refused in one line, not run."""
    from agentrl.cli.display import together
    from agentrl.config import load_config
    from agentrl.errors import UserError
    from agentrl.rollout.generator import Generator
    from agentrl.rollout.plan import expected_context_tokens
    from agentrl.sampling.compat import kv_bytes_per_token
    from agentrl.sampling.hf import HFSampler

    def generator(rows, **more):
        cfg = load_config(None, {"env.workers": 0, "eval.rows": rows, **more})
        per_row = expected_context_tokens(cfg, 30, tokenizer) * kv_bytes_per_token(tiny_model.config, torch.float32)
        return Generator(cfg, HFSampler(tiny_model, tokenizer, kv_budget_gb=10.5 * per_row / (1 << 30)))

    assert generator(None).slice_size(140, 30) == 10  # auto: as many as the budget holds
    assert generator(4).slice_size(140, 30) == 4 and generator(10).slice_size(140, 30) == 10
    assert generator(8).slice_size(8, 30) is None and generator(200).slice_size(8, 30) is None  # all together
    with pytest.raises(UserError, match=r"eval.rows 11: the sampler's KV budget holds 10 episodes .* lower --rows"):
        generator(11).slice_size(140, 30)
    with pytest.raises(UserError, match="eval.rows 200: .* holds 10 episodes"):
        generator(200).slice_size(140, 30)
    walk = load_config(None, {"env.workers": 0, "eval.rows": 4, "eval.policy": "walkthrough"})
    assert Generator(walk, walkthrough=True).slice_size(140, 30) == 4
    for bad, why in ((0, "a number of episodes >= 1"), (-1, "a number of episodes >= 1"), (True, "int"), ("all", "int")):
        with pytest.raises(UserError, match=f"eval.rows must be {why}"):
            load_config(None, {"eval.rows": bad})
    summary = {"overall": {"episodes": 134}, "memory": {"rows_together": 91}}
    assert together(summary) == " · 91 of 134 episodes stepped together (--rows 91 repeats it)"
    assert together({**summary, "memory": {"rows_together": 134}}) == "" and together({**summary, "memory": None}) == ""


def test_an_eval_records_its_memory_beside_its_plan(tiny_model, tokenizer, games):
    """summary.json's memory block: the rows stepped together, the KV plan for them, the store at
    its peak (slots x capacity x bytes per token), this process's peak resident memory; none for a
    walkthrough eval (no model)."""
    from agentrl.config import load_config
    from agentrl.evaluate import summary
    from agentrl.rollout.generator import Generator
    from agentrl.sampling.hf import HFSampler
    from agentrl.train.loop import eval_row

    cfg = load_config(None, {"env.workers": 0})
    chosen = [games["pick_and_place_simple"], games["look_at_obj_in_light"]]
    with Generator(cfg, HFSampler(tiny_model, tokenizer)) as gen:
        memory = summary(gen.evaluate(chosen, "valid_seen", 2), cfg)["memory"]
    assert memory["rows_together"] == 2 and memory["kv_peak_slots"] == 2
    assert memory["kv_peak_bytes"] == 2 * memory["kv_peak_capacity"] * memory["kv_bytes_per_token"] > 0
    assert memory["kv_planned_bytes"] == 2 * memory["tokens_per_row_planned"] * memory["kv_bytes_per_token"]
    assert memory["peak_rss_bytes"] > memory["kv_peak_bytes"] and memory["env_workers_peak_rss_bytes"] == 0
    one = load_config(None, {"env.workers": 0, "eval.rows": 1})  # --rows 1: the two games one after the other
    with Generator(one, HFSampler(tiny_model, tokenizer)) as gen:
        result = gen.evaluate(chosen, "valid_seen", 2)
    assert result.memory["rows_together"] == 1 and result.memory["kv_peak_slots"] == 1
    assert eval_row(result, 2, 1)["rows_together"] == 1  # train's in-run eval rows say it too (metrics.jsonl)
    assert [t.game.game_id for t in result.trajectories] == [g.game_id for g in chosen]
    with Generator(load_config(None, {"env.workers": 0, "eval.policy": "walkthrough"}), walkthrough=True) as gen:
        assert gen.evaluate(chosen, "valid_seen", 2).memory is None


KEPT = """
import sys
from pathlib import Path
from agentrl.env.alfworld import kept_translations
from agentrl.env.data import read_game
games = [read_game(Path(p), "valid_seen") for p in sys.argv[1:]]
print("\\n".join(str(p) for p in kept_translations(games)))
"""


def test_kept_translations_names_the_files_a_load_reads(games, tmp_path):
    """The translations a lent machine is handed (`kept_translations`, packed by
    benchmarks/lent_gpu/prepare.sh) are the files an env's load reads: on an empty cache root a
    game is translated once and its one file named; asked again, nothing is translated."""
    import os
    import subprocess
    import sys

    paths = [str(games[t].path) for t in ("look_at_obj_in_light", "pick_and_place_simple")]
    env = os.environ | {"AGENTRL_CACHE": str(tmp_path)}
    env.pop("AGENTRL_NO_GAME_CACHE", None)

    def kept() -> list[str]:
        proc = subprocess.run([sys.executable, "-c", KEPT, *paths], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    first = kept()
    on_disk = sorted(str(p) for p in (tmp_path / "pddl2sas").rglob("*.pkl.z"))
    assert len(first) == 2 and sorted(first) == on_disk  # the plain translation only (`planner_task_on_demand`)
    stamps = {p: os.stat(p).st_mtime_ns for p in first}
    assert kept() == first and {p: os.stat(p).st_mtime_ns for p in first} == stamps  # read, not rewritten
