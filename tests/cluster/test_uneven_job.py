"""A whole job whose steps do not split evenly over the trainer ranks: 3 prompts x 3 samples
= 9 rows per RL step and SFT batches of 9 rows on 2 ZeRO-2 ranks in micro-batches of 4
(shards of 5 and 4: two backward passes against one). Before every rank made the same
number of passes, gloo aborted the first step with a collective mismatch."""
import json
import math
import os

import pytest

from tests.conftest import ROOT, ray_up

pytestmark = pytest.mark.ray  # a whole job on Ray

DEFAULT = os.path.join(ROOT, "examples", "configs", "default.yaml")


def test_nine_rows_per_step_on_two_zero2_ranks_complete(tmp_path):
    from cluster.jobs.cli import run

    out = str(tmp_path / "run")
    ray_up()
    summary = run(["rl", DEFAULT, "--logging.out", out, "--algorithm.steps", "2", "--algorithm.prompts-per-step",
                   "3", "--generation.group-size", "3", "--cluster.micro-batch-size", "4", "--cluster.trainers",
                   "2", "--cluster.zero-stage", "2", "--sft.steps", "2", "--sft.batch", "9", "--eval.enabled",
                   "False", "--eval.final-pass-k", "0"])
    assert (summary["rl_steps"], summary["trainer_ranks"], summary["zero_stage"]) == (2, 2, 2)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rl = [r for r in rows if "reward/mean" in r]
    sft = [r for r in rows if "loss/sft" in r]
    assert [r["step"] for r in rl] == [0, 1] and len(sft) == 2
    assert all(r["batch/rows"] == 9.0 and math.isfinite(r["grad_norm"]) for r in rl)
    assert all(r["sft/tokens"] > 0 and r["grad_norm"] > 0 for r in sft)
