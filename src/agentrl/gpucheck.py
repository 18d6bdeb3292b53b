"""`agentrl doctor --gpu`: what the GPU path does on this machine, measured, in one command.

Sections (each timed; one that fails is reported and the others still run):
- throughput: sampler tokens/s at batch 1, 8, 64, 256 (stop tokens off, so every row decodes
  the full length);
- lockstep: the training-shaped sampler step: 128 rows with ~2k-token contexts each continue by
  ~50 observation tokens and decode 30 new tokens (KV reused across steps), seconds per step and
  peak GPU memory, and beside the time per decoded token its floor: the bytes a decode step must
  read (every row's KV, every weight) over the GPU's memory bandwidth (`decode_floor`);
- rollout: the lockstep rollout on real train games, B x G = 10 x 8, seconds per step;
- learner: one update on that rollout (tokens/s and the sampler-learner log-prob gap on real
  trajectories), the swap (save + load, LoRA rank 16), then a rollout with the non-zero adapter
  and a second update (the gap users will see as `logprob_gap` after the first swap);
- train_synthetic: 3 iterations of `agentrl train` on the synthetic task, colocated;
- train_real: a short warm start (`agentrl sft`) and 2 iterations of GRPO from it on real games,
  colocated, with where each iteration's time goes (rollout, train, swap, eval);
- split: the same synthetic run with the learner on a second GPU (only where one exists);
- vllm: the vLLM sampler's throughput, swap and served-adapter check (only where vLLM imports).

Writes OUT/gpu_check.json and OUT/gpu_check.md. On a machine without CUDA it says so in one line
and stops, unless `allow_cpu` (a smoke run of the same code at tiny sizes)."""

from __future__ import annotations

import contextlib
import json
import platform
import time
import traceback
from pathlib import Path

from agentrl.config import load_config
from agentrl.env import find_games
from agentrl.io import read_jsonl
from agentrl.models import load_model
from agentrl.rollout.generator import Generator
from agentrl.sampling.base import GenRequest, SamplingParams
from agentrl.weights import WeightsRef


def _sizes(quick: bool) -> dict:
    if quick:
        return dict(batches=(1, 4), new_tokens=8, shape=(4, 256, 8, 2), tasks=2, group=2, steps=3, synth_iterations=1, sft_games=6,
                    real_iterations=1, real_tasks=2, real_group=2, eval_tasks=2, reply_tokens=16, micro_batch=1)
    return dict(batches=(1, 8, 64, 256), new_tokens=64, shape=(128, 2048, 30, 4), tasks=10, group=8, steps=10, synth_iterations=3, sft_games=60,
                real_iterations=2, real_tasks=8, real_group=8, eval_tasks=20, reply_tokens=96, micro_batch=4)


def run_gpu_check(out: Path, device: str = "cuda", quick: bool = False, log=print) -> dict:
    import torch

    from agentrl.sampling.hf import HFSampler  # torch: cli/tools.py imports gpucheck at load

    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": _device_name(device), "quick": quick,
                    "torch": torch.__version__, "host": platform.node(), "sections": {}}
    section = _section_runner(report, log)
    size = _sizes(quick)
    base_cfg = load_config(None, {"model.device": device, "env.max_steps": size["steps"], "rollout.gate": "off",
                                  "rollout.group_size": size["group"], "sampling.max_new_tokens": size["reply_tokens"],
                                  "learner.micro_batch": size["micro_batch"]})

    model, tokenizer = load_model("default", "auto", device)
    sampler = HFSampler(model, tokenizer, batch_size=max(size["batches"]))
    state: dict = {}

    section("throughput", lambda: _throughput(sampler, tokenizer, size))
    section("lockstep", lambda: _lockstep_graphs_on_off(sampler, tokenizer, size))
    section("rollout", lambda: _rollout(base_cfg, sampler, size, state))
    section("learner", lambda: _learner(base_cfg, sampler, size, state, out))
    section("train_synthetic", lambda: _train(out / "synthetic", device, None, size["synth_iterations"], synthetic=True))
    section("train_real", lambda: _train_real(out, device, size))
    if device.startswith("cuda") and torch.cuda.device_count() >= 2:
        section("split", lambda: _train(out / "split", "cuda:0", "cuda:1", size["synth_iterations"], synthetic=True))
    else:
        report["sections"]["split"] = {"ok": None, "skipped": "one GPU: the split layout needs two"}
    if _vllm_importable():
        section("vllm", lambda: _vllm(base_cfg, tokenizer, size, state))
    else:
        report["sections"]["vllm"] = {"ok": None, "skipped": "vLLM does not import here"}

    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    return report


def _section_runner(report: dict, log):
    """section(name, fn): run fn, record its result dict (or its error) under report["sections"]."""

    def section(name: str, fn) -> None:
        log(f"gpu check: {name} ...")
        t0 = time.perf_counter()
        try:
            result = fn()
            report["sections"][name] = {"ok": True, "wall_s": round(time.perf_counter() - t0, 2), **(result or {})}
        except Exception as e:  # noqa: BLE001 - reported, the other sections still run
            first = (str(e).strip().splitlines() or [""])[0]
            report["sections"][name] = {"ok": False, "wall_s": round(time.perf_counter() - t0, 2),
                                        "error": f"{e.__class__.__name__}: {first}", "trace": traceback.format_exc(limit=6)}
        log(f"gpu check: {name}: {_brief(report['sections'][name])}")

    return section


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return f"CPU ({platform.processor() or platform.machine()})"


def _vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or broken: skipped with a line
        return False
    return True


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _throughput(sampler, tokenizer, size) -> dict:
    prompt = tokenizer("You are in the middle of a room. Looking quickly around you, you see a cabinet 1.",
                       add_special_tokens=False).input_ids
    params = SamplingParams(temperature=1.0, max_new_tokens=size["new_tokens"])
    stops, sampler.stop_ids = sampler.stop_ids, set()  # every row decodes the full length
    try:
        sampler.generate([GenRequest(prompt, seed=0)], params)  # warm-up
        rows = {}
        for b in size["batches"]:
            _sync()
            t0 = time.perf_counter()
            out = sampler.generate([GenRequest(prompt, seed=i) for i in range(b)], params)
            _sync()
            dt = time.perf_counter() - t0
            rows[str(b)] = round(sum(len(c.token_ids) for c in out) / dt, 1)
    finally:
        sampler.stop_ids = stops
    return {"tokens_per_s_by_batch": rows, "new_tokens": size["new_tokens"]}


def _lockstep_graphs_on_off(sampler, tokenizer, size) -> dict:
    """The lockstep step with the captured decode step (sampling.static_decode; on CUDA by default)
    and with the eager token loop, side by side on the same sampler and shapes."""
    result = {}
    static = sampler.static
    try:
        for name, decoder in (("graphs", static), ("eager", None)):
            if name == "graphs" and decoder is None:
                continue
            sampler.static = decoder
            run = _lockstep(sampler, tokenizer, size)
            if decoder is not None:
                run["graphs_captured"] = decoder.captures
            result[name] = run
    finally:
        sampler.static = static
    main = result.get("graphs", result["eager"])
    return {**main, "by_decode": result}


def _lockstep(sampler, tokenizer, size, last_step=contextlib.nullcontext) -> dict:
    """The shape of a training step (not 25-token prompts): `rows` trajectories of ~`context` tokens
    each append an observation and decode `new` tokens, `steps` times, with their KV kept.
    `last_step()`: a context the last step runs in (a profiler: benchmarks/bench_decode.py)."""
    import torch

    rows, context, new, steps = size["shape"]
    text = ("You arrive at countertop 2. On the countertop 2, you see a butterknife 1, a cellphone 2, a mug 3, "
            "a peppershaker 1, and a spatula 2. ")
    unit = tokenizer(text, add_special_tokens=False).input_ids
    obs = tokenizer("You open the drawer 1. The drawer 1 is open. In it, you see a creditcard 2 and a pen 1.",
                    add_special_tokens=False).input_ids
    # distinct lengths, and distinct from the first token (each row's number first), as mid-rollout
    # contexts are: the engine runs a prefix that rows share once (sampling.share_prefixes)
    prompts = [(tokenizer(f"{r}: ", add_special_tokens=False).input_ids + unit * (context // len(unit) + 1))[: context - (r % 97)]
               for r in range(rows)]
    params = SamplingParams(temperature=1.0, max_new_tokens=new)
    keys = list(range(rows))
    stops, sampler.stop_ids = sampler.stop_ids, set()  # every row decodes the full length
    cuda = torch.cuda.is_available() and sampler.device.type == "cuda"
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        _sync()
        t0 = time.perf_counter()
        out = sampler.generate([GenRequest(p, seed=k, key=k) for p, k in zip(prompts, keys)], params)  # the first step prefills every context
        _sync()
        first = time.perf_counter() - t0
        times = []
        for step in range(steps):
            prompts = [p + c.token_ids + obs for p, c in zip(prompts, out)]
            _sync()
            with last_step() if step == steps - 1 else contextlib.nullcontext():
                t0 = time.perf_counter()
                out = sampler.generate([GenRequest(p, seed=step * rows + k, key=k) for p, k in zip(prompts, keys)], params)
                _sync()
                times.append(time.perf_counter() - t0)
    finally:
        sampler.stop_ids = stops
        sampler.release(keys)
    step = sum(times) / len(times)
    kv_read = sum(len(p) + new // 2 for p in prompts) * sampler.store.bytes_per_token  # a mid-reply decode step's contexts
    weights = sum(p.numel() * p.element_size() for p in sampler.model.parameters())
    return {"rows": rows, "context_tokens": context, "new_tokens": new, "first_step_s": round(first, 3),
            "s_per_step": round(step, 3), "tokens_per_s": round(rows * new / step, 1),
            "ms_per_token": round(step / new * 1e3, 3),  # the whole step (its prefill included) per decoded token
            **decode_floor(kv_read, weights, _device_name(str(sampler.device))),
            "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "kv_store_gb": round(sampler.store.peak_bytes / 2**30, 2)}


# memory bandwidth by device name (the vendors' datasheets, TB/s); the first row whose words all
# appear in torch's device name wins, so the specific rows come first
BANDWIDTH_TB_S = ((("H100", "PCIe"), 2.0), (("H100", "NVL"), 3.9), (("H100",), 3.35), (("H200",), 4.8),
                  (("A100", "80GB"), 2.0))


def kernel_seconds(prof) -> float | None:
    """The time a device ran kernels during a torch.profiler run: the union of its device events'
    intervals, overlaps counted once (a sum of per-event self device times can count a kernel
    twice). None without device events (a CPU run)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"))
    if not spans:
        return None
    busy, (start, end) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)
    return (busy + end - start) / 1e6  # the profiler's microseconds


def memory_bandwidth(device_name: str) -> float | None:
    """The device's memory bandwidth in bytes/s, from BANDWIDTH_TB_S (None: not in the table)."""
    for words, tb_s in BANDWIDTH_TB_S:
        if all(w.lower() in device_name.lower() for w in words):
            return tb_s * 1e12
    return None


def decode_floor(kv_bytes: int, weight_bytes: int, device_name: str) -> dict:
    """The least time one decode step can take on a memory-bound GPU: it reads every row's keys and
    values and every weight once, at the device's bandwidth. None where the bandwidth is unknown."""
    bandwidth = memory_bandwidth(device_name)
    floor = (kv_bytes + weight_bytes) / bandwidth if bandwidth else None
    return {"bandwidth_tb_s": bandwidth / 1e12 if bandwidth else None, "kv_read_gb": round(kv_bytes / 1e9, 6),
            "weights_gb": round(weight_bytes / 1e9, 6), "floor_ms_per_token": round(floor * 1e3, 4) if floor else None}


def _rollout(cfg, sampler, size, state) -> dict:
    games = find_games("alfworld", "train", cfg.data.root, limit=size["tasks"])
    with Generator(cfg, sampler) as generator:  # the env workers, shut down after; the sampler stays ours
        rollout = generator.generate(games, size["group"], seed=0)
    state["rollout"] = rollout
    s = rollout.stats
    steps = max(len(t.steps) for t in rollout.trajectories)
    return {"B": len(games), "G": size["group"], "T_max": size["steps"], "s_per_step": round(s.wall_s / max(1, steps), 3),
            "generate_s": round(s.generate_s, 2), "env_wait_s": round(s.env_s, 2), "step_tokens": s.step_tokens,
            "rollout_s": round(s.wall_s, 2)}


def _learner(cfg, sampler, size, state, out: Path) -> dict:
    from agentrl.train.remote import make_learner  # torch: cli/tools.py imports gpucheck at load

    rollout = state["rollout"]
    learner = make_learner(cfg)
    trajs = rollout.trajectories
    batch = [(t, 1.0 if i % 2 == 0 else -1.0) for i, t in enumerate(trajs)]  # every trajectory carries signal
    _sync()
    t0 = time.perf_counter()
    first = learner.update(batch)
    _sync()
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    weights = learner.save(out / "adapters")
    sampler.load(weights)
    _sync()
    swap_s = time.perf_counter() - t0
    state["adapter"] = weights.path
    sequence_tokens = sum(len(t.token_ids) for t in trajs)
    return {"step_tokens_trained": first.step_tokens_trained, "train_s": round(train_s, 2),
            "learner_sequence_tokens_per_s": round(sequence_tokens / train_s, 1),  # teacher-forced, whole trajectories
            "learner_action_tokens_per_s": round(first.step_tokens_trained / train_s, 1),
            "logprob_gap_base": first.logprob_gap, "swap_s_rank16": round(swap_s, 3), **_second_gap(learner, sampler, cfg, size)}


def _second_gap(learner, sampler, cfg, size) -> dict:
    """A rollout with the non-zero adapter, then an update: the gap after the first swap."""
    state: dict = {}
    _rollout(cfg, sampler, {**size, "tasks": max(1, size["tasks"] // 2)}, state)
    batch = [(t, 1.0 if i % 2 == 0 else -1.0) for i, t in enumerate(state["rollout"].trajectories)]
    stats = learner.update(batch)
    return {"logprob_gap_adapter": stats.logprob_gap}


def _train(run: Path, device: str, learner_device: str | None, iterations: int, synthetic: bool) -> dict:
    from agentrl.train.loop import train  # torch
    from agentrl.train.prerun import prepare_run, start_run

    overrides = {"model.device": device, "learner.device": learner_device, "train.iterations": iterations,
                 "train.eval_every": iterations}
    cfg = load_config("configs/synthetic.yaml" if synthetic and Path("configs/synthetic.yaml").is_file() else None,
                      ({"env.kind": "synthetic"} if synthetic else {}) | overrides)
    cfg = prepare_run(run, cfg, resume=False, force=True)
    start_run(run, cfg, force=True)
    t0 = time.perf_counter()
    train(cfg, run)
    return _run_summary(run, time.perf_counter() - t0)


def _train_real(out: Path, device: str, size) -> dict:
    from agentrl.train.loop import train  # torch
    from agentrl.train.prerun import prepare_run, start_run
    from agentrl.train.sft import run_sft

    ws = out / "warmstart"
    cfg = load_config("configs/default.yaml" if Path("configs/default.yaml").is_file() else None,
                      {"model.device": device, "sft.games": size["sft_games"], "sft.heldout_games": 2})
    t0 = time.perf_counter()
    run_sft(cfg, ws, force=True)
    sft_s = time.perf_counter() - t0
    cfg = load_config("configs/default.yaml" if Path("configs/default.yaml").is_file() else None, {
        "model.device": device, "train.init_adapter": str(ws), "train.iterations": size["real_iterations"],
        "train.eval_every": size["real_iterations"], "rollout.tasks": size["real_tasks"],
        "rollout.group_size": size["real_group"], "train.eval_tasks": size["eval_tasks"]})
    run = out / "real"
    cfg = prepare_run(run, cfg, resume=False, force=True)
    start_run(run, cfg, force=True)
    t0 = time.perf_counter()
    train(cfg, run)
    return {"sft_s": round(sft_s, 1), **_run_summary(run, time.perf_counter() - t0)}


def _run_summary(run: Path, wall: float) -> dict:
    rows = read_jsonl(run / "metrics.jsonl")
    its = [r for r in rows if r.get("kind") == "iteration"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    last = its[-1] if its else {}
    timing = {k: round(sum(r.get(k, 0) or 0 for r in its) / max(1, len(its)), 2)
              for k in ("rollout_s", "train_s", "swap_s", "eval_s", "iteration_s")}
    return {"wall_s": round(wall, 1), "iterations": len(its), "mean_per_iteration": timing,
            "step_tokens_trained": sum(r.get("step_tokens_trained", 0) for r in its),
            "adapter_version": last.get("adapter_version"), "logprob_gap_last": last.get("logprob_gap"),
            "eval_success": [round(r.get("success_rate", 0), 3) for r in evals]}


def _vllm(cfg, tokenizer, size, state) -> dict:
    from agentrl.sampling.vllm import VLLMSampler  # vllm: optional

    sampler = VLLMSampler.from_config(cfg, colocated=True)  # the hf model and the learner are still resident
    result = _throughput(sampler, tokenizer, size)
    if "adapter" in state:  # the learner's non-zero adapter: listed by the engine and changing log-probs, or an error
        t0 = time.perf_counter()
        sampler.load(WeightsRef(state["adapter"], 1))
        result["swap_s"] = round(time.perf_counter() - t0, 3)
        result["adapter_served"] = sampler.effect_checked
    return result


def _brief(s: dict) -> str:
    if s.get("ok") is None:
        return f"skipped ({s['skipped']})"
    if not s["ok"]:
        return f"FAILED after {s['wall_s']} s: {s['error']}"
    return f"ok in {s['wall_s']} s"


def markdown(report: dict) -> str:
    lines = [f"# agentrl GPU check ({report['date']}, {report['device']}, torch {report['torch']}"
             + (", quick sizes" if report["quick"] else "") + ")", "", "| section | result |", "|---|---|"]
    for name, s in report["sections"].items():
        if s.get("ok") is None:
            lines.append(f"| {name} | skipped: {s['skipped']} |")
        elif not s["ok"]:
            lines.append(f"| {name} | **failed** after {s['wall_s']} s: {s['error']} |")
        else:
            body = ", ".join(f"{k} {json.dumps(v)}" for k, v in s.items() if k not in ("ok", "trace"))
            lines.append(f"| {name} | {body} |")
    return "\n".join(lines) + "\n"
