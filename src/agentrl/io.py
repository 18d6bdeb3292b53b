"""Atomic file writes (a reader never sees a half-written file or directory), and the one JSONL reader."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from agentrl.errors import UserError


def cache_root() -> Path:
    """Where agentrl keeps what it builds once: $AGENTRL_CACHE, else ~/.cache/agentrl."""
    return Path(os.environ.get("AGENTRL_CACHE") or "~/.cache/agentrl").expanduser()


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


@contextmanager
def atomic_path(final: str | os.PathLike, directory: bool = True, suffix: str = "") -> Iterator[Path]:
    """Write `final` (a directory, or a file with `directory=False`) atomically: yield a fresh
    temporary sibling (`.NAME-...`, which `checkpoint.clean_partial` removes after a kill) to fill;
    when the block ends it is renamed onto `final` (replacing what was there), and if the block
    raises it is removed and `final` is untouched. `suffix`: the temporary file's (a format some
    writers read from the name, e.g. `.png`)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    else:
        fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=suffix)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        if directory and final.exists():  # a previous attempt at the same name (never a half-written one)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True) if directory else tmp.unlink(missing_ok=True)
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


def read_jsonl_numbered(path: str | os.PathLike, bad: str = "not a JSON line",
                        on_skip: Callable[[str], None] | None = None) -> list[tuple[int, Any]]:
    """The JSON values of a JSONL file with their line numbers (1-based); blank lines are skipped.

    The torn-line rule, the same for every reader: a last line that does not parse and has no
    closing newline is a write cut short (a crash or a full disk mid-append: the newline is the
    last byte written) and is dropped; any other line that does not parse is damage, a UserError
    naming file and line (`{path}:{n}: {bad}`). `on_skip`, when given, hears of each line dropped
    and makes damage a skipped line too ("{path}: torn last line skipped" for the last line,
    "{path}: unparsable line {n} skipped" elsewhere): a reader that reports what it can."""
    path = Path(path)
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
    torn = last if last == len(lines) and not text.endswith("\n") else None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line)))
        except json.JSONDecodeError:
            if n != torn and on_skip is None:
                raise UserError(f"{path}:{n}: {bad}") from None
            if on_skip is not None:
                on_skip(f"{path}: {'torn last line' if n == last else f'unparsable line {n}'} skipped")
    return rows


def read_jsonl(path: str | os.PathLike, bad: str = "not a JSON line",
               on_skip: Callable[[str], None] | None = None) -> list:
    """The JSON values of a JSONL file, under read_jsonl_numbered's torn-line rule."""
    return [value for _, value in read_jsonl_numbered(path, bad, on_skip)]


def file_sha256(path) -> str:
    """A file's sha256, as `sha256sum` prints it (read in chunks: weights run to gigabytes)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
