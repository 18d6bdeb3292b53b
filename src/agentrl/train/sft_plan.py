"""What a warm start is and where it goes, decided before torch loads: the games it learns from,
its recipe (what `--reuse` and a resumed run compare), its output and checkpoint directories,
`--from`'s files. `agentrl sft` answers bad input from here in a fraction of a second; `sft.py`
(torch) builds the data and trains."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from agentrl.config import ADAPTER_RECORD, Config
from agentrl.env import find_games
from agentrl.env.data import round_robin, spread
from agentrl.errors import UserError
from agentrl.models import resolved_dtype

DATASET_VERSION = 1  # bump when the way examples are built changes (invalidates caches)


def select_games(cfg: Config, split: str, n: int | None):
    games = find_games(cfg.env.kind, split, cfg.data.root)
    chosen = round_robin(spread(games, cfg.sft.spread), n)
    if not chosen:
        raise UserError(f"no {split} games to learn from (data: {cfg.data.root or '$ALFWORLD_DATA'}); "
                        "check the path, or run `agentrl data check`")
    return chosen


def check_out_dir(out: Path, force: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise UserError(f"{out} already exists; choose another --out or overwrite it with --force")


def sft_prompt(cfg: Config) -> Config:
    """The prompt a warm start is taught with: replies `Action: <cmd>`, no in-context example
    (unless the config says otherwise)."""
    cfg.prompt.reply = cfg.prompt.reply or "action"
    cfg.prompt.example = cfg.prompt.example or "none"
    if cfg.prompt.reply != "action":
        raise UserError("agentrl sft teaches `Action: <command>` replies (walkthroughs carry no thoughts): "
                        "use prompt.reply action")
    return cfg


def recipe(cfg: Config, sources: list[dict] | None = None, relabel: list[str] | None = None) -> dict:
    """Everything that decides what a warm start is (not where or how fast it is built); `sources`:
    `--from`'s files and their digests (the data in place of the walkthroughs); `relabel`: the
    digests of `--relabel`'s files (DAgger: their labelled states added to the walkthroughs)."""
    lc = cfg.learner
    return comparable({"model": cfg.model.name, "data": str(cfg.data.root or ""), "seed": cfg.seed, "env": cfg.env.kind,
            "prompt": {"example": cfg.prompt.example, "reply": cfg.prompt.reply, "dir": cfg.prompt.dir,
                       **({"admissible": True} if cfg.prompt.admissible else {}),
                       **({"history": cfg.prompt.history} if cfg.prompt.history else {})},
            "lora": {"r": lc.lora_r, "alpha": lc.lora_alpha, "dropout": lc.lora_dropout,
                     "target_modules": list(lc.target_modules), "weight_decay": lc.weight_decay},
            "sft": {k: v for k, v in asdict(cfg.sft).items() if k not in NOT_RECIPE},
            # the teacher only where it is not the walkthrough: warm starts built before the option keep their recipe
            **({"expert": {"name": cfg.sft.expert, "max_steps": cfg.sft.expert_max_steps}}
               if cfg.sft.expert != "walkthrough" else {}),
            **({"decoys": cfg.sft.decoys} if cfg.sft.decoys else {}),  # named only where used, as the teacher
            # the base weights' precision where it is not fp32 (bf16-if-native resolves per machine; full
            # fine-tuning trains fp32 master weights); fp32 warm starts built before the setting keep their recipe
            **({"dtype": dtype} if lc.lora_r and (dtype := resolved_dtype(cfg.model.dtype, cfg.model.device)) != "float32"
               else {}),
            "dataset_version": DATASET_VERSION,
            **({"from": [d["sha256"] for d in sources]} if sources else {}),
            # the walkthroughs beside them, named only where used: earlier RFT warm starts keep their recipe
            **({"from_walkthroughs": cfg.sft.from_walkthroughs} if sources and cfg.sft.from_walkthroughs else {}),
            # DAgger's data and where training begins, named only where used: earlier warm starts keep their recipe
            **({"relabel": {"files": relabel, "states": cfg.sft.relabel_states, "from": cfg.sft.relabel_from}}
               if relabel else {}),
            **({"init_adapter": adapter_digest(cfg.sft.init_adapter)} if cfg.sft.init_adapter else {})})


LORA_ONLY = ("alpha", "dropout", "target_modules")  # what full fine-tuning (r 0) does not use


def comparable(recipe_: dict | None) -> dict | None:
    """A recipe as it decides the warm start: under full fine-tuning (LoRA r 0) without the
    LoRA-only settings it never reads. Records written before they were dropped keep them, so
    `reusable` and `resumable` compare through this."""
    lora = recipe_.get("lora") if isinstance(recipe_, dict) else None
    if not isinstance(lora, dict) or lora.get("r") != 0:
        return recipe_
    return {**recipe_, "lora": {k: v for k, v in lora.items() if k not in LORA_ONLY}}


def reusable(cfg: Config, out: Path, sources: list[Path] | None = None, relabel: list[Path] | None = None) -> dict | None:
    """The record of the warm start in `out` if it was built with this very recipe (and, for
    `--from` and `--relabel`, from files with the same contents), else None."""
    f = out / ADAPTER_RECORD
    try:
        record = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    if cfg.learner.lora_r:
        done = (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    else:  # full fine-tuning's model directory
        done = (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    return record if done and comparable(record.get("recipe")) == recipe(sft_prompt(cfg), source_digests(sources),
                                                                                       relabel_digests(relabel)) else None


def relabel_digests(paths: list[Path] | None) -> list[str] | None:
    """`--relabel`'s files as the recipe names them (their contents' digests); None without it."""
    return [d["sha256"] for d in source_digests(paths)] if paths else None


def check_init_adapter(cfg: Config) -> None:
    """`--init-adapter`: a LoRA adapter (or full weights) of this model, taught with the prompt sft
    teaches (the rolled-out policy's prompt is what the relabelled contexts hold)."""
    from agentrl.config import adapter_record, effective_prompt
    from agentrl.models import check_full_weights, check_lora_adapter
    from agentrl.weights import refuse_full_init, weights_kind

    init = cfg.sft.init_adapter
    if not init:
        return
    if not Path(init).is_dir():
        raise UserError(f"--init-adapter {init}: no such directory")
    if weights_kind(init) == "full":
        refuse_full_init(cfg.learner.lora_r, init)
        check_full_weights(init, cfg.model.name, cfg.model.trust_remote_code)
    else:
        check_lora_adapter(init, cfg.model.name, cfg.model.trust_remote_code)
    trained, taught = (adapter_record(init) or {}).get("prompt"), effective_prompt(sft_prompt(cfg))
    if trained is not None and {k: trained.get(k) for k in taught} != taught:
        raise UserError(f"--init-adapter {init} was trained with the prompt {trained}, and sft teaches {taught}: "
                        "continue it with its own prompt settings")


def adapter_digest(path: str) -> str:
    """What `--init-adapter` begins from, as the recipe names it: the digest of its weights files."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise UserError(f"--init-adapter {path}: no .safetensors weights there: give the directory `agentrl sft` or "
                        "`agentrl train` wrote")
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


def source_digests(sources: list[Path] | None) -> list[dict] | None:
    """`--from`'s files as the recipe names them (their contents' digests); None without --from."""
    return [{"sha256": hashlib.sha256(rollout_file(p).read_bytes()).hexdigest()} for p in sources] if sources else None


# sft settings that decide how a run is kept, not what it learns; and the teacher, named apart (recipe)
NOT_RECIPE = ("checkpoint_minutes", "expert", "expert_max_steps", "decoys", "relabel_states", "relabel_from",
              "init_adapter", "from_walkthroughs")


def partial_dir(out: Path) -> Path:
    """An unfinished warm start's checkpoints: a sibling of OUT, removed once OUT is written."""
    return out.with_name(out.name + ".partial")


def first_difference(was: dict, now: dict, where: str = "") -> str | None:
    """The first setting where two recipes differ, as `name was -> now` (None: the same)."""
    for key in sorted(set(was) | set(now)):
        a, b = was.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            if (found := first_difference(a, b, f"{where}{key}.")) is not None:
                return found
        elif a != b:
            return f"{where}{key} {a!r} -> {b!r}"
    return None


def rollout_file(path: Path) -> Path:
    """`path` itself, or the trajectories.jsonl inside a rollout directory; a one-line error if none."""
    path = Path(path)
    f = path / "trajectories.jsonl" if path.is_dir() else path
    if not f.is_file():
        raise UserError(f"--from {path}: no such file (expected trajectories.jsonl from `agentrl rollout --out DIR`, or DIR)")
    return f
