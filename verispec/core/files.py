"""Files written whole: another process, or a run resumed after a crash, never reads half of one;
and a lock file for work one process does at a time."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def held(lock: Path, waiting: str | None = None) -> Iterator[None]:
    """An exclusive `flock` on the file `lock` (created with its folder), held for the block and
    released however the process ends; `waiting`, where given, is printed to stderr when another
    process holds it and this one waits."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                print(waiting, file=sys.stderr)
            fcntl.flock(file, fcntl.LOCK_EX)
        yield
