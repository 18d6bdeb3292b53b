"""The Ray cluster a run uses (`--ray-address local|auto|HOST:PORT`, config `cluster.ray_address`).

Nothing here imports Ray until a run asks for it: one machine stays plain processes. `local`
starts a Ray instance on this machine; `auto` joins the cluster this machine belongs to (`ray
start --head` / `ray start --address` made it); `HOST:PORT` joins the cluster whose head is there.
Every node must have agentrl installed and the game files at the same path ($ALFWORLD_DATA).
"""

from __future__ import annotations

import logging
import socket

from agentrl.errors import UserError
from agentrl.specs import HOST_PORT, check_ray_address

def connect(address: str, local_cpus: int | None = None) -> None:
    """Start or join the Ray cluster (once per process); a one-line UserError when there is none.
    `local` offers `local_cpus` CPU slots (default: Ray's count of this machine's cores)."""
    check_ray_address(address)
    try:
        import ray
    except ImportError:
        raise UserError("--ray-address needs Ray: pip install 'agentrl[ray]'") from None
    if ray.is_initialized():
        return
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address == "local":
        ray.init(address="local", include_dashboard=False, num_cpus=local_cpus, **quiet)  # always a new instance
        return
    m = HOST_PORT.match(address)
    if m:  # refuse at once instead of Ray's long retries when nobody listens there
        try:
            socket.create_connection((m["host"], int(m["port"])), timeout=3).close()
        except OSError as e:
            raise UserError(f"no Ray cluster at {address}: {e.strerror or e}") from None
    try:
        ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise UserError(f"no Ray cluster at {address}: {first}") from None


def connect_for(cfg) -> None:
    """Connect for a run: a local instance offers this machine's cores, and at least a slot for
    every actor the run holds besides one env actor."""
    connect(cfg.cluster.ray_address, local_cpus=max(available_cores(), reserved_cpus(cfg) + 1))


def available_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's count)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resources() -> dict[str, float]:
    import ray

    return ray.cluster_resources()


def reserved_cpus(cfg) -> int:
    """CPU slots the run's other actors hold: one per sampler replica (when there is more than
    one; a single sampler runs in the driver) and one for the learner of `agentrl train`."""
    return (cfg.sampling.replicas if cfg.sampling.replicas > 1 else 0) + 1


def env_actors(cfg) -> int:
    """`env.workers` on a cluster: auto = the cluster's CPUs minus the reserved ones (at least 1;
    none for the synthetic task, whose env work is a string comparison); N = N; 0 = in-process."""
    if cfg.env.workers != "auto":
        return int(cfg.env.workers)
    if cfg.env.kind != "alfworld":
        return 0
    return max(1, int(resources().get("CPU", 1)) - reserved_cpus(cfg))
