"""How many cores this process may use, and how many other processes kept busy meanwhile.

On a plain machine or VM both come from the CPUs this process may run on (its affinity) and
/proc/stat. In a container limited by a CPU quota (cgroup v1 `cpu.cfs_quota_us` or v2 `cpu.max`)
the host's CPUs are all visible while only the quota's worth can run: there the quota bounds the
cores, and the others' load is read from the cgroup's own CPU time, not /proc/stat (which counts
every tenant of the host: a CI container once read 189 cores busy beside a 2-core test run).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def affinity() -> set[int]:
    """The CPUs this process may run on (all of os.cpu_count's where the OS does not say)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _folders(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder under `mount` and its parents up to the mount, deepest first; the mount
    alone where the path is not there (a container sees its own cgroup at the mount's root)."""
    deepest = mount / path.lstrip("/")
    if not deepest.is_dir():
        return [mount] if mount.is_dir() else []
    return [deepest, *[p for p in deepest.parents if p.is_relative_to(mount)]]


def cgroup_quota() -> tuple[float, Callable[[], float | None]] | None:
    """The tightest CPU quota on this process's cgroup, in cores, and a reader of the CPU seconds
    the limited cgroup's processes have used so far; None where no quota limits it."""
    text = _read(PROC_CGROUP)
    if text is None:
        return None
    paths = {name: path for line in text.splitlines()
             for _, names, path in [line.split(":", 2)] for name in names.split(",")}
    found: list[tuple[float, Callable[[], float | None]]] = []
    if "" in paths:  # cgroup v2: one tree, cpu.max and cpu.stat side by side
        for folder in _folders(CGROUP, paths[""]):
            fields = (_read(folder / "cpu.max") or "max").split()
            if fields[0] != "max":
                found.append((int(fields[0]) / int(fields[1]), lambda f=folder: _v2_seconds(f)))
    if "cpu" in paths:  # cgroup v1: the quota in cpu's tree, the CPU time in cpuacct's
        accounted = _folders(CGROUP / "cpuacct", paths.get("cpuacct", "/"))[:1]
        for folder in _folders(CGROUP / "cpu", paths["cpu"]):
            quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
            if quota and period and int(quota) > 0:
                found.append((int(quota) / int(period), lambda: _v1_seconds(
                    accounted[0] / "cpuacct.usage") if accounted else None))
    return min(found, key=lambda pair: pair[0]) if found else None


def _v2_seconds(folder: Path) -> float | None:
    for line in (_read(folder / "cpu.stat") or "").splitlines():
        name, _, value = line.partition(" ")
        if name == "usage_usec":
            return int(value) / 1e6
    return None


def _v1_seconds(usage: Path) -> float | None:
    text = _read(usage)
    return int(text) / 1e9 if text else None


def capacity() -> tuple[float, Callable[[], float | None]]:
    """The cores this process may keep busy (its CPUs, or a cgroup quota's where fewer) and a
    reader of the CPU seconds spent on them so far by every process (/proc/stat on the CPUs, or
    the cgroup's own time under the quota: the host's other tenants do not take its cores)."""
    cpus = affinity()
    quota = cgroup_quota()
    if quota and quota[0] < len(cpus):
        return quota
    return float(len(cpus)), lambda: busy_seconds(cpus)


def usable_cores() -> int:
    """The whole cores this process's threads can keep busy at once (at least one)."""
    return max(1, int(capacity()[0]))


def busy_seconds(cpus: set[int]) -> float | None:
    """CPU seconds every process (and the hypervisor's other guests: steal) has spent so far on
    these CPUs, from /proc/stat; None where there is none (not Linux)."""
    text = _read(Path("/proc/stat"))
    if text is None:
        return None
    ticks = 0
    for line in text.splitlines():
        name, *fields = line.split()
        if name[:3] == "cpu" and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


class OthersLoad:
    """How many cores other processes kept busy, on average, while the block ran (`cores`, of
    `capacity` this process may use; None where the machine does not say or its counters do not
    add up): the busy time of this process's CPUs (or of its cgroup, under a quota) less this
    process's own (every thread of it). children: this process's child processes' time counts
    as its own too (the bench's peers, which it starts and times)."""

    def __init__(self, children: bool = False) -> None:
        self.children = children

    def own_seconds(self) -> float:
        """CPU seconds this process (and with `children`, its child processes, running or
        ended) has spent so far."""
        own = time.process_time()
        if self.children:
            import psutil

            for child in psutil.Process().children(recursive=True):
                try:
                    times = child.cpu_times()
                except psutil.Error:  # ended meanwhile: os.times counts it once waited for
                    continue
                own += times.user + times.system
            ended = os.times()
            own += ended.children_user + ended.children_system
        return own

    def __enter__(self) -> OthersLoad:
        self.capacity, self.busy = capacity()
        self.cores: float | None = None
        self._start = (self.busy(), self.own_seconds(), time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        busy, own, wall = self.busy(), self.own_seconds(), time.perf_counter()
        if busy is not None and self._start[0] is not None and wall > self._start[2]:
            others = max(0.0, ((busy - self._start[0]) - (own - self._start[1])) / (wall - self._start[2]))
            # more than the cores there are: counters that are not this machine's (say so: None)
            self.cores = others if others <= self.capacity + 0.5 else None

    def took(self, threads: int, margin: float) -> bool:
        """Whether other processes took cores that this process's `threads` needed: kept busy
        more than `margin` cores beyond those the threads leave spare."""
        return self.cores is not None and self.cores > max(0.0, self.capacity - threads) + margin
