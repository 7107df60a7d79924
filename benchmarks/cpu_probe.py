"""A pytest plugin: each test's wall time and the CPU the whole machine spent over it (every
process: the test's actors too), appended to ``$CPU_PROBE_OUT`` (default ``cpu_probe.csv``) as
``test id,start,wall s,busy core-s``. It answers whether a test waits or computes, and so what a
second pytest worker could gain (``python benchmarks/suite_times.py report.xml --cpu cpu_probe.csv``).
Linux (``/proc/stat``).

    CPU_PROBE_OUT=/tmp/cpu_probe.csv make test PYTEST_ARGS="-p benchmarks.cpu_probe --junitxml=/tmp/report.xml"
"""
from __future__ import annotations

import os
import time

import pytest

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_seconds(path: str = "/proc/stat") -> float:
    """CPU seconds the machine has spent not idle (all cores) since boot."""
    with open(path) as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / TICKS  # less idle and iowait


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start, busy = time.time(), busy_seconds()
    yield
    wall, spent = time.time() - start, busy_seconds() - busy
    with open(os.environ.get("CPU_PROBE_OUT", "cpu_probe.csv"), "a") as f:
        f.write(f"{item.nodeid},{start:.1f},{wall:.2f},{spent:.2f}\n")
