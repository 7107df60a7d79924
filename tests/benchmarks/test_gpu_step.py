"""benchmarks/gpu_step.py as CI runs it, on the CPU, where neither Ray nor vLLM can be imported (as
on a lent GPU machine): both loops train on the same batch from the same weights, so their first
updates agree (loss and gradient norm), the trainer rank decodes over the static cache, every
phase is timed against its floor, and the dated table is appended."""
import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PROBE = """
import json, sys
sys.modules["ray"] = sys.modules["vllm"] = None
sys.path.insert(0, "benchmarks")
import gpu_step
fig = gpu_step.main(["--hidden", "64", "--layers", "2", "--prompts", "4", "--group", "3", "--max-new-tokens", "6",
                     "--micro-batch", "5", "--repeats", "1", "--decode", "static", "--write", sys.argv[1]])
print("FIGURES", json.dumps(fig))
"""


@pytest.mark.no_ray
@pytest.mark.slow  # a DeepSpeed rank in a subprocess: the full suite's, not the edit-test loop's
def test_gpu_step_compares_the_same_work_on_the_cpu(tmp_path):
    out = tmp_path / "benchmarks.md"
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list((tmp_path / "tmp").glob("gpu_step_*"))  # its model's directory went with it
    fig = json.loads(proc.stdout.split("FIGURES", 1)[1])
    assert fig["dtype"] == "float32" and fig["rollouts"] == 12 and fig["micro_batch"] == 5
    assert fig["zero stage (configured, run)"] == "2, 0"  # one fp32 rank: ZeRO-2 configured, run without ZeRO
    # our static cache on the trainer rank (12 rows: 16; 6 + 6 tokens: 64 positions), HF generate's beside it
    assert fig["decode"] == "static" and fig["static cache rows x positions"] == "16x64"
    # 12 rows in micro-batches of 5 (5, 5, 2) in both loops: the same loss and gradient
    assert fig["first update loss ours"] == pytest.approx(fig["first update loss plain"], abs=1e-6)
    assert fig["first update grad_norm ours"] > 0
    assert fig["first update grad_norm ours"] == pytest.approx(fig["first update grad_norm plain"], rel=1e-5)
    assert fig["generate ours tokens"] > 0 and fig["generate plain tokens"] > 0 and fig["trained tokens"] > 0
    for key in ("generate ours/plain (s per token)", "generate ours/floor", "train ours/plain", "train ours/floor"):
        assert math.isfinite(fig[key]) and fig[key] > 0, key
    assert fig["matmul_tflops"] > 0 and fig["memory_gb_s"] > 0
    text = out.read_text()
    assert "ours against a plain loop" in text and "| train ours/plain |" in text
