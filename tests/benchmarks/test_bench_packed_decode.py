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
                           "--threads", "1", "--variants", "0"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    # the benchmark's tiny Qwen2 (the default spec): 3 layers x 7 projections + the head
    assert re.search(r"^\| packed, >= 0 MiB +\| \d+\.\d+ +\| \d+\.\d+ +\| 22 in \d+ ms", lines[-2]), lines[-2]
    assert re.search(r"\d+ tokens a round; every variant sampled the eager loop's tokens in [01] of 1 rounds$",
                     lines[-1]), lines[-1]
