"""Files written whole: another process, or a run resumed after a crash, never reads half of one."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """`write(partial)` fills a file beside `path`, which is then renamed onto `path` (a rename
    within a directory is atomic); a failed write leaves `path` as it was and no partial file."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    """`text` at `path`, written whole."""
    write_whole(path, lambda partial: partial.write_text(text))


def write_json(path: Path, data: object, indent: int | None = 1) -> None:
    """`data` as JSON at `path`, written whole."""
    write_text(path, json.dumps(data, indent=indent))
