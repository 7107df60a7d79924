"""The SmolLM2 step's floor (``benchmarks/bench_smollm2.py``), worked by hand."""
import os

import pytest

from tests.conftest import ROOT


def test_step_floor_by_hand(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from bench_smollm2 import step_floor

    # 32 rollouts in groups of 8 (4 prompts of 40 tokens), completions of 10 tokens on average and
    # 16 at most; 1e8 matmul parameters, 1e11 FLOP/s, 5e9 B/s: 4 * 40 + 32 * 10 = 480 tokens
    row = {"batch/rows": 32.0, "response/len_mean": 10.0, "response/len_max": 16.0}
    # generate: max(2e8 * 480 / 1e11 = 0.96, 16 steps * 4e8 B / 5e9 = 1.28); train: 6e8 * 480 / 1e11 = 2.88
    assert step_floor(row, 40.0, 8, 10 ** 8, 1e11, 5e9) == pytest.approx(1.28 + 2.88, rel=1e-12)
    # a faster memory: generation is compute-bound (0.96)
    assert step_floor(row, 40.0, 8, 10 ** 8, 1e11, 5e10) == pytest.approx(0.96 + 2.88, rel=1e-12)
    # generation in bf16 at 4e11 FLOP/s, weights of 2 bytes: max(2e8 * 480 / 4e11 = 0.24, 16 * 2e8 / 5e10 = 0.064)
    assert step_floor(row, 40.0, 8, 10 ** 8, 1e11, 5e10, 4e11, 2) == pytest.approx(0.24 + 2.88, rel=1e-12)
    # ... and memory-bound at 5e9 B/s: 16 * 2e8 / 5e9 = 0.64
    assert step_floor(row, 40.0, 8, 10 ** 8, 1e11, 5e9, 4e11, 2) == pytest.approx(0.64 + 2.88, rel=1e-12)
