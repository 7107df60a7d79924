"""Where the test suite's time goes: each test module's seconds and the slowest tests, from a JUnit
XML report of one run (``pytest --junitxml=report.xml``), as Markdown tables for docs/testing.md.

    make test PYTEST_ARGS="--junitxml=/tmp/report.xml"
    python benchmarks/suite_times.py /tmp/report.xml --slowest 25
    python benchmarks/suite_times.py /tmp/after.xml --before /tmp/before.xml   # a column per run

A module's time is the sum of its tests' times as pytest reports them: a module-scoped fixture's
setup counts in the first test that uses it, and a session fixture's (``default_job``) in the first
test of the run that asks for it.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: tests.suite reads the reports
    sys.path.insert(0, ROOT)


def read_report(path: str) -> list:
    """``[(seconds, module, test name), ...]`` of every test case in a JUnit XML report (a test class's
    name stays with the test's: it counts in its module)."""
    from tests.suite import read_cases

    return [(seconds, *node.split("::", 1)) for seconds, node, _ in read_cases(path)]


def module_seconds(cases: list) -> dict:
    totals = collections.defaultdict(float)
    for seconds, module, _ in cases:
        totals[module] += seconds
    return dict(totals)


def markdown(cases: list, slowest: int, before: list | None = None) -> str:
    now, then = module_seconds(cases), module_seconds(before) if before else {}
    modules = sorted(set(now) | set(then), key=lambda m: -now.get(m, 0.0))
    head = "| module | before s | s |\n|---|---:|---:|" if before else "| module | s |\n|---|---:|"
    rows = [f"| `{m}` | {then.get(m, 0.0):.0f} | {now.get(m, 0.0):.0f} |" if before else
            f"| `{m}` | {now.get(m, 0.0):.0f} |" for m in modules]
    total = (f"| all ({len(before)} -> {len(cases)} tests) | {sum(then.values()):.0f} | {sum(now.values()):.0f} |"
             if before else f"| all ({len(cases)} tests) | {sum(now.values()):.0f} |")
    lines = [head, *rows, total, "", f"The {slowest} slowest tests:", "", "| s | test |", "|---:|---|"]
    lines += [f"| {s:.0f} | `{m}::{name}` |" for s, m, name in sorted(cases, reverse=True)[:slowest]]
    return "\n".join(lines)


def read_cpu(path: str) -> dict:
    """``{module: [wall s, busy core-s]}`` from ``benchmarks/cpu_probe.py``'s CSV."""
    totals: dict = collections.defaultdict(lambda: [0.0, 0.0])
    with open(path) as f:
        for line in f:
            node, _, wall, busy = line.rstrip("\n").rsplit(",", 3)
            totals[node.split("::")[0]][0] += float(wall)
            totals[node.split("::")[0]][1] += float(busy)
    return dict(totals)


def cpu_markdown(cpu: dict, cores: int, top: int = 15) -> str:
    """The modules' busy cores, and the floor CPU sets on the run: its busy core-seconds over ``cores``."""
    wall, busy = sum(w for w, _ in cpu.values()), sum(b for _, b in cpu.values())
    lines = ["| module | s | busy core-s | cores busy |", "|---|---:|---:|---:|"]
    lines += [f"| `{m}` | {w:.0f} | {b:.0f} | {b / w if w else 0.0:.2f} |"
              for m, (w, b) in sorted(cpu.items(), key=lambda kv: -kv[1][0])[:top]]
    lines += [f"| all | {wall:.0f} | {busy:.0f} | {busy / wall if wall else 0.0:.2f} |", "",
              f"On {cores} cores no scheduling of these tests runs in less than {busy / cores:.0f} s "
              f"(their busy core-seconds over the cores): at most {wall / (busy / cores):.2f}x faster than this run."]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="JUnit XML of a test run (pytest --junitxml)")
    parser.add_argument("--before", help="JUnit XML of an earlier run, for a column beside")
    parser.add_argument("--slowest", type=int, default=25, help="how many of the slowest tests to list")
    parser.add_argument("--cpu", help="benchmarks/cpu_probe.py's CSV of the same run: each module's busy cores")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="the machine's cores (for --cpu)")
    args = parser.parse_args(argv)
    print(markdown(read_report(args.report), args.slowest, read_report(args.before) if args.before else None))
    if args.cpu:
        print("\n" + cpu_markdown(read_cpu(args.cpu), args.cores))


if __name__ == "__main__":
    main()
