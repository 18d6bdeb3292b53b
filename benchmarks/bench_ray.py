"""The price of Ray per env step, and how many env cores keep a sampler GPU busy (a script, not a test).

Measured side by side in one run, on real ALFWorld games replayed by their walkthroughs (so the
numbers are env work and its transport, no model):
1. env steps/s of the same lockstep rollout with the envs in this process, in the local
   `EnvPool` (worker processes) and in `RayEnvPool` (Ray actors on `--ray-address local`);
2. the scheduling overhead per request: an empty batch's round trip to a pool worker vs to a
   Ray actor;
3. a projection, on paper: from the measured per-env step cost, the env cores that keep one
   sampler GPU busy for a few assumed generate times per lockstep step.

Usage: python benchmarks/bench_ray.py [--games 8] [-G 4] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores"


def timed_rollout(games, G: int, envs):
    from agentrl.rollout import WalkthroughPolicy, run_lockstep

    t0 = time.perf_counter()
    rollout = run_lockstep(games, WalkthroughPolicy(), max_steps=50, group_size=G, envs=envs)
    wall = time.perf_counter() - t0
    assert all(t.won for t in rollout.trajectories), "a walkthrough lost: the env is broken"
    return wall, rollout.stats.env_steps


def ping_round_trip_us(pool, n: int = 200) -> float:
    """One empty request to every worker and back (what a lockstep step pays at least once)."""
    from agentrl.env.pool import Pending

    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        if hasattr(pool, "actors"):
            import ray

            ray.get([a.run.remote("ping", []) for a in pool.actors])
        else:
            pings = []
            for w, (_, conn) in enumerate(pool._workers):
                conn.send(("ping", []))
                p = Pending("ping", [], shares={w: []}, waiting={w})
                pool._queue[w].append(p)
                pings.append(p)
            for p in pings:
                pool.collect(p)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--games", type=int, default=8)
    ap.add_argument("-G", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    from agentrl import cluster
    from agentrl.env import find_games
    from agentrl.env.pool import EnvPool
    from agentrl.env.ray_pool import RayEnvPool

    games = find_games("alfworld", "valid_seen", limit=args.games)
    rows = {}
    wall, steps = timed_rollout(games, args.G, None)
    rows["in-process"] = (wall, steps)
    with EnvPool(args.workers, overlap=False) as pool:
        pool.ready()
        rows[f"EnvPool ({args.workers} processes)"] = timed_rollout(games, args.G, pool)
        pool_rt = ping_round_trip_us(pool)
    cluster.connect("local", local_cpus=max(args.workers, cluster.available_cores()))
    with RayEnvPool(args.workers, overlap=False) as pool:
        pool.ready()
        rows[f"RayEnvPool ({args.workers} actors)"] = timed_rollout(games, args.G, pool)
        ray_rt = ping_round_trip_us(pool)

    base = rows["in-process"][1] / rows["in-process"][0]
    print(f"# bench_ray ({time.strftime('%Y-%m-%d')}, {machine()})\n")
    print(f"{args.games} valid_seen games x G={args.G}, walkthrough replay, one lockstep rollout per row\n")
    print("| envs | wall s | env steps | steps/s | vs in-process |")
    print("|---|---|---|---|---|")
    for name, (wall, steps) in rows.items():
        print(f"| {name} | {wall:.1f} | {steps} | {steps / wall:.1f} | {steps / wall / base:.2f}x |")
    print(f"\nempty request to every worker and back (median of 200): EnvPool {pool_rt:.0f} us, "
          f"Ray actors {ray_rt:.0f} us ({ray_rt / pool_rt:.1f}x)")

    wall, steps = rows["in-process"]
    per_step = wall / steps  # seconds of one env step (resets included), one core
    print(f"\nprojection (on paper, not measured on a GPU): one env step costs {1000 * per_step:.1f} ms of one core "
          f"(in-process, resets included). A sampler GPU that generates one lockstep step for N envs in t seconds "
          f"keeps busy when the envs' cores C satisfy N x {1000 * per_step:.1f} ms / C <= t:\n")
    print("| envs per GPU (N) | generate time per step t | env cores per GPU |")
    print("|---|---|---|")
    for n, t in ((128, 1.0), (128, 0.5), (512, 1.0), (512, 0.5)):
        print(f"| {n} | {t:.1f} s | {n * per_step / t:.1f} |")


if __name__ == "__main__":
    main()
