"""The hf sampler's decode loop with the captured step (CUDA graphs) and without it, side by side on
the training-shaped lockstep step (a script, not a test; issue 47's targets: <= 0.15 s per step of
128 rows x ~2k-token contexts x 30 new tokens, the GPU busy >= 60% of the decode loop).

For each mode (graphs: `sampling.static_decode` on; eager: the eager token loop) on one sampler and
the same shapes: `agentrl doctor --gpu`'s lockstep section (seconds per step, ms per token step,
the memory-bound floor beside it, graphs captured), then one more step under torch.profiler:
GPU busy = the time kernels ran (merged intervals of every device kernel) / the step's wall time.
Prints one JSON object; --out writes it too.

Usage: python benchmarks/bench_decode.py [--rows 128 --context 2048 --new 30 --steps 4]
           [--device auto|cuda|cpu] [--attention-backend auto|cudnn|efficient|math|flash] [--quick] [--out FILE]
(--quick: 4 rows x 256 tokens, for a CPU smoke run; the default model must be prepared.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path


def gpu_busy(prof, wall_s: float) -> float | None:
    """Merged kernel intervals over the wall time (None without device events)."""
    from agentrl.gpucheck import kernel_seconds

    busy = kernel_seconds(prof)
    return None if busy is None else round(busy / wall_s, 3)


def profiled(sampler, tokenizer, shape) -> dict:
    """Two lockstep steps again, the last one under torch.profiler: its wall time and GPU busy."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from agentrl.gpucheck import _lockstep

    record: dict = {}

    @contextlib.contextmanager
    def last_step():
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])) as prof:
            t0 = time.perf_counter()
            yield
            record["wall"] = time.perf_counter() - t0  # the step syncs the device before it returns
        record["prof"] = prof

    _lockstep(sampler, tokenizer, {"shape": tuple(shape[:3]) + (2,)}, last_step=last_step)
    return {"profiled_step_s": round(record["wall"], 3), "gpu_busy": gpu_busy(record["prof"], record["wall"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new", type=int, default=30)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention-backend", default="auto", help="sampling.attention_backend: SDPA's kernel (auto: its own choice)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import torch

    from agentrl.gpucheck import _lockstep_graphs_on_off
    from agentrl.models import load_model
    from agentrl.sampling.hf import HFSampler

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    shape = (4, 256, 8, 2) if args.quick else (args.rows, args.context, args.new, args.steps)
    model, tokenizer = load_model("default", "auto", device)
    sampler = HFSampler(model, tokenizer, batch_size=shape[0], static_decode="on", attention_backend=args.attention_backend)
    report = {"device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "attention_backend": args.attention_backend,
              "shape": shape, "date": time.strftime("%Y-%m-%d %H:%M")}
    report["lockstep"] = _lockstep_graphs_on_off(sampler, tokenizer, {"shape": shape})
    static = sampler.static
    for name, decoder in (("graphs", static), ("eager", None)):
        sampler.static = decoder
        report[f"profile_{name}"] = profiled(sampler, tokenizer, shape)
    sampler.static = static
    eager, graphs = report["lockstep"]["by_decode"]["eager"], report["lockstep"]["by_decode"]["graphs"]
    report["speedup_graphs_over_eager"] = round(eager["s_per_step"] / graphs["s_per_step"], 2)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
