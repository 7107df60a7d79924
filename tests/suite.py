"""``make test``: the whole suite as two pytest processes side by side, one report.

    python -m tests.suite [pytest arguments]          # what `make test` runs

The tests that start Ray or run a whole job on it (``-m "ray or (slow and not no_ray)"``) run in the
foreground, their output as it comes. Beside them, in the idle scheduling class (``SCHED_IDLE``; a
nice level where ``RAYRL_TEST_BESIDE_NICE`` gives one), the rest run: ``make test-fast``'s tests and
the slow ones that start no Ray (``no_ray``), with Ray refused as in ``make test-fast``
(``RAYRL_FAST_TESTS=1``: a test there that starts Ray fails). Their output is kept and printed after.
The two selections are complements: every test runs once.

Why: the Ray tests leave a core idle for about a third of their time (actors waiting on each other,
bounds waited out, one-process stretches), and the Ray-free tests are two to four minutes of about one
core, which in one pytest process ran one test at a time beside that idle core. Beside the Ray tests, in
the idle class, they run in it.

Each tier has its own cache directory (``--lf`` works per tier) and its own report; the two reports are
merged into one, which ``--junitxml`` receives, and the run ends with one summary: the counts, each
tier's time, and the ``--durations`` slowest tests of both.

``RAYRL_TEST_ONE_PROCESS=1``, or a ``-m`` of the caller's own, runs one pytest as asked. Paths among the
arguments replace ``tests``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

from tests.chaos import BESIDE_ENV  # its scratch-directory check leaves the tier beside alone

RAY_TIER = "ray or (slow and not no_ray)"
BESIDE_TIER = "not ray and (not slow or no_ray)"  # the complement: make test-fast's tests and slow ones without Ray
OUTCOMES = ("failure", "error", "skipped")
SHARED_ENV = "RAYRL_TEST_SHARED"  # tests/conftest.py: what both tiers use, made once, the tier beside first
FAST_ENV = "RAYRL_FAST_TESTS"  # tests/conftest.py: Ray refuses to start (make test-fast)
NICE_ENV = "RAYRL_TEST_BESIDE_NICE"


def lower_priority() -> None:
    """Run in the Ray-free tier's process before it starts: the idle scheduling class (``SCHED_IDLE``), so
    that it takes the time the Ray tests leave idle and next to nothing they want; ``nice N`` instead where
    ``RAYRL_TEST_BESIDE_NICE`` is N, or where the platform has no idle class.

    Not a nice level by default: Ray starts its workers at nice 15 (its ``worker_niceness``), so a tier at
    nice 5 (tried first) outweighed the actors nine to one, and one at 19 still took 15 parts to an actor's
    36 (the Ray tests ran half and a sixth slower beside it in the first minutes of a run). The idle class
    weighs 3. Its tests still get time: over any stretch of a minute or two of a run here the Ray tests left
    at least a fifth of a core idle (2026-11-29), and the Ray-free tests' bounds (a subprocess importing
    torch within 120 s, a sandboxed program within 10 s) need far less."""
    nice = os.environ.get(NICE_ENV)
    if nice is None and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(int(nice or 19))


def priority_name() -> str:
    nice = os.environ.get(NICE_ENV)
    return f"nice {nice or 19}" if nice is not None or not hasattr(os, "SCHED_IDLE") else "SCHED_IDLE"


def split_args(args: list) -> tuple:
    """``(rest, junitxml path or None, durations or None)``: the caller's pytest arguments less the two
    options this runner applies to both tiers' merged report."""
    rest, junit, durations = [], None, None
    it = iter(args)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name in ("--junitxml", "--junit-xml", "--durations"):
            value = value if eq else next(it, "")
            if name == "--durations":
                durations = int(value)
            else:
                junit = value
        else:
            rest.append(arg)
    return rest, junit, durations


def chooses_marks(args: list) -> bool:
    return any(arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")) for arg in args)


def read_cases(path: str) -> list:
    """``[(seconds, node id, outcome), ...]`` of a JUnit report, the node id as pytest names the test
    (``tests/x/test_y.py::TestClass::test_z``: JUnit's class name is the module's dotted path, with a test
    class's name after it); none where pytest wrote none. ``benchmarks/suite_times.py`` reads reports so too."""
    if not os.path.isfile(path):
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in OUTCOMES), "passed")
        parts = case.get("classname", "").split(".")
        cls = [parts.pop()] if len(parts) > 1 and parts[-1][:1].isupper() else []  # a test class, by its capital
        node = "::".join(["/".join(parts) + ".py", *cls, case.get("name", "")])
        cases.append((float(case.get("time", 0.0)), node, outcome))
    return cases


def suite_seconds(path: str) -> float:
    """The seconds pytest took for the run a JUnit report holds (0 where it wrote none)."""
    if not os.path.isfile(path):
        return 0.0
    return sum(float(suite.get("time", 0.0)) for suite in ET.parse(path).getroot().iter("testsuite"))


def merge_reports(paths: list, out: str) -> None:
    """One JUnit file holding every tier's test suites."""
    merged = ET.Element("testsuites", name="pytest tests")
    for path in paths:
        if os.path.isfile(path):
            root = ET.parse(path).getroot()
            merged.extend(root.iter("testsuite"))
    ET.ElementTree(merged).write(out, encoding="utf-8", xml_declaration=True)


def summary(tiers: list, durations, wall: float) -> str:
    """The run's last lines: each tier's counts and pytest's time, the whole run's counts and ``wall``
    seconds, the slowest tests of both. ``tiers`` is ``[(name, cases, exit code, seconds), ...]``."""
    def counts(cases: list) -> str:
        tally = {}
        for _, _, outcome in cases:
            tally[outcome] = tally.get(outcome, 0) + 1
        return ", ".join(f"{tally[k]} {k if k != 'failure' else 'failed'}"
                         for k in ("passed", "failure", "error", "skipped") if k in tally) or "no tests"

    everything = [case for _, cases, _, _ in tiers for case in cases]
    lines = [f"{name}: {counts(cases)} in {seconds:.0f} s (pytest exit code {rc})"
             for name, cases, rc, seconds in tiers]
    if durations is not None:
        slowest = sorted(everything, reverse=True)[:durations or len(everything)]
        lines += ["", f"slowest {len(slowest)} tests of both tiers (setup, call and teardown together):"]
        lines += [f"{seconds:8.2f}s {node}" for seconds, node, _ in slowest]
    lines += ["", f"make test: {counts(everything)} in {wall:.0f} s ({wall / 60:.1f} min)"]
    return "\n".join(lines)


def exit_code(codes: list) -> int:
    """Pytest's 5 (no tests) from one tier is fine where the other ran tests; any other failure wins."""
    failed = [rc for rc in codes if rc not in (0, 5)]
    if failed:
        return failed[0]
    return 5 if all(rc == 5 for rc in codes) else 0


def pytest(args: list) -> list:
    """The pytest command: over ``tests`` unless the arguments name paths of their own."""
    paths = [] if any(os.path.exists(arg.split("::")[0]) for arg in args if not arg.startswith("-")) else ["tests"]
    return [sys.executable, "-m", "pytest", *paths, *args]


def run_tiers(args: list) -> int:
    rest, junit, durations = split_args(args)
    # Ctrl-C reaches both pytest processes from the terminal, and each stops as pytest does; this runner
    # waits for them. A handler, not SIG_IGN: an ignored signal would stay ignored in the children.
    signal.signal(signal.SIGINT, lambda *_: None)
    with tempfile.TemporaryDirectory(prefix="rayrl-test-") as reports:
        beside_xml, ray_xml, beside_log = (os.path.join(reports, n) for n in ("beside.xml", "ray.xml", "beside.log"))
        shared = {SHARED_ENV: os.path.join(reports, "shared")}  # made once for both tiers (tests/conftest.py)
        # one torch thread beside: in the idle class a thread of two is often preempted, and the other spins at
        # the pair's barriers. Two threads there made the tool caller in 273 s, while the Ray tier's default job
        # beside it took 148 s against 136 without it
        threads = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}
        start = time.time()
        with open(beside_log, "w") as log:
            # a cache of its own, where there is a cache (pytest warns of the option without one)
            cache = [] if "no:cacheprovider" in rest else ["-o", "cache_dir=.pytest_cache/beside"]
            beside = subprocess.Popen(pytest(["-m", BESIDE_TIER, *cache, *rest, f"--junitxml={beside_xml}"]),
                                      env={**os.environ, **shared, **threads, FAST_ENV: "1"}, stdout=log,
                                      stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, preexec_fn=lower_priority)
            ray_env = {name: value for name, value in os.environ.items() if name != FAST_ENV}
            ray_rc = subprocess.Popen(pytest(["-m", RAY_TIER, *rest, f"--junitxml={ray_xml}"]),
                                      env={**ray_env, **shared, BESIDE_ENV: str(beside.pid)}).wait()
            beside_rc = beside.wait()
            wall = time.time() - start
        with open(beside_log) as log:
            print(f"\n{'=' * 12} the tests without Ray (-m \"{BESIDE_TIER}\", {priority_name()}, alongside)",
                  flush=True)
            sys.stdout.write(log.read())
        if junit:
            merge_reports([ray_xml, beside_xml], junit)
        tiers = [(f'-m "{RAY_TIER}"', read_cases(ray_xml), ray_rc, suite_seconds(ray_xml)),
                 (f'-m "{BESIDE_TIER}" (alongside)', read_cases(beside_xml), beside_rc, suite_seconds(beside_xml))]
    print("\n" + summary(tiers, durations, wall), flush=True)
    return exit_code([ray_rc, beside_rc])


def main(args: list) -> int:
    if os.environ.get("RAYRL_TEST_ONE_PROCESS") == "1" or chooses_marks(args):
        return subprocess.call(pytest(args))
    return run_tiers(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
