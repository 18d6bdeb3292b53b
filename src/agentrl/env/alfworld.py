"""One ALFWorld text game (TextWorld-PDDL engine) with alfworld's own wrappers.

An invalid command never reaches the engine: the step is a no-op that still counts
toward T_max (the paper's rule), and the agent sees ALFWorld's own "Nothing happens.".
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import pickle
import re
import tempfile
import types
import zlib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from agentrl.env.data import Game
from agentrl.io import cache_root

NOTHING_HAPPENS = "Nothing happens."
_WELCOME = re.compile(r"^\s*-= Welcome to TextWorld, ALFRED! =-\s*")


class GameLoadError(RuntimeError):
    """The engine could not load or reset a game file (reported by path; the episode is skipped)."""


@dataclass
class StepResult:
    observation: str
    admissible: list[str]
    won: bool
    done: bool


def clean_observation(text: str) -> str:
    return _WELCOME.sub("", text or "").strip()


@functools.lru_cache(maxsize=1)
def _install_game_caches() -> None:
    """Make the G envs of a group (and a game that returns in a later iteration) cheap to start.

    Profile of one env (load 1.8 s + reset 0.6 s): 70% is fast_downward's PDDL->SAS translation,
    run twice per PddlState (plain and optimised), and a PddlState is built at load and again at
    every reset; most of the rest is parsing the game's grammar into a GameLogic. Both are pure
    functions of the game file, so we memoise them per process (the grammar once for every game:
    `logic_sharing_the_grammar`), and the translation also on disk
    (`_kept_on_disk`): a game loaded before, by any process, loads in a sixth of the time. The
    planner's optimised translation, which agentrl never plans with, is made only where a plan
    is asked for (`planner_task_on_demand`): a game's first load takes half the time. Each env keeps its own copy of
    fast_downward's library (textworld loads one per env), where the mutable game state lives,
    so envs of the same game stay independent (tested). Envs cannot simply be copied instead:
    they hold ctypes handles.
    """
    import fast_downward
    from textworld.envs.pddl import logic as pddl_logic
    from textworld.envs.pddl import pddl

    translate = _kept_on_disk(fast_downward.pddl2sas, cache_root() / TRANSLATION_DIRNAME)
    translate = functools.lru_cache(maxsize=256)(translate)  # read-only (task, sas) results
    fast_downward.pddl2sas = planner_task_on_demand(translate)
    pddl_logic.PddlState.replan = translating_the_planner_task_first(pddl_logic.PddlState.replan, translate)

    game_logic = pddl_logic.GameLogic
    shared_logic = functools.lru_cache(maxsize=8)(lambda domain, grammar: game_logic(domain=domain, grammar=grammar))

    @functools.lru_cache(maxsize=64)
    def cached_logic(domain: str, grammar: str):
        return logic_sharing_the_grammar(game_logic, shared_logic, domain, grammar)

    pddl.pddl_logic = types.SimpleNamespace(**{**vars(pddl_logic), "GameLogic": cached_logic})

    # Every reset and step re-derives the intro/feedback text and each admissible command's
    # template from strings with a tatsu parser (most of what is left of a cached reset, and of a
    # step). The parse is a pure function of the string; callers mutate the returned symbols
    # (their context), so each caller gets its own deep copy of the memoised tree.
    from textworld import logic as tw_logic
    from textworld.envs.pddl import textgen

    for module in (textgen, tw_logic):
        module._parse_and_convert = _memoised_parse(module._parse_and_convert)


# A game's grammar (~13 kB, which textworld parses with tatsu into the game's GameLogic: a third of
# a game's load) differs from another game's in one rule only, its task sentence. sha256 (first 16
# hex digits) of the textworld source `logic_sharing_the_grammar` repeats: where an installed
# textworld differs, each game's grammar is parsed whole, as textworld does.
_TASK_RULE = re.compile(r'"task":\s*\[\s*\{\s*"rhs":\s*("(?:[^"\\\n]|\\.)*")\s*\}\s*\]')
_TASK_STAND_IN = '"the task"'
_LOGIC_SOURCES = {"GameLogic.__init__": "8eb1547d426d3913", "ContextSensitiveGrammar.parse": "f9ef39c61f2d979e"}


def _source_digest(fn) -> str:
    """sha256 (16 hex digits) of a function's source; "" where there is none (an install without
    .py files), so nothing is replaced there."""
    import inspect

    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return ""


@functools.lru_cache(maxsize=1)
def _logic_sources_match() -> bool:
    from textworld.envs.pddl import textgen
    from textworld.envs.pddl.logic import GameLogic

    return (_source_digest(GameLogic.__init__) == _LOGIC_SOURCES["GameLogic.__init__"]
            and _source_digest(textgen.ContextSensitiveGrammar.parse) == _LOGIC_SOURCES["ContextSensitiveGrammar.parse"])


def logic_sharing_the_grammar(game_logic, shared_logic, domain: str, grammar: str):
    """The GameLogic textworld builds from (domain, grammar), built from the logic of the same
    grammar with a stand-in task (`shared_logic`, memoised: one tatsu parse for every game whose
    grammar differs only in its task) and this game's own task rule, made as
    `ContextSensitiveGrammar.parse` makes it. Its actions and rules are the shared logic's objects
    (textworld never changes them: a derivation copies a rule's symbols before using them, as
    envs of one game already share one GameLogic); its types are its own (a PddlState adds the
    task's types to them). Anything else, a grammar without exactly one such task rule or another
    textworld, is textworld's own parse."""
    found = list(_TASK_RULE.finditer(grammar))
    if len(found) != 1 or not _logic_sources_match():
        return game_logic(domain=domain, grammar=grammar)
    import textworld.logic
    from textworld.envs.pddl import textgen

    task = found[0]
    shared = shared_logic(domain, grammar[:task.start(1)] + _TASK_STAND_IN + grammar[task.end(1):])
    logic = game_logic.__new__(game_logic)  # what GameLogic.__init__ does, but the parse
    logic.domain = domain
    logic.grammar = textgen.ContextSensitiveGrammar()
    logic.actions = {}
    logic.types = textworld.logic.TypeHierarchy()
    logic.actions.update(shared.actions)
    logic.grammar.update(shared.grammar)
    rhs = textgen._parse_and_convert(json.loads(task.group(1)), rule_name="symbols")
    logic.grammar._rules["task"] = [textgen.ProductionRule(lhs="task", rhs=rhs, weight=1, condition="")]
    return logic


TRANSLATION_DIRNAME = "pddl2sas"  # under the cache root: ~52 kB a game (the plain translation, zlib'd)


class PlannerTask(str):
    """The planner's task as a PddlState holds it until its planner is asked for a plan: an empty
    string (what `load_sas_replan` stores, where nothing reads it) that knows the problem it stands
    for, translated by `translating_the_planner_task_first` at the state's first `replan`."""

    def __new__(cls, domain: str, problem: str, verbose: bool = False):
        task = super().__new__(cls, "")
        task.domain, task.problem, task.verbose = domain, problem, verbose
        return task


def planner_task_on_demand(translate):
    """fast_downward's translation as a PddlState asks for it, its planner's copy left for later.

    textworld translates every game twice at each PddlState: plainly for the game itself, and
    `optimize=True` (unreachable facts and unimportant variables pruned, a partial encoding) for
    its planner (`load_sas_replan`, which only keeps the string for `replan`). The planner is asked
    for a plan only for `policy_commands`, or for a walkthrough a game lacks; agentrl asks for
    neither (AlfworldEnv's EnvInfos), yet that second translation was half of a game's first load.
    So the optimised translation is made when the state's planner is first asked for a plan, the
    same task it would have had (tested: the same plans as textworld's, after steps too)."""
    @functools.wraps(translate)
    def translated(domain: str, problem: str, verbose: bool = False, optimize: bool = False):
        if optimize:
            return None, PlannerTask(domain, problem, verbose)  # PddlState keeps only the second
        return translate(domain, problem, verbose=verbose)

    return translated


def translating_the_planner_task_first(replan, translate):
    """PddlState.replan, giving the planner its task first where `planner_task_on_demand` left it
    for now: translated (kept on disk like the plain one), stored on the state, and loaded into the
    state's library, whose planner reads it at this call (the library only keeps the string until
    then), so the plan is the one textworld's eager load gives."""
    @functools.wraps(replan)
    def replanned(self, *args, **kwargs):
        task = getattr(self, "sas_replan", None)
        if isinstance(task, PlannerTask):
            _, self.sas_replan = translate(task.domain, task.problem, verbose=task.verbose, optimize=True)
            self.downward_lib.load_sas_replan(self.sas_replan.encode("utf-8"))
        return replan(self, *args, **kwargs)

    return replanned


def _kept_on_disk(translate, root: Path):
    """fast_downward's PDDL->SAS translation (84% of a game's load) kept under `root`, one zlib'd
    pickle of its (task, sas) per input, keyed by the domain, the problem, the options and the
    translator's version. A file that does not read back is translated again and rewritten; a
    cache that cannot be written (read-only) only costs the translation."""
    def kept(domain: str, problem: str, verbose: bool = False, optimize: bool = False):
        path = _translation_path(root, domain, problem, optimize)
        try:
            return pickle.loads(zlib.decompress(path.read_bytes()))
        except Exception:  # not there yet, or damaged (an interrupted write, another pickle format): translated below
            pass
        out = translate(domain, problem, verbose=verbose, optimize=optimize)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(zlib.compress(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)))
            os.replace(tmp, path)  # a reader (another worker) sees the whole file or none
        except OSError:
            if tmp:
                Path(tmp).unlink(missing_ok=True)
        return out

    return kept


@functools.lru_cache(maxsize=1)
def _translator_version() -> str:
    try:
        return metadata.version("fast_downward_textworld")
    except metadata.PackageNotFoundError:
        return "unknown"


def _translation_path(root: Path, domain: str, problem: str, optimize: bool) -> Path:
    key = hashlib.sha256(repr((_translator_version(), optimize, domain, problem)).encode()).hexdigest()[:40]
    return root / key[:2] / f"{key}.pkl.z"


def kept_translations(games: list[Game]) -> list[Path]:
    """The files of these games' translations under the cache root, each translated first where it
    is not there yet (by loading the game once): what a machine that starts with nothing (the lent
    GPU) is handed, so its envs load as a second load does here."""
    root = cache_root() / TRANSLATION_DIRNAME
    out = []
    for game in games:
        data = json.loads(game.path.read_text())
        path = _translation_path(root, data["pddl_domain"], data["pddl_problem"], False)  # the plain one only
        if not path.exists():
            AlfworldEnv(game).close()
        if not path.exists():
            raise RuntimeError(f"{game.path}: its translation was not kept at {path} (a read-only cache root?)")
        out.append(path)
    return out


_FREE_LIBS: list = []  # fast_downward library copies whose env closed: the next env takes one


@functools.lru_cache(maxsize=1)
def _install_lib_pool() -> None:
    """Every env loads its own copy of fast_downward's library (textworld: `fast_downward.load_lib()`,
    a fresh 34 MB copy of libdownward.so under /tmp, dlopen'ed, its file deleted), and textworld
    never unloads one: each env a process ever made kept 34 MB of disk until the process exited
    (a deleted file stays allocated while mapped), so a long-lived worker filled the disk (the
    replay of every train game did, at ~2,000 envs, 2026-11-27). Unloading (dlclose) crashes the
    interpreter at exit, so a closed env's copy goes back to this process's free list instead and
    the next env takes it: copies are as many as envs open at once. A copy is reused as textworld
    itself reuses one at every reset (`load_sas` of the new task into the same library), after
    the library's own `cleanup`."""
    import fast_downward
    from textworld.envs.pddl import pddl

    load = fast_downward.load_lib

    def pooled_load():
        return _FREE_LIBS.pop() if _FREE_LIBS else load()

    pddl.fast_downward = types.SimpleNamespace(**{**vars(fast_downward), "load_lib": pooled_load})


def release_downward(env) -> None:
    """Find the PddlEnv under textworld's wrappers and give its library copy back to the free list
    (its planner state freed first). Nothing may call into the env afterwards."""
    while env is not None:
        lib = vars(env).get("downward_lib")  # its own attribute: a wrapper may forward attribute reads
        if lib is not None:
            env.downward_lib = None
            lib.cleanup()
            _FREE_LIBS.append(lib)
            return
        env = vars(env).get("_wrapped_env")


@functools.lru_cache(maxsize=1)
def _install_cheap_derivation() -> None:
    """Derive a step's text without textworld's deep copies, which were 3/4 of an env step.

    A step derives its feedback and every admissible command's text from the game's grammar
    (`textgen`), and each symbol of a derivation gets its own context: textworld deep-copies the
    context's `variables` (name -> EntityInfo) and `mapping` (Placeholder -> Variable) dicts for
    every symbol, ~180 times a step (profile of 115 walkthrough steps on 20 valid_seen games: 33.9
    ms a step, 7.2 of 10 profiled seconds in `copy_context`). A derivation only adds keys to its
    own copy of those dicts (`query`'s `update`) and never changes an entity or a variable, so a
    copy of each dict keeps every context as independent as the deep copy did. Likewise a
    symbol's `copy` deep-copied the symbol with the context it is about to replace, and a
    memoised parse tree needs only its symbols copied (callers rebind their contexts), not the
    default contexts under them; a conjunctive query's predicates are never changed, so its
    parse is memoised and each caller gets a `Rule` of its own. What a player sees is unchanged:
    tested against textworld's own code on real games, walkthroughs and seeded random walks
    (tests/test_env.py), and checked on every held-out game by `benchmarks/bench_env.py
    --check`."""
    from textworld import logic as tw_logic
    from textworld.envs.pddl import textgen

    def copy_context(context):
        return {"state": context["state"], "facts": context["facts"], "variables": dict(context["variables"]),
                "mapping": dict(context["mapping"]), "entity_infos": context["entity_infos"]}

    def clone(node):
        """A derivation tree's symbols copied; their contexts, strings and queries shared (rebound by the caller)."""
        if isinstance(node, list):
            return [clone(n) for n in node]
        if not isinstance(node, textgen.Symbol):
            return node
        new = copy.copy(node)
        for attr in ("symbol", "expression"):  # a ListSymbol's item, a ConditionalSymbol's expression
            child = getattr(node, attr, None)
            if isinstance(child, (textgen.Symbol, list)):
                setattr(new, attr, clone(child))
        return new

    def copy_symbol(self, context):
        new = clone(self)
        new.context = copy_context(context)
        return new

    parse = getattr(textgen._parse_and_convert, "__wrapped__", textgen._parse_and_convert)  # the parser itself
    parsed = functools.lru_cache(maxsize=8192)(lambda args, kwargs: parse(*args, **dict(kwargs)))

    def parse_symbols(*args, **kwargs):
        return clone(parsed(args, tuple(sorted(kwargs.items()))))

    @functools.lru_cache(maxsize=8192)
    def query_preconditions(expr: str) -> tuple:
        return tuple(tw_logic._parse_and_convert(expr, rule_name="conjunctiveQuery"))

    textgen.copy_context = copy_context
    textgen.Symbol.copy = copy_symbol
    textgen._parse_and_convert = parse_symbols
    tw_logic.Rule.parse_conjunctive_query = classmethod(lambda cls, expr: cls("query", query_preconditions(expr), []))


# sha256 (first 16 hex digits) of the textworld source `_install_cheap_queries` replaces: where an
# installed textworld differs, its own code runs
_QUERY_SOURCES = {"_all_applicable_assignments": "91b8f7e76f9ffa85", "facts": "efbf3b4cf68eecf2"}


def _fact_order(prop) -> tuple:
    """A proposition's place in textworld's order (`Proposition.__lt__`: by name, then arguments,
    each argument by (name, type)) as one tuple of strings, compared in C."""
    return prop.name, tuple([(v.name, v.type) for v in prop.arguments])


@functools.lru_cache(maxsize=1)
def _install_cheap_queries() -> None:
    """Answer a step's queries on the game state without sorting through Python comparisons.

    What was left of a step after the cheap derivation (profile of 115 walkthrough steps on 20
    valid_seen games): a third of it was `State._all_applicable_assignments` sorting each
    signature's facts (~65 sorts a step) with `Proposition.__lt__`, which builds two tuples and
    compares `Variable`s in Python at every comparison; and a tenth was `State.facts`, a Python
    generator that `_gather_infos` lists once per admissible command. Here the sort takes a key
    that gives the same order (`_fact_order`: facts in a set are distinct, so no ties) and the
    facts are chained in C, in the same order. The replaced method is textworld's own but for the
    sort, installed only over the source it was copied from (`_QUERY_SOURCES`)."""
    import itertools

    from textworld.logic import Signature, State

    if (_source_digest(State._all_applicable_assignments) != _QUERY_SOURCES["_all_applicable_assignments"]
            or _source_digest(State.facts.fget) != _QUERY_SOURCES["facts"]):
        return

    def _all_applicable_assignments(self, rule, mapping, used_vars, new_phs_by_depth, depth):
        new_phs = new_phs_by_depth[depth]
        if depth >= len(rule.preconditions):
            yield from self._all_assignments(new_phs, mapping, used_vars, False)
            return
        pred = rule.preconditions[depth]
        types = [self._logic.types.get(t) for t in pred.signature.types]
        for subtypes in self._logic.types.multi_subtypes(types):
            signature = Signature(pred.signature.name, [t.name for t in subtypes])
            for prop in sorted(self.facts_with_signature(signature), key=_fact_order):  # textworld: sorted(...)
                for ph, var in zip(pred.parameters, prop.arguments):
                    existing = mapping.get(ph)
                    if existing is None:
                        if var in used_vars:
                            break
                        mapping[ph] = var
                        used_vars.add(var)
                    elif existing != var:
                        break
                else:
                    yield from self._all_applicable_assignments(rule, mapping, used_vars, new_phs_by_depth, depth + 1)
                for ph in new_phs:  # the mapping as it was before the recursive call
                    var = mapping.pop(ph, None)
                    used_vars.discard(var)

    State._all_applicable_assignments = _all_applicable_assignments
    State.facts = property(lambda self: itertools.chain.from_iterable(self._facts.values()),
                           doc="All the facts in the current state.")


_STATE_FOR_THE_NEXT_RESET: list = []  # the one state the reset being run takes instead of building it


@functools.lru_cache(maxsize=1)
def _install_first_reset() -> None:
    """The first reset after a load keeps the game state the load built.

    textworld builds a game's PddlState (its facts read from the planner, ~35 ms) at load, and
    builds it again from the same problem at every reset, the first one included, which
    follows the load before any command: a quarter of an env's load and first reset. A state
    its load built and no step has touched is what that reset would build (the same facts
    from the same problem; the planner library, loaded with the problem at load, has applied
    nothing since), so the first reset takes it; a step in between, and every later reset,
    builds it as textworld does."""
    from textworld.envs.pddl import pddl

    build = pddl.pddl_logic.PddlState
    load, reset, step = pddl.PddlEnv.load, pddl.PddlEnv.reset, pddl.PddlEnv.step

    def pddl_state(downward_lib, pddl_problem, logic):
        if _STATE_FOR_THE_NEXT_RESET:
            state = _STATE_FOR_THE_NEXT_RESET.pop()
            if state.downward_lib is downward_lib and state.pddl_problem == pddl_problem and state._logic is logic:
                return state
        return build(downward_lib, pddl_problem, logic)

    def loaded(self, *args, **kwargs):
        load(self, *args, **kwargs)
        self._agentrl_state_untouched = True

    def reset_keeping_the_loaded_state(self):
        if vars(self).pop("_agentrl_state_untouched", False):
            _STATE_FOR_THE_NEXT_RESET[:] = [self._pddl_state]
        try:
            return reset(self)
        finally:
            _STATE_FOR_THE_NEXT_RESET.clear()

    def stepped(self, *args, **kwargs):
        vars(self).pop("_agentrl_state_untouched", None)
        return step(self, *args, **kwargs)

    pddl.pddl_logic = types.SimpleNamespace(**{**vars(pddl.pddl_logic), "PddlState": pddl_state})
    pddl.PddlEnv.load, pddl.PddlEnv.reset, pddl.PddlEnv.step = loaded, reset_keeping_the_loaded_state, stepped


def install_game_caches() -> None:
    """The caches above, unless AGENTRL_NO_GAME_CACHE is set (to compare with textworld's own behaviour)."""
    if not os.environ.get("AGENTRL_NO_GAME_CACHE"):
        _install_game_caches()
        _install_cheap_derivation()
        _install_cheap_queries()
        _install_first_reset()


def warm_up() -> None:
    """Import the engine and install the caches now (an env worker does it while the parent loads
    its model), so the first reset does not pay for them."""
    import textworld  # noqa: F401
    from alfworld.agents.environment import alfred_tw_env  # noqa: F401

    install_game_caches()
    _install_lib_pool()


def _memoised_parse(parse):
    @functools.lru_cache(maxsize=8192)
    def parsed(args: tuple, kwargs: tuple):
        return parse(*args, **dict(kwargs))

    def cached(*args, **kwargs):
        return copy.deepcopy(parsed(args, tuple(sorted(kwargs.items()))))

    cached.__wrapped__ = parse
    return cached


class AlfworldEnv:
    """Load a game once; reset/step it. Not thread-safe; one per process/worker."""

    def __init__(self, game: Game, facts: bool = False):
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

        install_game_caches()
        _install_lib_pool()  # always: a resource fix, not a cache

        self.game = game
        # facts: the engine's whole state after each command (`state`), for ALFWorld's own expert (expert.py)
        infos = textworld.EnvInfos(won=True, admissible_commands=True, facts=facts)
        try:
            self._env = textworld.start(str(game.path), request_infos=infos, wrappers=[AlfredDemangler(), AlfredInfos])
        except Exception as e:  # the engine raises many types on bad PDDL/grammar
            raise GameLoadError(f"cannot load game {game.path}: {e.__class__.__name__}: {e}") from e
        self._admissible: list[str] = []
        self.won = False
        self.state = None  # the engine's last game state (its facts when asked for)

    def reset(self) -> StepResult:
        try:
            state = self._env.reset()
        except Exception as e:
            raise GameLoadError(f"cannot reset game {self.game.path}: {e.__class__.__name__}: {e}") from e
        return self._result(state, done=False)

    def step(self, command: str | None) -> StepResult:
        """Run an admissible command; None (invalid action) is a no-op that leaves the game as it was."""
        if command is None or command not in self._admissible:
            return StepResult(NOTHING_HAPPENS, list(self._admissible), self.won, self.won)
        state, _reward, done = self._env.step(command)
        return self._result(state, done=bool(done))

    def _result(self, state, done: bool) -> StepResult:
        self.state = state
        self._admissible = list(state["admissible_commands"] or [])
        self.won = bool(state["won"])
        return StepResult(clean_observation(state.feedback), list(self._admissible), self.won, done or self.won)

    def close(self) -> None:
        """End the game and give its copy of fast_downward's library to the next env
        (`_install_lib_pool`: textworld's own close kept every copy, 34 MB of disk each, for the
        life of the process). Closing twice is harmless."""
        self._env.close()
        release_downward(self._env)
