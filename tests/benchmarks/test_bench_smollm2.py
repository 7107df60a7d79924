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


def test_the_products_timed_at_the_steps_shapes_are_the_floors(monkeypatch):
    """``product_plan``: per weight, the prefill's one product of the prompts' tokens, the packed decode product
    of the batch's rows ``decode_steps`` times (the weight's own product), and a micro-batch's forward,
    input-gradient and weight-gradient products once per micro-batch: so the FLOPs timed are the floor's, 2
    per matmul parameter of each prompt token and of each of the ``decode_steps`` x rows generated ones, 6 of
    each trained token."""
    import torch

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from bench_smollm2 import product_plan

    shapes, rows, prompt, steps, train_rows, micro = [(6, 4), (3, 6)], 5, 7, 2.5, 9, 2
    generate, train = product_plan(shapes, rows, prompt, steps, train_rows, micro)
    assert len(generate) == 2 * len(shapes) and len(train) == 3 * len(shapes)
    for (out_f, _), prefill, decode in zip(shapes, generate[0::2], generate[1::2]):
        assert prefill[0] == 1 and prefill[1]().shape == (prompt, out_f)
        assert decode[0] == steps and decode[1]().shape == (rows, out_f)
        weight = prefill[1].__defaults__[1]
        torch.testing.assert_close(decode[1](), decode[1].__defaults__[0] @ weight.t(), rtol=1e-5, atol=1e-5)
    for (out_f, in_f), forward, grad_in, grad_w in zip(shapes, train[0::3], train[1::3], train[2::3]):
        assert forward[0] == grad_in[0] == grad_w[0] == micro
        assert forward[1]().shape == (train_rows, out_f) and grad_in[1]().shape == (train_rows, in_f)
        assert grad_w[1]().shape == (out_f, in_f)
