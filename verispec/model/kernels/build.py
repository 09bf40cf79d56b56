"""Builds rows.cpp once per machine into the user's cache and loads it; says why not where it
cannot (no compiler, no ninja, not x86-64). Which kernel class runs is rows.py's `choice()`.

The library goes to $XDG_CACHE_HOME/verispec/kernels/<name>/ (default ~/.cache), named by a
hash of the source and of torch's version, so an edited source or another torch builds anew;
nothing is downloaded. The first use builds it (about a minute on 2 cores, through
torch.utils.cpp_extension and ninja); `make install` builds it ahead. Everything else loads
the built file directly (milliseconds).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from verispec.core.files import held

SOURCE = Path(__file__).with_name("rows.cpp")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "verispec" / "kernels"


# -ffp-contract=off: the compiler fuses no multiply and add on its own, so a row's arithmetic is
# exactly the instructions rows.cpp spells, whatever function it was inlined into.
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
# VERISPEC_AMX_EMULATED=1, for the tests only: a library of its own whose amx-bf16 class runs on
# any CPU with AVX512-BF16, the tile instructions spelt in AVX-512 (rows.cpp's AMX section), so
# that the class's code is tested on machines without AMX. Slow: never for decoding.
EMULATED = "VERISPEC_AMX_EMULATED"


def emulated() -> bool:
    """Whether this process builds and loads the library with the AMX tiles emulated."""
    return os.environ.get(EMULATED, "") not in ("", "0")


def flags() -> list[str]:
    return FLAGS + ([f"-D{EMULATED}"] if emulated() else [])


def library_name() -> str:
    digest = hashlib.sha1(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(flags()).encode())
    return f"verispec_rows_{digest.hexdigest()[:12]}"


def _build(name: str, directory: Path) -> ModuleType:
    """Build (or, where another process built it meanwhile, import) the library into directory.

    torch's builder holds a lock file there while it builds and waits, forever, while one exists:
    a build stopped midway (Ctrl-C, a timeout's kill) leaves it behind, and every later build of
    the same source would hang. So builds hold a lock of their own, which the system releases
    however its process ends; whoever holds it knows a leftover torch lock is stale."""
    from torch.utils import cpp_extension

    with held(directory / "verispec.lock"):
        built = directory / f"{name}.so"
        if built.is_file():
            return _import(name, built)
        (directory / "lock").unlink(missing_ok=True)
        print(f"verispec: building the row kernels once (cached in {directory})", file=sys.stderr)
        return cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(directory),
                                  extra_cflags=flags(), extra_ldflags=["-fopenmp"], verbose=False)


def _import(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@functools.cache
def load() -> tuple[ModuleType | None, str]:
    """The row-kernel library and "" where it builds and loads here, else None and why not."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return None, "built for x86-64 Linux only"
    name = library_name()
    directory = cache_dir() / name
    built = directory / f"{name}.so"  # what torch.utils.cpp_extension writes
    try:
        library = _import(name, built) if built.is_file() else _build(name, directory)
    except (OSError, RuntimeError, ImportError, ValueError) as error:
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        return None, f"could not be built ({reason[:200]})"
    return library, ""


def library() -> ModuleType | None:
    """The loaded row-kernel library, or None where it does not load here (`load` says why)."""
    return load()[0]


if __name__ == "__main__":  # `python -m verispec.model.kernels.build` (make install)
    found, why = load()
    print("verispec: row kernels " + (f"built (this CPU: {', '.join(found.features()) or 'no class'})"
                                      if found is not None else f"not used: {why}"))
