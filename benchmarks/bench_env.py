"""Env work on this machine (a script, not a test).

1. Group resets: G envs of one ALFWorld game, with and without the game caches. Each arm runs
   in a fresh subprocess so none starts warm in memory; the uncached arm sets
   AGENTRL_NO_GAME_CACHE=1 (textworld's own behaviour); the cached arm starts from an empty
   cache root (the translation not yet on disk), the on-disk arm from the root it left (every
   game's translation kept there, as for a game any earlier process loaded).
2. Env steps per second: B x G envs stepping their walkthroughs in lockstep batches, in this
   process vs an EnvPool of N worker processes (same actions, same results).
3. The time of one env step, four arms in fresh subprocesses on the same games and actions (each
   game's walkthrough, then a seeded random walk of admissible commands): textworld's own code
   (AGENTRL_NO_GAME_CACHE=1), agentrl's game caches alone (as before 2026-12-02), the caches with
   the cheap derivation (`_install_cheap_derivation`), and with the cheap queries as well
   (`_install_cheap_queries`, the default). Each arm prints a digest of everything a player saw
   (observations, admissible lists, wins); --check exits 1 unless all arms agree. `--steps-only`
   runs only this part; `--arms` picks some (textworld's own takes ~45 minutes on all 274 games).
4. The first load of each distinct game (`--loads-only`): every held-out game opened and reset
   once, its translation already on disk (as for a game any earlier process loaded), then a
   second env of the same game (a group's next env), in fresh subprocesses alternated: each
   game's grammar parsed whole into its GameLogic (textworld's parse); one shared parse and the
   game's own task rule (`logic_sharing_the_grammar`); and with it, the first reset keeping the
   state its load built (`_install_first_reset`, the default). Each arm prints a digest of every
   reset's observation and admissible list and of each env's first walkthrough step, and of a
   second reset after it; --check exits 1 unless the arms agree.
5. A game's first load with nothing on disk (`--cold-loads`: a walkthrough replay's, or a rollout's
   on a train game never played before): every arm from an empty cache root, so each game is
   translated; textworld translates it twice (plainly, and pruned for its planner, which only
   plans for `policy_commands`), agentrl's default leaves the planner's translation until a plan
   is asked for (`planner_task_on_demand`, which agentrl never does). Same digest as 4.

Usage: python benchmarks/bench_env.py [--group-size 8] [--games 3] [--workers N]
       python benchmarks/bench_env.py --steps-only --step-games 0 --check   # every held-out game
       python benchmarks/bench_env.py --steps-only --step-games 0 --walk 30 --check --arms derivation,cheap
       python benchmarks/bench_env.py --loads-only --repeats 2 --check   # every held-out game's first load
       python benchmarks/bench_env.py --cold-loads 60 --repeats 2 --check   # 60 held-out games, nothing on disk
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

ARM = """
import json, sys, time
from agentrl.env.data import discover_games
from agentrl.env.alfworld import AlfworldEnv
G, n = int(sys.argv[1]), int(sys.argv[2])
out = []
for game in discover_games("valid_seen", None, limit=n):
    t = time.perf_counter(); envs = [AlfworldEnv(game)]; envs[0].reset(); one = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(G - 1):
        envs.append(AlfworldEnv(game)); envs[-1].reset()
    rest = time.perf_counter() - t
    t = time.perf_counter(); [e.step(e._admissible[0]) for e in envs]; step = (time.perf_counter() - t) / G
    out.append({"game": game.game_id, "one_reset_s": one, "group_reset_s": one + rest, "step_s": step})
    for e in envs:
        e.close()
print(json.dumps(out))
"""


STEP_ARM = """
import hashlib, json, random, sys, time
name, limit, walk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])  # read first: the engine's imports rewrite sys.argv
import agentrl.env.alfworld as alfworld
from agentrl.env.data import discover_games
if name == "caches":
    alfworld._install_cheap_derivation = lambda: None  # the caches as they were before it
if name in ("caches", "derivation"):
    alfworld._install_cheap_queries = lambda: None  # as before 2026-12-02's second change
games = [g for split in ("valid_seen", "valid_unseen") for g in discover_games(split, None)]
games = games if limit == 0 else games[:: max(1, len(games) // limit)][:limit]  # spread over both splits
digest, steps, step_s, t0 = hashlib.sha256(), 0, 0.0, time.perf_counter()
for i, game in enumerate(games):
    rng = random.Random(i)
    for plan in (game.walkthrough, None):  # the walkthrough, then a random walk from a fresh reset
        env = alfworld.AlfworldEnv(game)
        r = env.reset()
        digest.update(repr((r.observation, r.admissible)).encode())
        for t in range(len(plan) if plan else walk):
            command = plan[t] if plan else rng.choice(r.admissible)
            t1 = time.perf_counter()
            r = env.step(command)
            step_s += time.perf_counter() - t1
            steps += 1
            digest.update(repr((command, r.observation, r.admissible, r.won)).encode())
            if r.done:
                break
        env.close()
print(json.dumps({"games": len(games), "steps": steps, "step_s": step_s, "wall_s": time.perf_counter() - t0,
                  "digest": digest.hexdigest()}))
"""

LOAD_ARM = """
import hashlib, json, sys, time
name, limit, cold = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "cold"
import agentrl.env.alfworld as alfworld
from agentrl.env.data import discover_games
if name == "eager-planner":
    alfworld.planner_task_on_demand = lambda translate: translate  # both translations at load, as textworld does
if name == "whole":
    alfworld._logic_sources_match = lambda: False  # each grammar parsed whole, as textworld does
if name in ("whole", "shared"):
    alfworld._install_first_reset = lambda: None  # every reset builds the state again, as textworld does
games = [g for split in ("valid_seen", "valid_unseen") for g in discover_games(split, None)]
games = games if limit == 0 else games[:: max(1, len(games) // limit)][:limit]  # spread over both splits
if cold:
    alfworld.warm_up()  # the engine imported and its caches installed before the clock, nothing translated
else:
    alfworld.AlfworldEnv(games[0]).close()  # the engine, its caches and the shared grammar parse before the clock
digest, t_s = hashlib.sha256(), {"load_s": 0.0, "reset_s": 0.0, "next_env_s": 0.0}
for game in games:
    for which in ("first", "next"):  # the game's first env, then a group's next env of it
        t = time.perf_counter(); env = alfworld.AlfworldEnv(game); t1 = time.perf_counter(); r = env.reset()
        if which == "first":
            t_s["load_s"] += t1 - t; t_s["reset_s"] += time.perf_counter() - t1
        else:
            t_s["next_env_s"] += time.perf_counter() - t
        s = env.step(game.walkthrough[0])
        again = env.reset()
        digest.update(repr((r.observation, r.admissible, s.observation, s.admissible, s.won, again.observation,
                            again.admissible)).encode())
        env.close()
print(json.dumps({"games": len(games), **t_s, "digest": digest.hexdigest()}))
"""

LOAD_ARMS = {"whole": "each grammar parsed whole (textworld's parse)",
             "shared": "one shared parse + the game's task",
             "first-reset": "+ the first reset keeps the loaded state (default)"}
COLD_ARMS = {"eager-planner": "the planner's translation at load (textworld's)",
             "first-reset": "the planner's translation on demand (default)"}


def load_arms(repeats: int, check: bool, cold_games: int | None = None) -> None:
    """Each arm `repeats` times in fresh subprocesses, alternated. The translations are put on disk
    first by a warm-up arm, so every arm reads them; with `cold_games` (0: all 274) every run starts
    from its own empty cache root instead, so every game is translated."""
    import tempfile

    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_NO_GAME_CACHE"}
    arms = COLD_ARMS if cold_games is not None else LOAD_ARMS

    def run(name: str) -> dict:
        with tempfile.TemporaryDirectory() as root:
            cold = {"AGENTRL_CACHE": root} if cold_games is not None else {}
            proc = subprocess.run([sys.executable, "-c", LOAD_ARM, name, str(cold_games or 0),
                                   "cold" if cold else "warm"], capture_output=True, text=True, env=env | cold)
        if proc.returncode:
            sys.exit(f"load arm {name} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    if cold_games is None:
        run("first-reset")  # every translation on disk before any arm is timed
    rows = {name: [] for name in arms}
    for _ in range(repeats):
        for name in arms:
            rows[name].append(run(name))
    n = rows["first-reset"][0]["games"]
    print(f"the first load of each of {n} held-out games "
          f"({'nothing on disk: every game translated' if cold_games is not None else 'translations on disk'}), "
          f"then a second env of the game; {repeats} run(s) an arm, alternated; ms a game:")
    first, second = {}, {}
    for name, runs in rows.items():
        cols = {k: [1000 * r[k] / n for r in runs] for k in ("load_s", "reset_s", "next_env_s")}
        first[name] = min(a + b for a, b in zip(cols["load_s"], cols["reset_s"]))
        second[name] = min(cols["next_env_s"])
        show = {k: " / ".join(f"{x:.1f}" for x in v) for k, v in cols.items()}
        print(f"  {arms[name]:<52} load {show['load_s']}, first reset {show['reset_s']}, the next env's "
              f"load + reset {show['next_env_s']}  digest {runs[0]['digest'][:16]}")
    for name in (n for n in arms if n != "first-reset"):
        print(f"  the default against {arms[name]}: a first load + reset {first[name] / first['first-reset']:.2f}x "
              f"faster, the next env {second[name] / second['first-reset']:.2f}x (best runs)")
    same = len({r["digest"] for runs in rows.values() for r in runs}) == 1
    print(f"  what a player saw: {'identical in every run' if same else 'DIFFERENT between arms'}")
    if check and not same:
        sys.exit(1)


STEP_ARMS = {"textworld": "textworld's own code", "caches": "the game caches alone",
             "derivation": "the caches + the cheap derivation",
             "cheap": "+ the cheap queries (default)"}


def step_arm(name: str, games: int, walk: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_NO_GAME_CACHE"}
    env |= {"AGENTRL_NO_GAME_CACHE": "1"} if name == "textworld" else {}
    proc = subprocess.run([sys.executable, "-c", STEP_ARM, name, str(games), str(walk)], capture_output=True,
                          text=True, env=env)
    if proc.returncode:
        sys.exit(f"step arm {name} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def step_arms(games: int, walk: int, check: bool, arms: list[str] | None = None) -> None:
    rows = {name: step_arm(name, games, walk) for name in (arms or STEP_ARMS)}
    print(f"one env step, {rows['cheap']['games']} held-out games, each walkthrough then a random walk of up to "
          f"{walk} admissible commands ({rows['cheap']['steps']} steps per arm):")
    for name, r in rows.items():
        print(f"  {STEP_ARMS[name]:<46} {1000 * r['step_s'] / r['steps']:7.2f} ms a step  (arm wall "
              f"{r['wall_s']:.1f} s)  digest {r['digest'][:16]}")
    per = {name: r["step_s"] / r["steps"] for name, r in rows.items()}
    for name in (n for n in rows if n != "cheap"):
        print(f"  the default: {per[name] / per['cheap']:.2f}x faster than {STEP_ARMS[name]}")
    same = len({r["digest"] for r in rows.values()}) == 1 and len({r["steps"] for r in rows.values()}) == 1
    print(f"  what a player saw: {f'identical in all {len(rows)} arms' if same else 'DIFFERENT between arms'}")
    if check and not same:
        sys.exit(1)


def arm(group_size: int, games: int, cached: bool, cache_root: str) -> list[dict]:
    env = os.environ | {"AGENTRL_CACHE": cache_root} | ({} if cached else {"AGENTRL_NO_GAME_CACHE": "1"})
    proc = subprocess.run([sys.executable, "-c", ARM, str(group_size), str(games)], capture_output=True, text=True,
                          env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def steps_per_second(games, group_size: int, workers: int) -> tuple[float, int]:
    """Lockstep batches of env.step over every env still playing its walkthrough."""
    import time

    from agentrl.env import env_factory
    from agentrl.env.pool import EnvPool, LocalEnvs

    backend = EnvPool(workers) if workers else LocalEnvs(env_factory("alfworld"))
    try:
        envs = [(g.game_id + f"#{i}", g) for g in games for i in range(group_size)]
        backend.reset_all([(h, g) for h, (_, g) in enumerate(envs)])
        steps, t0, t = 0, time.perf_counter(), 0
        while True:
            batch = [(h, g.walkthrough[t]) for h, (_, g) in enumerate(envs) if t < len(g.walkthrough)]
            if not batch:
                break
            backend.step_all(batch)
            steps, t = steps + len(batch), t + 1
        return steps / (time.perf_counter() - t0), steps
    finally:
        backend.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--games", type=int, default=3)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--step-games", type=int, default=6, help="held-out games for the env-step arms (0: all 274)")
    ap.add_argument("--walk", type=int, default=15, help="random admissible commands after each walkthrough")
    ap.add_argument("--steps-only", action="store_true", help="only the env-step arms")
    ap.add_argument("--check", action="store_true", help="exit 1 unless the env-step (or load) arms saw the same")
    ap.add_argument("--loads-only", action="store_true", help="only the first load of each held-out game, two arms")
    ap.add_argument("--cold-loads", type=int, default=None, metavar="N",
                    help="only the first load of N held-out games with nothing on disk (0: all 274), two arms")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each load arm (alternated)")
    ap.add_argument("--arms", default=",".join(STEP_ARMS),
                    help=f"env-step arms, comma-separated, the default's last ({','.join(STEP_ARMS)})")
    a = ap.parse_args()
    arms = [x for x in a.arms.split(",") if x]
    if not arms or arms[-1] != "cheap" or any(x not in STEP_ARMS for x in arms):
        ap.error(f"--arms: some of {', '.join(STEP_ARMS)}, comma-separated, ending with cheap")
    if a.loads_only or a.cold_loads is not None:
        load_arms(a.repeats, a.check, a.cold_loads)
        return
    if a.steps_only:
        step_arms(a.step_games, a.walk, a.check, arms)
        return
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; G={a.group_size}, "
          f"{a.games} valid_seen games (first env of each game pays the translation; the rest reuse it)")
    import tempfile

    with tempfile.TemporaryDirectory() as root:  # the same empty root for the cached arm, then the on-disk one
        rows = {name: arm(a.group_size, a.games, cached, root)
                for name, cached in (("uncached", False), ("cached", True), ("on-disk", True))}
    print(f"{'game':<60} {'arm':<9} {'1 reset':>8} {'G resets':>9} {'G/1':>6} {'step':>7}")
    for name, rs in rows.items():
        for r in rs:
            print(f"{r['game'][:60]:<60} {name:<9} {r['one_reset_s']:8.2f} {r['group_reset_s']:9.2f} "
                  f"{r['group_reset_s'] / r['one_reset_s']:6.2f} {1000 * r['step_s']:6.0f}ms")
    u, c, d = (sum(r["group_reset_s"] for r in rows[k]) for k in ("uncached", "cached", "on-disk"))
    ratio = sum(r["group_reset_s"] / r["one_reset_s"] for r in rows["cached"]) / len(rows["cached"])
    print(f"group reset, G={a.group_size}: cached {c:.2f}s vs uncached {u:.2f}s over {a.games} games: "
          f"{u / c:.1f}x faster; cached G resets = {ratio:.2f}x one reset (target <= 1.5x)")
    one_c, one_d = (sum(r["one_reset_s"] for r in rows[k]) for k in ("cached", "on-disk"))
    print(f"a game's first load and reset: translation on disk {one_d:.2f}s vs translated {one_c:.2f}s over "
          f"{a.games} games: {one_c / one_d:.1f}x faster; G resets {d:.2f}s vs {c:.2f}s")

    from agentrl.env.data import discover_games

    games = discover_games("valid_seen", None, limit=a.games * 2)
    local, n = steps_per_second(games, 4, 0)
    pooled, _ = steps_per_second(games, 4, a.workers)
    print(f"env steps per second, {len(games)} games x G=4 ({n} steps of walkthroughs): one process {local:.1f}/s, "
          f"pool of {a.workers} workers {pooled:.1f}/s: {pooled / local:.2f}x")
    step_arms(a.step_games, a.walk, a.check, arms)


if __name__ == "__main__":
    main()
