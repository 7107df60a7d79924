"""benchmarks/bench_packed_decode.py on the tiny model in a subprocess (it sets the process up as an
actor's): both modes sample, the packing packs every layer when told to, and the figures print."""
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.no_ray
def test_bench_packed_decode_runs_on_the_tiny_model():
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/bench_packed_decode.py", "--model", "tiny", "--repeats", "1",
                           "--threads", "1", "--min-mib", "0"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    # the benchmark's tiny Qwen2 (the default spec): 3 layers x 7 projections + the head
    assert re.search(r"packed / eager \d+\.\d+ \(median of 1 rounds\); layers of >= 0 MiB packed: 22, in", line), line
    assert re.search(r"\d+ tokens a round; the same tokens in [01] of 1 rounds$", line), line
