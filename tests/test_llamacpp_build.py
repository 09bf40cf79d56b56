"""The llamacpp extra's build options: AMX off where the CPU has AMX tiles (ggml's native AMX
product dies with SIGILL on VMs that grant no tile state), native elsewhere."""

from __future__ import annotations

import tomllib
from pathlib import Path

from verispec.bench import llamacpp_build
from verispec.bench.llamacpp_build import NATIVE, WITHOUT_AMX, cmake_args, cpu_flags, install_commands

XEON_AMX = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8581C\n"
            "flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16 avx512_fp16 "
            "amx_bf16 amx_tile amx_int8 avx_vnni\n\nprocessor\t: 1\nflags\t\t: fpu\n")
EPYC = ("processor\t: 0\nmodel name\t: AMD EPYC 9B45\n"
        "flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16 avx_vnni\n")
LAPTOP_AVX2 = "model name\t: Intel(R) Core(TM) i7-8550U\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"


def test_amx_tiles_get_the_build_without_amx():
    assert cpu_flags(XEON_AMX) >= {"amx_tile", "avx512_bf16"} and "amx_tile" not in cpu_flags(EPYC)
    assert cmake_args(cpu_flags(XEON_AMX)) == WITHOUT_AMX
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AMX_TILE=OFF",
            "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(WITHOUT_AMX)
    for cpuinfo in (EPYC, LAPTOP_AVX2, "", "Processor\t: AArch64\nFeatures\t: fp asimd\n"):
        assert cmake_args(cpu_flags(cpuinfo)) == NATIVE
    # the bench decodes text: neither build makes the multimodal library
    assert "-DLLAVA_BUILD=OFF" in NATIVE and "-DLLAVA_BUILD=OFF" in WITHOUT_AMX


def test_the_build_is_made_anew_with_the_chosen_options(monkeypatch, capsys):
    build, dependencies = install_commands()
    assert "--no-cache-dir" in build and "--force-reinstall" in build  # no wheel built with other options
    assert build[build.index("--no-binary") + 1] == "llama-cpp-python" and build[-1] == dependencies[-1]
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert [dependencies[-1]] == extras["optional-dependencies"]["llamacpp"]  # the extra's pin
    monkeypatch.setattr(llamacpp_build, "this_cpu", lambda: cpu_flags(XEON_AMX))
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_OPENMP=OFF")
    assert llamacpp_build.main(["--print"]) == 0
    assert capsys.readouterr().out == f"CMAKE_ARGS={' '.join(WITHOUT_AMX)} -DGGML_OPENMP=OFF\n"
