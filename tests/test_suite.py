"""``make test``'s runner (``tests/suite.py``): the Ray tests in the foreground, the tests with a Ray of their
own beside them, the rest beside both at a lower priority, every test once, one merged report and one summary."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests import suite
from tests.chaos import TIER_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("args, expected", [
    (["-q", "--durations=25", "--junitxml=/r.xml"], (["-q"], "/r.xml", 25)),
    (["--durations", "0", "-k", "x", "--junit-xml", "r.xml"], (["-k", "x"], "r.xml", 0)),
    (["-p", "no:cacheprovider", "-rfEs"], (["-p", "no:cacheprovider", "-rfEs"], None, None)),
])
def test_the_runner_takes_the_report_options_and_passes_the_rest(args, expected):
    assert suite.split_args(args) == expected


@pytest.mark.parametrize("codes, expected", [([0, 0], 0), ([0, 5], 0), ([5, 0], 0), ([5, 5], 5), ([1, 0], 1),
                                             ([0, 2], 2), ([5, 1], 1), ([3, 1], 3), ([0, 5, 5], 0), ([5, 5, 5], 5),
                                             ([5, 0, 1], 1), ([5, 5, 0], 0)])
def test_the_exit_code_fails_on_any_failure_and_on_no_tests_at_all(codes, expected):
    assert suite.exit_code(codes) == expected


def test_a_mark_of_the_callers_own_runs_one_pytest():
    assert suite.chooses_marks(["-q", "-m", "slow"]) and suite.chooses_marks(["-mslow"])
    assert not suite.chooses_marks(["-q", "--maxfail=1", "-k", "m"])


def _report(path, cases, seconds) -> str:
    """A JUnit report as pytest writes it: ``cases`` of ``(classname, name, seconds, outcome tag or None)``,
    the run's ``seconds``."""
    rows = "".join(f'<testcase classname="{c}" name="{n}" time="{t}">' + (f"<{o} message='m'/>" if o else "")
                   + "</testcase>" for c, n, t, o in cases)
    path.write_text(f'<?xml version="1.0"?><testsuites name="pytest tests"><testsuite name="pytest" '
                    f'time="{seconds}">{rows}</testsuite></testsuites>')
    return str(path)


def test_a_report_names_each_test_as_pytest_does(tmp_path):
    """JUnit's class name is the module's dotted path, a test class's name after it: pytest's node ids back,
    which `make test`'s summary prints and benchmarks/suite_times.py sums by module."""
    report = _report(tmp_path / "r.xml", [("tests.cluster.test_job", "test_a[x.y]", 1.5, None),
                                          ("tests.primitives.test_kl.TestK3", "test_c", 0.25, "skipped"),
                                          ("test_top", "test_d", 0.5, None)], 2.25)
    assert suite.read_cases(report) == [(1.5, "tests/cluster/test_job.py::test_a[x.y]", "passed"),
                                        (0.25, "tests/primitives/test_kl.py::TestK3::test_c", "skipped"),
                                        (0.5, "test_top.py::test_d", "passed")]


def test_the_reports_merge_and_the_summary_counts_both_tiers(tmp_path):
    ray = _report(tmp_path / "ray.xml", [("tests.cluster.test_job", "test_a", 120.5, None),
                                         ("tests.cluster.test_job", "test_b", 3.25, "failure")], 900.4)
    fast = _report(tmp_path / "fast.xml", [("tests.primitives.test_x", "test_c", 7.0, None),
                                           ("tests.primitives.test_x", "test_d", 0.5, "skipped"),
                                           ("tests.primitives.test_x", "test_e", 0.25, "error")], 310.0)
    suite.merge_reports([ray, fast, str(tmp_path / "absent.xml")], str(tmp_path / "all.xml"))
    merged = suite.read_cases(str(tmp_path / "all.xml"))
    assert merged == suite.read_cases(ray) + suite.read_cases(fast)
    assert [outcome for *_, outcome in merged] == ["passed", "failure", "passed", "skipped", "error"]
    assert (suite.suite_seconds(ray), suite.suite_seconds(fast)) == (900.4, 310.0)
    assert suite.suite_seconds(str(tmp_path / "all.xml")) == pytest.approx(1210.4)
    assert suite.suite_seconds(str(tmp_path / "absent.xml")) == 0.0
    text = suite.summary([("ray", suite.read_cases(ray), 1, suite.suite_seconds(ray)),
                          ("fast", suite.read_cases(fast), 1, suite.suite_seconds(fast))], 3, 905.2)
    lines = text.splitlines()
    assert lines[0] == "ray: 1 passed, 1 failed in 900 s (pytest exit code 1)"
    assert lines[1] == "fast: 1 passed, 1 error, 1 skipped in 310 s (pytest exit code 1)"
    assert lines[4:7] == ["  120.50s tests/cluster/test_job.py::test_a", "    7.00s tests/primitives/test_x.py::test_c",
                          "    3.25s tests/cluster/test_job.py::test_b"]
    assert lines[-1] == "make test: 2 passed, 1 failed, 1 error, 1 skipped in 905 s (15.1 min)"
    assert "slowest" not in suite.summary([("ray", [], 5, 1.0)], None, 1.2)
    assert suite.summary([("ray", [], 5, 1.0)], None, 1.2).endswith("make test: no tests in 1 s (0.0 min)")


PROBE = """
import json, os, pytest

def record(name):
    with open(os.path.join(os.path.dirname(__file__), name + ".json"), "w") as f:
        json.dump({"nice": os.nice(0), "policy": os.sched_getscheduler(0), "fast": os.environ.get("RAYRL_FAST_TESTS"),
                   "tier": os.environ.get("%s"), "pid": os.getpid(), "ppid": os.getppid(),
                   "shared": os.environ.get("RAYRL_TEST_SHARED"),
                   "threads": os.environ.get("OMP_NUM_THREADS")}, f)

@pytest.mark.ray
def test_with_ray():
    record("ray")

@pytest.mark.slow
def test_a_job():
    record("slow")

def test_without_ray():
    record("fast")

@pytest.mark.slow
@pytest.mark.no_ray
def test_slow_without_ray():
    record("slow_no_ray")

@pytest.mark.slow
@pytest.mark.apart
def test_apart():
    record("apart")

def test_that_fails():
    assert False
""" % TIER_ENV


def test_each_test_runs_once_in_its_tier_and_the_run_reports_all(tmp_path):
    """A directory of six tests through ``python -m tests.suite``: the Ray and job tests in the
    foreground tier, as asked; the one apart in a process of its own at the same priority; the rest, a slow
    one without Ray too, in the idle scheduling class with Ray refused; each told its tier; one merged
    report; the failure beside fails the run."""
    (tmp_path / "conftest.py").write_text('def pytest_configure(config):\n'
                                          '    config.addinivalue_line("markers", "ray: r")\n'
                                          '    config.addinivalue_line("markers", "slow: s")\n'
                                          '    config.addinivalue_line("markers", "no_ray: n")\n'
                                          '    config.addinivalue_line("markers", "apart: a")\n')
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(PROBE))
    env = dict(os.environ)
    for name in (suite.NICE_ENV, suite.FAST_ENV, "RAYRL_TEST_ONE_PROCESS", "OMP_NUM_THREADS", TIER_ENV):
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-m", "tests.suite", str(tmp_path), "-q", "-p", "no:cacheprovider",
                          f"--junitxml={tmp_path / 'all.xml'}", "--durations=2"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    seen = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("ray", "slow", "fast",
                                                                               "slow_no_ray", "apart")}
    base, policy = os.nice(0), os.sched_getscheduler(0)
    assert {record["nice"] for record in seen.values()} == {base}
    assert seen["ray"]["policy"] == seen["slow"]["policy"] == seen["apart"]["policy"] == policy  # as this one
    assert seen["fast"]["policy"] == seen["slow_no_ray"]["policy"] == os.SCHED_IDLE
    assert seen["ray"]["fast"] is seen["slow"]["fast"] is seen["apart"]["fast"] is None
    assert seen["fast"]["fast"] == seen["slow_no_ray"]["fast"] == "1"
    assert seen["ray"]["pid"] == seen["slow"]["pid"] != seen["fast"]["pid"] == seen["slow_no_ray"]["pid"]
    assert seen["apart"]["pid"] not in (seen["ray"]["pid"], seen["fast"]["pid"])
    assert [seen[name]["tier"] for name in ("ray", "slow", "fast", "slow_no_ray", "apart")] == [
        "ray", "ray", "beside", "beside", "apart"]
    assert seen["fast"]["threads"] == seen["slow_no_ray"]["threads"] == "1"  # one torch thread in the idle class
    assert seen["ray"]["threads"] == seen["slow"]["threads"] == seen["apart"]["threads"] is None  # the caller's
    shared = {record["shared"] for record in seen.values()}  # one directory for every tier, gone after the run
    assert len(shared) == 1 and None not in shared and not os.path.exists(shared.pop())
    names = sorted(node.rsplit("::", 1)[1] for _, node, _ in suite.read_cases(str(tmp_path / "all.xml")))
    assert names == sorted(["test_a_job", "test_slow_without_ray", "test_that_fails", "test_with_ray",
                            "test_without_ray", "test_apart"])
    tail = run.stdout.splitlines()
    assert tail[-1].startswith("make test: 5 passed, 1 failed in ")
    assert "slowest 2 tests of all tiers" in run.stdout and "test_that_fails" in run.stdout
    assert "Unknown config option" not in run.stdout  # no cache option for a run without a cache


def test_a_nice_level_given_replaces_the_idle_class(monkeypatch):
    monkeypatch.setenv(suite.NICE_ENV, "3")
    probe = "import os; print(os.nice(0), os.sched_getscheduler(0))"
    seen = subprocess.run([sys.executable, "-c", probe], preexec_fn=suite.lower_priority, capture_output=True,
                          text=True, timeout=60).stdout.split()
    assert [int(x) for x in seen] == [min(os.nice(0) + 3, 19), os.sched_getscheduler(0)]
    assert suite.priority_name() == "nice 3"
    monkeypatch.delenv(suite.NICE_ENV)
    assert suite.priority_name() == "SCHED_IDLE"


def test_the_scratch_check_leaves_the_live_processes_of_the_other_tiers_alone(monkeypatch, tmp_path):
    """``tests/chaos.py:our_scratch``: a directory of a live process whose environment names another tier is
    that tier's; one of a process that has ended, of this tier, or of none is counted; one gone is not. (This
    test's own tier, under ``make test``, is in its process's environment as /proc shows it, which
    ``monkeypatch`` does not change: the processes here are children started with the environment asked.)"""
    from rl_actors import scratch
    from tests import chaos

    def live(tier):
        env = {k: v for k, v in os.environ.items() if k != TIER_ENV}
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                env={**env, **({TIER_ENV: tier} if tier else {})})

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    others, mine, untiered = live("apart"), live("ray"), live(None)
    dirs = {name: tmp_path / name for name in ("others", "mine", "untiered", "ended")}
    for path in dirs.values():
        path.mkdir()
    owners = {"others": others.pid, "mine": mine.pid, "untiered": untiered.pid, "ended": ended.pid,
              "gone": ended.pid}
    try:
        monkeypatch.setattr(scratch, "ours", lambda roots=None: [(str(tmp_path / n), pid) for n, pid in owners.items()])
        monkeypatch.setenv(TIER_ENV, "ray")
        assert chaos.our_scratch() == [str(dirs[n]) for n in ("mine", "untiered", "ended")]
        monkeypatch.setenv(TIER_ENV, "apart")
        assert chaos.our_scratch() == [str(dirs[n]) for n in ("others", "untiered", "ended")]
        monkeypatch.delenv(TIER_ENV)  # outside make test: a live process of any tier is another run's
        assert chaos.our_scratch() == [str(dirs[n]) for n in ("untiered", "ended")]
    finally:
        for proc in (others, mine, untiered):
            proc.kill()
            proc.wait()


def test_a_mark_of_the_callers_own_runs_one_pytest_as_asked(tmp_path):
    (tmp_path / "conftest.py").write_text('def pytest_configure(config):\n'
                                          '    for m in ("ray", "slow", "no_ray", "apart"):\n'
                                          '        config.addinivalue_line("markers", m + ": m")\n')
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(PROBE))
    # as a caller outside make test runs it (this test may run in a tier of make test, whose name it inherits)
    env = {k: v for k, v in os.environ.items() if k not in (suite.FAST_ENV, "RAYRL_TEST_ONE_PROCESS", TIER_ENV)}
    run = subprocess.run([sys.executable, "-m", "tests.suite", str(tmp_path), "-q", "-p", "no:cacheprovider",
                          "-m", "ray"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["ray.json"]  # that test alone
    seen = json.loads((tmp_path / "ray.json").read_text())
    assert seen["fast"] is None and seen["tier"] is None and seen["policy"] == os.sched_getscheduler(0)
    assert "make test:" not in run.stdout  # pytest's own report, no second tier


@pytest.mark.parametrize("env, cpus, expected", [
    ({}, 2, {}),  # one pytest process: torch's default
    ({"PYTEST_XDIST_WORKER_COUNT": "1"}, 2, {}),
    ({"PYTEST_XDIST_WORKER_COUNT": "2"}, 2, {"OMP_NUM_THREADS": "1"}),
    ({"PYTEST_XDIST_WORKER_COUNT": "3"}, 8, {"OMP_NUM_THREADS": "2"}),  # the share, rounded down
    ({"PYTEST_XDIST_WORKER_COUNT": "16"}, 2, {"OMP_NUM_THREADS": "1"}),  # never 0
    ({"PYTEST_XDIST_WORKER_COUNT": "2", "OMP_NUM_THREADS": "4"}, 2, {}),  # the caller's own stays
])
def test_each_fast_test_process_takes_its_share_of_the_cores(env, cpus, expected):
    from tests.conftest import worker_threads

    assert worker_threads(env, cpus) == expected


def test_the_fast_tiers_processes_run_torch_at_their_share(tmp_path):
    """``make test-fast``'s processes (pytest-xdist): the share is set before torch reads it, in each."""
    probe = tmp_path / "test_threads.py"
    probe.write_text("import os, pytest\n"
                     "@pytest.mark.parametrize('i', range(4))\n"
                     "def test_threads(i):\n"
                     "    import torch\n"
                     "    assert os.environ['PYTEST_XDIST_WORKER_COUNT'] == '2'\n"
                     f"    assert torch.get_num_threads() == {max(1, len(os.sched_getaffinity(0)) // 2)}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTEST_XDIST_WORKER_COUNT")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
                           "-n", "2", str(probe)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "4 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("env, made", [({}, False), ({"RAYRL_TEST_SHARED": "/s"}, False),  # the Ray tier: its fixture
                                       ({"RAYRL_FAST_TESTS": "1"}, False),  # make test-fast: nothing shared
                                       ({"RAYRL_TEST_SHARED": "/s", "RAYRL_FAST_TESTS": "1"}, True)])
def test_the_tier_beside_makes_the_shared_models_first_and_goes_on_if_it_cannot(env, made, monkeypatch, capsys):
    import cluster.jobs.inputs
    import tests.conftest as conftest

    asked = []
    monkeypatch.setattr(conftest, "made_tool_caller", lambda path: asked.append(path))
    monkeypatch.setattr(conftest, "made_default_policy", lambda path: asked.append(path))
    monkeypatch.setattr(cluster.jobs.inputs, "resolve_model",
                        lambda model, *_, **__: asked.append(model.model_name_or_path))
    monkeypatch.setattr(conftest, "vllm_model_infos", lambda: asked.append("vllm"))
    for name in ("RAYRL_TEST_SHARED", "RAYRL_FAST_TESTS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    here = [_Item("tests/primitives/test_x.py::test_a", ["tmp_path"])]
    elsewhere = [_Item("tests/cluster/test_t.py::test_b", ["tool_caller"]),
                 _Item("tests/cluster/test_p.py::test_c", ["ray_local", "sft_policy"])]
    conftest.make_shared_ahead(here, elsewhere)
    assert asked == (["/s/tool_caller", "smollm2", "vllm", "/s/default_policy"] if made else [])
    if made:
        asked.clear()
        monkeypatch.setattr(conftest, "made_tool_caller", lambda path: 1 / 0)
        conftest.make_shared_ahead(here, elsewhere)  # no raise: the Ray tier's fixture makes it then
        assert "not made ahead (ZeroDivisionError" in capsys.readouterr().out
        assert asked == ["smollm2", "vllm", "/s/default_policy"]  # and the others are made all the same
        asked.clear()
        conftest.make_shared_ahead(here, elsewhere[1:])  # only what some test asks for
        assert asked == ["smollm2", "vllm", "/s/default_policy"]
        asked.clear()
        conftest.make_shared_ahead(here + elsewhere[:1], [])  # a tool test beside; no Ray tests: no SmolLM2
        assert asked == [] and "not made ahead (ZeroDivisionError" in capsys.readouterr().out
        asked.clear()
        conftest.make_shared_ahead(here, [])  # a run of a few Ray-free paths makes nothing
        assert asked == []


WIRING_CONFTEST = """
import os

import pytest

import cluster.jobs.inputs
import tests.conftest as shared
from tests.conftest import pytest_collection_finish, pytest_deselected  # noqa: F401  (the hooks under test)


def made(name):
    with open(os.path.join(os.path.dirname(__file__), "made.txt"), "a") as f:
        f.write(name + "\\n")


shared.made_tool_caller = lambda path: made("tool_caller")
shared.made_default_policy = lambda path: made("default_policy")
shared.vllm_model_infos = lambda: made("vllm")
cluster.jobs.inputs.resolve_model = lambda *args, **kwargs: made("smollm2")


def pytest_configure(config):
    config.addinivalue_line("markers", "ray: r")


@pytest.fixture
def sft_policy():
    return "policy"
"""


@pytest.mark.slow  # three pytest runs that import torch (14 s): beside the Ray tests, not in make test-fast
@pytest.mark.no_ray
def test_the_hooks_make_ahead_what_the_tests_left_to_the_other_tiers_ask_for(tmp_path):
    """``pytest_deselected`` and ``pytest_collection_finish`` as pytest calls them: the tier beside, given the
    Ray tier's test that asks for the policy (left to it by ``-m``), makes SmolLM2, vLLM's information and
    the policy; given only its own tests, nothing; nothing under ``--collect-only``."""
    (tmp_path / "conftest.py").write_text(WIRING_CONFTEST)
    (tmp_path / "test_beside.py").write_text("def test_here():\n    pass\n")
    (tmp_path / "test_ray.py").write_text("import pytest\n\n@pytest.mark.ray\ndef test_there(sft_policy):\n"
                                          "    pass\n")
    env = {**{k: v for k, v in os.environ.items() if k != TIER_ENV},
           suite.SHARED_ENV: str(tmp_path / "shared"), suite.FAST_ENV: "1"}

    def made(*args) -> list:
        (tmp_path / "made.txt").unlink(missing_ok=True)
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not ray",
                              *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        return (tmp_path / "made.txt").read_text().split() if (tmp_path / "made.txt").exists() else []

    assert made(str(tmp_path)) == ["smollm2", "vllm", "default_policy"]
    assert made(str(tmp_path / "test_beside.py")) == []
    assert made(str(tmp_path), "--collect-only") == []


class _Item:
    """What ``pytest_collection_modifyitems`` reads of a collected test."""

    def __init__(self, nodeid: str, fixtures=(), marks=()):
        self.nodeid, self.fixturenames, self.marks = nodeid, list(fixtures), set(marks)

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None

    def add_marker(self, mark) -> None:
        self.marks.add(mark.name)


def test_the_shared_policys_modules_run_late_whole_and_the_own_ray_tests_last():
    """The modules with a test on ``sft_policy`` (made beside the Ray tests, so asked for as late as can be) run
    after the rest, each whole, in their order; the tests that own their Ray after them; a test on the run's Ray
    fixture is a Ray test."""
    import tests.conftest as conftest

    items = [_Item("a.py::t"), _Item("b.py::t1"), _Item("b.py::t2", ["sft_policy"]),
             _Item("b.py::t3", marks=["own_ray"]), _Item("b.py::t4"), _Item("c.py::t", marks=["own_ray"]),
             _Item("d.py::t", ["ray_local"]), _Item("e.py::t", ["sft_policy"])]  # pytest's order: module by module
    conftest.pytest_collection_modifyitems(None, items)
    assert [item.nodeid for item in items] == ["a.py::t", "d.py::t", "b.py::t1", "b.py::t2", "b.py::t4", "e.py::t",
                                               "b.py::t3", "c.py::t"]
    assert [item.nodeid for item in items if "ray" in item.marks] == ["d.py::t"]


def test_vllms_information_is_asked_for_the_runs_model_classes_and_a_failure_named(monkeypatch, tmp_path):
    """``tests/conftest.py:vllm_model_infos``: the architectures it asks vLLM about are the tiny model's and
    SmolLM2's, and a failed subprocess is named with its error. That vLLM's look-up then finds them in its cache
    is measured, not tested here (an engine's look-up and the warm-up each import vLLM, about a minute of this
    tier's time): the first vLLM job of the run took 19 s instead of 52 (docs/testing.md, twenty-second round)."""
    import json

    from transformers import Qwen2ForCausalLM

    import tests.conftest as conftest
    from cluster.jobs.inputs import resolve_model
    from primitives.types import ModelConfig

    smollm2 = resolve_model(ModelConfig("smollm2"), "", seed=0).model_name_or_path
    with open(os.path.join(smollm2, "config.json")) as f:
        assert conftest.VLLM_ARCHITECTURES == (Qwen2ForCausalLM.__name__, *json.load(f)["architectures"])
    failing = tmp_path / "python"
    failing.write_text("#!/bin/sh\necho \"KeyError: 'NoSuchForCausalLM'\" >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(failing))
    with pytest.raises(RuntimeError, match="vLLM's model information: KeyError: 'NoSuchForCausalLM'"):
        conftest.vllm_model_infos(("NoSuchForCausalLM",))
