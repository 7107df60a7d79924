"""``make test``: the whole suite as three pytest processes side by side, one report.

    python -m tests.suite [pytest arguments]          # what `make test` runs

The tests that start Ray or run a whole job on the run's Ray (``-m "(ray or (slow and not no_ray)) and not
apart"``) run in the foreground, their output as it comes. Beside them, at the same priority, run the tests
marked ``apart``: a Ray of their own (the tier's own local Ray, simulated nodes, a ``ray start`` head) that
nothing of the run's Ray touches, nor they it. They are the tests that mostly wait (kills and stopped processes
waited for, heartbeats' bounds, lost nodes noticed by Ray's health checks) and the jobs through ``ray job
submit``. On the Ray tier's path the waiting ones took about 330 s at about one core (2026-11-30, the fault,
heartbeat, cluster-sync, multinode and chaos modules); beside it the time they leave idle goes to the others.
Beside both, in the idle scheduling class (``SCHED_IDLE``; a nice level where ``RAYRL_TEST_BESIDE_NICE``
gives one), the rest run: ``make test-fast``'s tests and the slow ones that start no Ray (``no_ray``), with
Ray refused as in ``make test-fast`` (``RAYRL_FAST_TESTS=1``: a test there that starts Ray fails). The two
tiers beside keep their output, printed after. The three selections partition the tests: every test runs
once. Each process, and every process it starts, carries its tier's name in ``RAYRL_TEST_TIER``
(``tests/chaos.py``: a scratch directory of a live process of another tier is that tier's).

Why: the Ray tests leave a core idle for about a third of their time (actors waiting on each other,
bounds waited out, one-process stretches), and the Ray-free tests are two to four minutes of about one
core, which in one pytest process ran one test at a time beside that idle core. Beside the Ray tests, in
the idle class, they run in it. They ended about 12 minutes before the Ray tests (2026-11-30), whose last
stretch then left a third of a core idle, and the tests apart, two jobs through ``ray job submit`` on a head
of their own, took 110 s at the Ray tier's end. Beside it they take 250 s, and the Ray tier's other tests
run slower beside them: the Ray tier came out 35-50 s shorter (docs/testing.md, the twenty-second round).

Each tier has its own cache directory (``--lf`` works per tier) and its own report; the reports are
merged into one, which ``--junitxml`` receives, and the run ends with one summary: the counts, each
tier's time, and the ``--durations`` slowest tests of all.

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

from tests.chaos import TIER_ENV  # its scratch-directory check leaves the other tiers' alone

RAY_TIER = "(ray or (slow and not no_ray)) and not apart"
APART_TIER = "apart"
BESIDE_TIER = "not ray and (not slow or no_ray) and not apart"  # make test-fast's tests and slow ones without Ray
OUTCOMES = ("failure", "error", "skipped")
SHARED_ENV = "RAYRL_TEST_SHARED"  # tests/conftest.py: what the tiers use, made once, by the tier beside first
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
    options this runner applies to the tiers' merged report."""
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
    seconds, the slowest tests of all. ``tiers`` is ``[(name, cases, exit code, seconds), ...]``."""
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
        lines += ["", f"slowest {len(slowest)} tests of all tiers (setup, call and teardown together):"]
        lines += [f"{seconds:8.2f}s {node}" for seconds, node, _ in slowest]
    lines += ["", f"make test: {counts(everything)} in {wall:.0f} s ({wall / 60:.1f} min)"]
    return "\n".join(lines)


def exit_code(codes: list) -> int:
    """Pytest's 5 (no tests) from a tier is fine where another ran tests; any other failure wins."""
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
    # Ctrl-C reaches every pytest process from the terminal, and each stops as pytest does; this runner
    # waits for them. A handler, not SIG_IGN: an ignored signal would stay ignored in the children.
    signal.signal(signal.SIGINT, lambda *_: None)
    # a cache of its own for each tier beside, where there is a cache (pytest warns of the option without one)
    cached = "no:cacheprovider" not in rest
    with tempfile.TemporaryDirectory(prefix="rayrl-test-") as reports:
        xml = {tier: os.path.join(reports, f"{tier}.xml") for tier in ("ray", "apart", "beside")}
        shared = {SHARED_ENV: os.path.join(reports, "shared")}  # made once for every tier (tests/conftest.py)
        # one torch thread beside: in the idle class a thread of two is often preempted, and the other spins at
        # the pair's barriers. Two threads there made the tool caller in 273 s, while the Ray tier's default job
        # beside it took 148 s against 136 without it
        threads = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}
        ray_env = {name: value for name, value in os.environ.items() if name != FAST_ENV}
        start = time.time()

        def aside(tier: str, marks: str, env: dict, **popen) -> tuple:
            log = open(os.path.join(reports, f"{tier}.log"), "w")
            cache = ["-o", f"cache_dir=.pytest_cache/{tier}"] if cached else []
            proc = subprocess.Popen(pytest(["-m", marks, *cache, *rest, f"--junitxml={xml[tier]}"]),
                                    env={**env, **shared, TIER_ENV: tier}, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, **popen)
            return proc, log

        tiers_aside = {"beside": aside("beside", BESIDE_TIER, {**os.environ, **threads, FAST_ENV: "1"},
                                       preexec_fn=lower_priority),
                       "apart": aside("apart", APART_TIER, ray_env)}
        ray_rc = subprocess.Popen(pytest(["-m", RAY_TIER, *rest, f"--junitxml={xml['ray']}"]),
                                  env={**ray_env, **shared, TIER_ENV: "ray"}).wait()
        codes = {"ray": ray_rc}
        for tier, (proc, log) in tiers_aside.items():
            codes[tier] = proc.wait()
            log.close()
        wall = time.time() - start
        headers = {"beside": f'the tests without Ray (-m "{BESIDE_TIER}", {priority_name()}, alongside)',
                   "apart": f'the tests with a Ray of their own (-m "{APART_TIER}", alongside)'}
        for tier, header in headers.items():
            print(f"\n{'=' * 12} {header}", flush=True)
            with open(os.path.join(reports, f"{tier}.log")) as log:
                sys.stdout.write(log.read())
        if junit:
            merge_reports([xml["ray"], xml["beside"], xml["apart"]], junit)
        tiers = [(f'-m "{RAY_TIER}"', read_cases(xml["ray"]), ray_rc, suite_seconds(xml["ray"])),
                 (f'-m "{BESIDE_TIER}" (alongside)', read_cases(xml["beside"]), codes["beside"],
                  suite_seconds(xml["beside"])),
                 (f'-m "{APART_TIER}" (alongside)', read_cases(xml["apart"]), codes["apart"],
                  suite_seconds(xml["apart"]))]
    print("\n" + summary(tiers, durations, wall), flush=True)
    return exit_code([codes[tier] for tier in ("ray", "beside", "apart")])


def main(args: list) -> int:
    if os.environ.get("RAYRL_TEST_ONE_PROCESS") == "1" or chooses_marks(args):
        return subprocess.call(pytest(args))
    return run_tiers(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
