"""The cores this process may use and the load other processes put on them: /proc/stat on a plain
machine, a cgroup's quota and CPU time in a container (v1 and v2 trees built here)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from verispec.core import cores

HOST = set(range(16))  # a container's view: the host's CPUs, all visible


def fake_cgroup(tmp_path: Path, monkeypatch, line: str, files: dict[str, str]) -> Path:
    """A cgroup tree under tmp_path with `files` (paths below the mount) and /proc/self/cgroup's
    `line`; the process sees 16 CPUs."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "self-cgroup").write_text(line + "\n")
    monkeypatch.setattr(cores, "CGROUP", root)
    monkeypatch.setattr(cores, "PROC_CGROUP", tmp_path / "self-cgroup")
    monkeypatch.setattr(cores, "affinity", lambda: HOST)
    return root


def test_a_v2_quota_anywhere_up_the_tree_bounds_the_cores_and_its_usage_is_read(tmp_path, monkeypatch):
    root = fake_cgroup(tmp_path, monkeypatch, "0::/jobs/ci", {
        "jobs/cpu.max": "200000 100000\n", "jobs/cpu.stat": "usage_usec 5000000\nuser_usec 1\n",
        "jobs/ci/cpu.max": "max 100000\n", "jobs/ci/cpu.stat": "usage_usec 1000000\n"})
    quota, used = cores.cgroup_quota()
    assert quota == 2.0 and used() == 5.0  # the limiting folder's CPU time
    assert cores.usable_cores() == 2
    (root / "jobs/ci/cpu.max").write_text("50000 100000\n")  # tighter below: it wins
    quota, used = cores.cgroup_quota()
    assert quota == 0.5 and used() == 1.0 and cores.usable_cores() == 1


def test_a_v1_quota_seen_from_inside_the_container_is_read_at_the_mount(tmp_path, monkeypatch):
    # the path names the host's folder; the container sees its own cgroup at the mount's root
    fake_cgroup(tmp_path, monkeypatch, "4:cpu,cpuacct:/docker/abc", {
        "cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n",
        "cpuacct/cpuacct.usage": "2500000000\n"})
    quota, used = cores.cgroup_quota()
    assert quota == 3.0 and used() == 2.5 and cores.usable_cores() == 3


def test_a_v1_quota_in_cpus_own_tree_reads_cpuacct_s_own_folder(tmp_path, monkeypatch):
    # cpu and cpuacct mounted apart (this project's VMs), the process in a folder of cpu's alone
    fake_cgroup(tmp_path, monkeypatch, "2:cpuacct:/\n1:cpu:/jobs", {
        "cpu/jobs/cpu.cfs_quota_us": "100000\n", "cpu/jobs/cpu.cfs_period_us": "100000\n",
        "cpu/cpu.cfs_quota_us": "-1\n", "cpuacct/cpuacct.usage": "7000000000\n"})
    quota, used = cores.cgroup_quota()
    assert quota == 1.0 and used() == 7.0 and cores.usable_cores() == 1


def test_no_quota_leaves_the_cpus(tmp_path, monkeypatch):
    fake_cgroup(tmp_path, monkeypatch, "4:cpu,cpuacct:/\n0::/", {
        "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n", "cpu.max": "max 100000\n"})
    assert cores.cgroup_quota() is None and cores.usable_cores() == len(HOST)


def test_under_a_quota_the_others_load_is_the_cgroups_time_and_an_impossible_reading_is_none(
        tmp_path, monkeypatch):
    """Under a 2-core quota on a 16-CPU host, the others' load is the cgroup's CPU time less this
    process's (the host's /proc/stat would count every tenant); a reading above the cores there
    are is not this machine's: None."""
    root = fake_cgroup(tmp_path, monkeypatch, "0::/", {"cpu.max": "200000 100000\n"})
    host_reads = []
    monkeypatch.setattr(cores, "busy_seconds", lambda cpus: host_reads.append(cpus))
    def used(others: float) -> None:  # the cgroup's time: this process's own and the others'
        (root / "cpu.stat").write_text(f"usage_usec {int(1e6 * (others + time.process_time()))}\n")

    for gained in (0.3, 100.0):
        used(0.0)
        with cores.OthersLoad() as load:
            started = time.perf_counter()
            time.sleep(0.3)
            used(gained)
            wall = time.perf_counter() - started
        assert load.capacity == 2.0 and not host_reads
        if gained > load.capacity:
            assert load.cores is None
        else:
            assert 0.2 < load.cores <= 1.05 * gained / wall


@pytest.mark.skipif(cores.busy_seconds({0}) is None, reason="no /proc/stat here")
def test_other_processes_load_is_measured_and_this_ones_own_work_is_not():
    """OthersLoad sees a process burning a core beside it, and leaves out this process's own work
    (which the machine's busy time includes)."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # running
        with cores.OthersLoad() as beside:
            time.sleep(0.6)
    finally:
        burner.kill()
        burner.wait()
    assert beside.cores is not None and beside.cores >= 0.5  # a core's worth, less a share
    with cores.OthersLoad() as own:
        started, wall, cpu = own.busy(), time.perf_counter(), time.process_time()
        until = time.perf_counter() + 0.6
        while time.perf_counter() < until:  # this process's own work
            pass
        wall = time.perf_counter() - wall
        everyone, mine = (own.busy() - started) / wall, (time.process_time() - cpu) / wall
    # the core's share this process kept busy (whatever else ran) is left out
    assert mine >= 0.3 and everyone - own.cores >= 0.7 * mine


def test_the_command_line_holds_torchs_threads_to_the_cores_a_quota_allows(monkeypatch, tmp_path):
    """Every command fits torch's threads to the usable cores first (never raises them), unless
    the user chose a count (OMP_NUM_THREADS)."""
    import torch

    from verispec import cli

    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        for usable, expected in ((2, 2), (4, 3)):
            torch.set_num_threads(3)
            monkeypatch.setattr(cli, "usable_cores", lambda usable=usable: usable)
            # fails (no such model) after fitting
            assert cli.main(["generate", "--prompt", "x", "--model", str(tmp_path / "none")]) == 2
            assert torch.get_num_threads() == expected
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(3)
        cli.fit_threads()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)


def test_with_children_this_processs_child_processes_work_is_its_own():
    """OthersLoad(children=True) counts a child's CPU time as this process's own, both a child
    that ended and was waited for (os.times) and one still running (psutil): the bench's peers."""
    burn = "import time\nwhile time.process_time() < 0.3: pass"
    with cores.OthersLoad(children=True) as load:
        before = load.own_seconds()
        subprocess.run([sys.executable, "-c", burn], check=True)
        ended = load.own_seconds() - before
    assert ended >= 0.3  # the child's 0.3 s of CPU at least (plus its start)
    without = cores.OthersLoad()
    started = without.own_seconds()
    subprocess.run([sys.executable, "-c", burn], check=True)
    assert without.own_seconds() - started < 0.1  # not counted without children
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        load = cores.OthersLoad(children=True)
        first = load.own_seconds()
        time.sleep(0.5)
        running = load.own_seconds() - first
    finally:
        burner.kill()
        burner.wait()
    assert running >= 0.1  # a running child's time, while this process only slept
