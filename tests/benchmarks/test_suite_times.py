"""benchmarks/suite_times.py: a JUnit report's tests summed by module (a test class counts in its
module), the slowest listed, and an earlier run's column beside."""
from benchmarks.suite_times import markdown, module_seconds, read_report

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
