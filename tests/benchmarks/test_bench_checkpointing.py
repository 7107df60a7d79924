"""benchmarks/bench_checkpointing.py on the tiny model: each setting in a process of its own makes its
updates, the two give the same first loss and gradient norm, and the figures print."""
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.no_ray
@pytest.mark.slow  # two processes load the model: the full suite's, not the edit-test loop's
def test_bench_checkpointing_runs_on_the_tiny_model(tiny_model_path):
    """The suite's saved tiny model, so that the benchmark's own process imports no torch to build one."""
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/bench_checkpointing.py", "--model", tiny_model_path,
                           "--repeats", "1",
                           "--rows", "4", "--tokens", "16", "--steps", "1", "--threads", "1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    found = re.search(r"checkpointed / kept: time \d+\.\d+, peak memory (?:\d+\.\d+|n/a \(no growth kept\)); "
                      r"4 rows x 16 tokens in micro-batches of 8; first update's loss (\S+) / (\S+), "
                      r"gradient norm (\S+) / (\S+)$", line)
    assert found, line
    loss, ck_loss, norm, ck_norm = map(float, found.groups())
    assert loss == ck_loss and norm == ck_norm and norm > 0
