"""Atomic file writes: a reader never sees a half-written file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def atomic_write_jsonl(path: str | os.PathLike, rows) -> None:
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def read_tree(root: str | os.PathLike) -> dict[str, bytes]:
    """Every file under `root` as {relative path: bytes} (an adapter or a learner state, to move
    between machines through Ray's object store)."""
    root = Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def write_tree(files: dict[str, bytes], root: str | os.PathLike) -> Path:
    """Write what `read_tree` read under `root` (created); return root."""
    root = Path(root)
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root
