"""Iteration 0's held-out evals: the base model's (`train.eval_base`, beside a warm start) and
the weights served as version 0 (the warm start, else the base model).

Each is a pure function of the weights, the model, the prompt, the games, T_max and the sampler's
settings (greedy), so it need not run twice:
- a resumed run that failed before its first checkpoint keeps the iteration-0 evals it recorded in
  metrics.jsonl (their `eval_key` names what they measured) instead of running them again;
- with `train.eval_cache` an eval is also kept under `<cache>/evals/<eval_key>.json`, and a later run
  of the same weights on the same games (a second `make train` from the cached warm start) reads it:
  the row says `"cached": true`, and its seconds are not counted again in the run's wall-clock.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from agentrl.config import Config
from agentrl.env.replay import engine_versions
from agentrl.io import atomic_write_text
from agentrl.models import cache_root, resolve_model, resolved_dtype
from agentrl.prompt import default_prompt_dir
from agentrl.weights import WeightsRef

EVALS_DIRNAME = "evals"  # under the cache root, beside warmstart/ and replay/
EVAL_KEY_VERSION = 2  # bump when what an eval row holds, or how an eval runs, changes (2: rows_together)
KINDS = ("base_eval", "eval")  # the metrics rows of iteration 0: the base model's, then version 0's


def _files_digest(h, paths) -> None:
    for p in paths:
        p = Path(p)
        h.update(p.name.encode() + (p.read_bytes() if p.is_file() else b"-"))


def weights_id(adapter: str | None) -> str:
    """What a sampler serves at version 0: "base" (the model alone) or the adapter's bytes."""
    if not adapter:
        return "base"
    h = hashlib.sha256()
    files = ["adapter_config.json", "adapter_model.safetensors"]
    if not (Path(adapter) / files[0]).is_file():  # full fine-tuning's weights (learner.lora_r 0): every weight's bytes
        files = ["config.json", "model.safetensors", "model.safetensors.index.json"]
    _files_digest(h, [Path(adapter) / f for f in files])
    return f"adapter-{h.hexdigest()[:20]}"


def model_id(name: str) -> list:
    """The model by name, where it resolves to, its config and its weight files' sizes and times."""
    where = Path(resolve_model(name))
    if not where.is_dir():
        return [name, str(where)]
    weights = sorted(where.glob("*.safetensors"))
    return [name, str(where), hashlib.sha256((where / "config.json").read_bytes()).hexdigest(),
            [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights]]


def eval_key(cfg: Config, games, weights: str) -> str:
    """Changes with anything that may change a greedy held-out eval's outcome."""
    import torch

    h = hashlib.sha256(json.dumps([
        EVAL_KEY_VERSION, weights, model_id(cfg.model.name), resolved_dtype(cfg.model.dtype, cfg.model.device), cfg.model.device,
        dataclasses.asdict(cfg.prompt), dataclasses.asdict(cfg.sampling), cfg.env.kind, cfg.env.fuzzy_threshold,
        cfg.train.eval_split, cfg.t_max("train_eval"), [g.game_id for g in games], engine_versions(), torch.__version__,
    ], default=str).encode())
    prompt_dir = Path(cfg.prompt.dir) if cfg.prompt.dir else default_prompt_dir()
    _files_digest(h, sorted(p for p in prompt_dir.rglob("*") if p.is_file()))
    _files_digest(h, [g.path for g in games if g.path is not None])
    return f"v{EVAL_KEY_VERSION}-{h.hexdigest()[:32]}"


class EvalCache:
    """Eval rows under `root`, one JSON file per key, written atomically."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def get(self, key: str) -> dict | None:
        try:
            obj = json.loads((self.root / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None  # absent or damaged: the eval runs (and rewrites it)
        ok = isinstance(obj, dict) and obj.get("key") == key and isinstance(obj.get("row"), dict)
        return obj["row"] if ok and "outcomes" in obj["row"] else None

    def put(self, key: str, row: dict) -> None:
        atomic_write_text(self.root / f"{key}.json", json.dumps({"key": key, "row": row}) + "\n")


def planned(cfg: Config, games) -> list[tuple[str, str]]:
    """(row kind, weights id) of iteration 0's evals, in their order."""
    if not games:
        return []
    init = cfg.train.init_adapter
    return ([("base_eval", "base")] if init and cfg.train.eval_base else []) + [("eval", weights_id(init))]


def on_record(cfg: Config, games) -> dict[str, str]:
    """{row kind: eval key} of the iteration-0 evals a resumed run may keep from its metrics.jsonl."""
    return {kind: eval_key(cfg, games, weights) for kind, weights in planned(cfg, games)}


def keeps(recorded: dict[str, str]):
    """metrics.jsonl's rows that a resume without a checkpoint keeps: iteration 0's evals of these keys."""
    return lambda row: (row.get("iteration") == 0 and recorded.get(row.get("kind")) is not None
                        and row.get("eval_key") == recorded.get(row.get("kind")))


def iteration0(cfg: Config, generator, games, metrics, hooks, evaluate, kept: list[dict]) -> tuple[dict, float]:
    """Run (or take from the record, or the cache) iteration 0's evals, loading the warm start as
    version 0 after the base model's; append the new rows. Returns (version 0's row, seconds spent,
    recorded ones included: they are the run's time)."""
    by_kind = {r["kind"]: r for r in kept}
    cache = EvalCache(cache_root() / EVALS_DIRNAME) if cfg.train.eval_cache else None
    row, spent, plan = {}, 0.0, planned(cfg, games)
    if not plan and cfg.train.init_adapter:
        generator.load(WeightsRef.of(cfg.train.init_adapter, 0))  # a LoRA adapter or full weights
    for kind, weights in plan:
        if kind == "eval" and cfg.train.init_adapter:  # the base model's eval is over: serve the warm start
            generator.load(WeightsRef.of(cfg.train.init_adapter, 0))  # a LoRA adapter or full weights
        key = eval_key(cfg, games, weights)
        row = by_kind.get(kind)
        if row is None:
            row = cache.get(key) if cache is not None else None
            if row is not None:
                row = row | {"kind": kind, "iteration": 0, "adapter_version": 0, "cached": True}
            else:
                hooks.phase(kind, cfg.t_max("train_eval"))
                row = evaluate(cfg, generator, games, 0, 0, hooks.step) | {"kind": kind, "weights": weights, "eval_key": key}
                spent += row["eval_s"]
                if cache is not None:
                    cache.put(key, row)
            metrics.append(row)
        elif not row.get("cached"):
            spent += row["eval_s"]
        hooks.done(row)
    return row, spent
