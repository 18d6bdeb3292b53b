"""Env work on this machine (a script, not a test).

1. Group resets: G envs of one ALFWorld game, with and without the game caches. Each arm runs
   in a fresh subprocess so none starts warm in memory; the uncached arm sets
   AGENTRL_NO_GAME_CACHE=1 (textworld's own behaviour); the cached arm starts from an empty
   cache root (the translation not yet on disk), the on-disk arm from the root it left (every
   game's translation kept there, as for a game any earlier process loaded).
2. Env steps per second: B x G envs stepping their walkthroughs in lockstep batches, in this
   process vs an EnvPool of N worker processes (same actions, same results).

Usage: python benchmarks/bench_env.py [--group-size 8] [--games 3] [--workers N]
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
    a = ap.parse_args()
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


if __name__ == "__main__":
    main()
