"""`python -m verispec.bench.llamacpp_build`: install the `llamacpp` extra (llama-cpp-python,
which builds llama.cpp from source) with llama.cpp's CPU options chosen for this machine.

llama.cpp's native build (`GGML_NATIVE`, pip's default) turns on every instruction set the
compiler finds, AMX tiles included. On a VM that does not grant the process tile state, ggml's AMX
matrix product dies with SIGILL (`tileloadd`) on the first prompt of more than one token (a 2-core
Intel Xeon, 2026-11-26). On a CPU with `amx_tile` this builds for AVX-512 (with VBMI, VNNI and
BF16) and AVX-VNNI, AMX off: that build ran there. Elsewhere the native build. CMAKE_ARGS
already set in the environment are added after these (they win).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = "llama-cpp-python==0.3.36"  # the `llamacpp` extra's pin (pyproject.toml)
# The multimodal library (mtmd, llama-cpp-python's `LLAVA_BUILD`) is not built: the bench decodes
# text (its sources are about a tenth of the lines the build compiles; the whole build took 7
# minutes on a 2-core AVX2 EPYC without it).
TEXT_ONLY = ("-DLLAVA_BUILD=OFF",)
NATIVE = (*TEXT_ONLY, "-DGGML_NATIVE=ON")
# AVX-512 (+VBMI, VNNI, BF16) and AVX-VNNI (AVX, AVX2, FMA, F16C: ggml's defaults off native),
# AMX off.
WITHOUT_AMX = (*TEXT_ONLY, "-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON",
               "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX_VNNI=ON", "-DGGML_AMX_TILE=OFF",
               "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of /proc/cpuinfo's first `flags` line (empty where there is none: not x86 Linux)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cmake_args(flags: set[str]) -> tuple[str, ...]:
    """llama.cpp's CMake options for a CPU with these flags: AMX off where the CPU has AMX tiles
    (the native build's AMX product can die with SIGILL), the native build elsewhere."""
    return WITHOUT_AMX if "amx_tile" in flags else NATIVE


def this_cpu() -> set[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return set()


def install_commands() -> list[list[str]]:
    """pip commands that build llama-cpp-python anew (a wheel pip built or cached with other
    options is not reused), then install its dependencies."""
    pip = [sys.executable, "-m", "pip", "install", "--no-cache-dir"]
    return [pip + ["--force-reinstall", "--no-deps", "--no-binary", "llama-cpp-python", PACKAGE],
            pip + [PACKAGE]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m verispec.bench.llamacpp_build",
        description=f"Build and install {PACKAGE} (the llamacpp extra) for this CPU: AVX-512 without AMX "
                    "where the CPU has AMX tiles, the native build elsewhere (about 5-7 minutes on 2 cores).")
    parser.add_argument("--print", action="store_true", help="print the CMAKE_ARGS for this CPU and exit")
    options = parser.parse_args(argv)
    # The user's own CMAKE_ARGS come last: CMake takes the last value of an option.
    args = " ".join(cmake_args(this_cpu()) + tuple(os.environ.get("CMAKE_ARGS", "").split()))
    print(f"CMAKE_ARGS={args}", flush=True)
    if options.print:
        return 0
    for command in install_commands():
        done = subprocess.run(command, env=os.environ | {"CMAKE_ARGS": args}, check=False)
        if done.returncode:
            return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
