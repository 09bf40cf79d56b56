"""The row-kernel library's build (verispec.model.kernels.build) survives a build stopped midway:
torch's builder waits forever while its lock file exists, and a killed build leaves one behind."""

from __future__ import annotations

import subprocess
import sys

from torch.utils import cpp_extension

from verispec.model.kernels import build


def test_a_lock_left_by_a_killed_build_is_cleared_and_the_library_built(tmp_path, monkeypatch):
    directory = tmp_path / "verispec_rows_x"
    directory.mkdir()
    (directory / "lock").touch()  # torch's, left by a build that was killed
    locks_seen = []

    def load(name: str, sources: list[str], build_directory: str, **_: object) -> str:
        locks_seen.append((directory / "lock").exists())
        return f"built {name} in {build_directory}"

    monkeypatch.setattr(cpp_extension, "load", load)
    assert build._build("verispec_rows_x", directory) == f"built verispec_rows_x in {directory}"
    assert locks_seen == [False]


def test_a_library_another_process_built_meanwhile_is_imported_not_rebuilt(tmp_path, monkeypatch):
    directory = tmp_path / "verispec_rows_y"
    directory.mkdir()
    (directory / "verispec_rows_y.so").touch()
    monkeypatch.setattr(cpp_extension, "load", lambda **_: "built again")
    monkeypatch.setattr(build, "_import", lambda name, path: f"imported {path.name}")
    assert build._build("verispec_rows_y", directory) == "imported verispec_rows_y.so"


def test_the_build_lock_is_released_when_its_holder_is_killed(tmp_path, monkeypatch):
    directory = tmp_path / "verispec_rows_z"
    directory.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
         str(directory / "verispec.lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    holder.kill()
    holder.wait()
    monkeypatch.setattr(cpp_extension, "load", lambda **_: "built")
    assert build._build("verispec_rows_z", directory) == "built"
