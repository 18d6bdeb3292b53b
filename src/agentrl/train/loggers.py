"""Experiment loggers beside metrics.jsonl (`--log-to tensorboard,wandb`, config `train.log_to`).

metrics.jsonl stays the source of truth (`agentrl report` reads it alone); each logger gets the
same rows as they are written: every numeric field as a scalar at step = the iteration, nested
ones by path (`stages/cut/decisions/groups_cut`, `success_by_task_type/heat`), eval rows under
`eval/`. The run's config goes in as hyperparameters. A resumed run continues the same
TensorBoard run (events past the checkpoint are purged) and the same W&B run id (kept in
RUN/wandb_run_id). Both are optional extras, imported only when asked for.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
from pathlib import Path

from agentrl.errors import UserError

LOGGERS = ("tensorboard", "wandb")


def parse_log_to(spec: str | None) -> list[str]:
    names = [n.strip().lower() for n in (spec or "").split(",") if n.strip() and n.strip().lower() not in ("none", "off")]
    for n in names:
        if n not in LOGGERS:
            raise UserError(f"unknown logger {n!r} in --log-to; choose from {', '.join(LOGGERS)}")
    return names


def scalars(row: dict) -> dict[str, float]:
    """The numeric fields of a metrics row, flattened by path; eval rows under eval/ (the base model's: base_eval/)."""
    prefix = {"eval": "eval/", "base_eval": "base_eval/"}.get(row.get("kind"), "")
    out: dict[str, float] = {}

    def walk(value, path: str) -> None:
        if isinstance(value, bool):
            out[prefix + path] = float(value)
        elif isinstance(value, (int, float)):
            if math.isfinite(value):
                out[prefix + path] = float(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}/{k}" if path else str(k))
        elif isinstance(value, list) and len(value) == 2 and path.endswith("ci95"):  # an interval: low, high
            walk({"low": value[0], "high": value[1]}, path)

    for key, value in row.items():
        if key not in ("kind", "iteration", "outcomes"):  # outcomes: one 0/1 per game, for pairing, not a curve
            walk(value, key)
    return out


class TensorBoard:
    def __init__(self, run: Path, config: dict, start_iteration: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("--log-to tensorboard needs tensorboard: pip install 'agentrl[tensorboard]'") from None
        # purge_step: a resumed run drops the events of iterations after its checkpoint (a fresh one, any)
        self.writer = SummaryWriter(str(run / "tensorboard"), purge_step=start_iteration)
        if not start_iteration:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, row: dict) -> None:
        for k, v in scalars(row).items():
            self.writer.add_scalar(k, v, row.get("iteration", 0))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, run: Path, config: dict, start_iteration: int):
        try:
            import wandb
        except ImportError:
            raise UserError("--log-to wandb needs wandb: pip install 'agentrl[wandb]'") from None
        id_file = run / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)  # W&B's id shape: 8 chars
        id_file.write_text(run_id + "\n")
        self.wandb = wandb
        self.run = wandb.init(project="agentrl", name=run.name, id=run_id, resume="allow", dir=str(run),
                              config=config, reinit="create_new")

    def log(self, row: dict) -> None:
        self.run.log(scalars(row), step=row.get("iteration", 0))

    def close(self) -> None:
        self.run.finish()


class Loggers:
    """The loggers a run asked for; `log(*rows)` after each metrics.jsonl append."""

    def __init__(self, spec: str | None, run: Path, cfg, start_iteration: int = 0):
        config = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg or {})
        kinds = {"tensorboard": TensorBoard, "wandb": WandB}
        self.loggers = [kinds[name](run, config, start_iteration) for name in parse_log_to(spec)]

    def log(self, *rows: dict) -> None:
        for logger in self.loggers:
            for row in rows:
                logger.log(row)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
        self.loggers = []
