"""How much other work shared this process's CPUs while a profile (or a benchmark's timing) ran.

A latency table measured beside another job is too slow (the demo model's quick profile, with one busy loop
through most of it on a 2-core machine, predicted 2.1-2.4x the quiet profiles' times for three micro-batches)
and is cached for every later run. Timing repeats cannot
tell: steady contention slows every sweep alike. The kernel's CPU counters can: the busy time of this
process's CPUs (including time the hypervisor took) minus this process's own CPU time (and, for a benchmark that
runs its variants as subprocesses, theirs) is what others used.
Linux only (``/proc/stat``); elsewhere nothing is measured.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: Other work may use this many cores beyond the ones the measured block leaves free before it is called busy.
TOLERATED_CORES = 0.25


@dataclass
class CpuContention:
    """Filled when ``measure_contention`` exits. ``other_cores``: the mean number of this process's CPUs other
    work kept busy (None where unknown); ``spare_cores``: how many of them the measured block left free."""

    spare_cores: int
    other_cores: float | None = None

    @property
    def busy(self) -> bool:
        return self.other_cores is not None and self.other_cores > self.spare_cores + TOLERATED_CORES

    def as_notes(self) -> dict:
        return {"other_cpu_cores": self.other_cores, "spare_cpu_cores": self.spare_cores}

    @classmethod
    def from_notes(cls, notes: dict) -> CpuContention | None:
        """The contention a table's notes record, or None for a table profiled before it was measured."""
        if "spare_cpu_cores" not in notes:
            return None
        return cls(notes["spare_cpu_cores"], notes.get("other_cpu_cores"))


@contextmanager
def measure_contention(cores_used: int, own_children: bool = False) -> Iterator[CpuContention]:
    """Measures other work on this process's CPUs while the block runs, which keeps ``cores_used`` of them
    busy (torch's threads on a CPU, about one core driving a GPU); with ``own_children`` the CPU time of the
    subprocesses the block runs and waits for is the block's own work."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    result = CpuContention(spare_cores=max(len(cpus) - cores_used, 0))
    busy, own, wall = _busy_seconds(cpus), _own_seconds(own_children), time.perf_counter()
    yield result
    busy_after, own_after, wall_after = _busy_seconds(cpus), _own_seconds(own_children), time.perf_counter()
    if busy is not None and busy_after is not None and wall_after > wall:
        result.other_cores = max((busy_after - busy) - (own_after - own), 0.0) / (wall_after - wall)


def _own_seconds(children: bool) -> float:
    """CPU seconds of this process, and with ``children`` of its children that ended and were waited for."""
    times = os.times()
    return time.process_time() + (times.children_user + times.children_system if children else 0.0)


def _busy_seconds(cpus: list[int]) -> float | None:
    """Seconds the given CPUs spent on anything but idling and waiting for I/O since boot (``/proc/stat``:
    user, nice, system, idle, iowait, irq, softirq, steal, in clock ticks; guest time is inside user)."""
    try:
        with open("/proc/stat") as stat:
            lines = {line.split()[0]: line.split()[1:9] for line in stat if line.startswith("cpu")}
        ticks = [[int(t) for t in lines[f"cpu{cpu}"]] for cpu in cpus]
    except (OSError, KeyError, ValueError):
        return None
    busy = sum(sum(t) - t[3] - t[4] for t in ticks)
    return busy / os.sysconf("SC_CLK_TCK")
