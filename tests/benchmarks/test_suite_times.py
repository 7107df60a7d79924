"""benchmarks/suite_times.py: a JUnit report's tests summed by module (a test class counts in its
module), the slowest listed, and an earlier run's column beside."""
from benchmarks.cpu_probe import busy_seconds
from benchmarks.suite_times import cpu_markdown, markdown, module_seconds, read_cpu, read_report

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.cluster.test_job" name="test_a" time="10.5"/>
<testcase classname="tests.cluster.test_job" name="test_b[x]" time="2.0"/>
<testcase classname="tests.primitives.test_kl.TestK3" name="test_c" time="0.25"/>
</testsuite></testsuites>"""


def test_module_seconds_and_the_slowest(tmp_path):
    path = tmp_path / "report.xml"
    path.write_text(REPORT)
    cases = read_report(str(path))
    assert module_seconds(cases) == {"tests/cluster/test_job.py": 12.5, "tests/primitives/test_kl.py": 0.25}
    table = markdown(cases, slowest=1)
    assert "| `tests/cluster/test_job.py` | 12 |" in table and "| all (3 tests) | 13 |" in table
    assert "| 10 | `tests/cluster/test_job.py::test_a` |" in table and "test_b" not in table.split("slowest")[1]
    before = markdown(cases[:1], slowest=1, before=cases)
    assert "| `tests/cluster/test_job.py` | 12 | 10 |" in before and "| all (3 -> 1 tests) | 13 | 10 |" in before


def test_busy_cores_by_module_and_the_floor_they_set(tmp_path):
    """Hand-worked: test_job 10 s wall with 18 core-s busy (1.8 cores) and 2 s with 1; the kl test 4 s
    with 1. All: 16 s, 23 core-s; on 2 cores the floor is 11.5 s, so at most 16 / 11.5 = 1.39x faster."""
    path = tmp_path / "cpu.csv"
    path.write_text("tests/cluster/test_job.py::test_a,100.0,10.00,18.00\n"
                    "tests/cluster/test_job.py::test_b[x,y],110.0,2.00,1.00\n"
                    "tests/primitives/test_kl.py::TestK3::test_c,112.0,4.00,4.00\n")
    cpu = read_cpu(str(path))
    assert cpu == {"tests/cluster/test_job.py": [12.0, 19.0], "tests/primitives/test_kl.py": [4.0, 4.0]}
    table = cpu_markdown(cpu, cores=2)
    assert "| `tests/cluster/test_job.py` | 12 | 19 | 1.58 |" in table and "| all | 16 | 23 | 1.44 |" in table
    assert "less than 12 s" in table and "at most 1.39x faster" in table


def test_the_probe_reads_the_machines_busy_seconds(tmp_path):
    """user 100 + nice 20 + system 30 + irq 5 ticks busy; idle 1000 and iowait 45 are not."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 20 30 1000 45 5 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    import benchmarks.cpu_probe as probe

    assert busy_seconds(str(stat)) == 155 / probe.TICKS
