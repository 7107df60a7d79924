"""The default job on Ray (examples/grpo_tiny.py): SFT with train_sft, then GRPO with train on
2 generators, a 2-rank ZeRO-2 trainer group, a reward and a reference worker; accuracy rises."""
import glob
import json
import os
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.mark.slow
def test_default_ray_job_lifts_heldout_accuracy(tmp_path):
    import grpo_tiny
    import ray

    ray.shutdown()
    out = str(tmp_path / "run")
    try:
        summary = grpo_tiny.main(["--out", out, "--rl-steps", "40", "--heldout", "128", "--eval-every", "20"])
    finally:
        ray.shutdown()
    assert summary["accuracy_after_rl"] >= summary["accuracy_before_rl"] + 0.10
    assert summary["reward_mean_last5"] > summary["reward_mean_first5"]
    assert (summary["generators"], summary["trainer_ranks"], summary["zero_stage"]) == (2, 2, 2)
    assert summary["reference_worker"] is True
    for phase in ("generate", "reward", "ref", "train", "sync"):
        assert summary[f"time_{phase}_mean_s"] > 0
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["rl_steps"] == 40
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [19, 39]
    assert os.path.isfile(os.path.join(out, "curves.png"))
    # every evaluation (before RL, steps 20 and 40) wrote one greedy sample per held-out item
    assert [r["step"] for r in rows if "eval/reward_mean" in r] == [19, 39]
    samples = {os.path.basename(p): [json.loads(line) for line in open(p)]
               for p in glob.glob(os.path.join(out, "samples", "step_*.jsonl"))}
    assert sorted(samples) == ["step_0.jsonl", "step_20.jsonl", "step_40.jsonl"]
    for records in samples.values():
        assert len(records) == 128 and len({r["uid"] for r in records}) == 128
        assert {"prompt", "completion", "answer", "reward", "reward_components", "uid", "step"} <= set(records[0])
    assert sum(r["reward"] >= 1.0 for r in samples["step_40.jsonl"]) / 128 == pytest.approx(
        summary["accuracy_after_rl"], abs=1e-9)
    with open(os.path.join(out, "samples", "pass_at_4_step_40.jsonl")) as f:
        sampled = [json.loads(line) for line in f]
    assert len(sampled) == 4 * 128
    # pass@4 with 4 samples per problem: the share of problems with at least one right sample
    solved = {r["group"] for r in sampled if r["reward"] >= 1.0}
    assert summary["eval/pass@4"] == pytest.approx(len(solved) / 128, abs=1e-12)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(os.path.join(out, "final_model", "hf")) is not None


def test_bad_flags_fail_before_ray(capsys):
    import grpo_tiny

    with pytest.raises(SystemExit):
        grpo_tiny.parse(["--zero-stage", "5", "--generators", "0"])
    err = capsys.readouterr().err
    assert "--zero-stage must be 1, 2 or 3" in err and "--generators must be at least 1" in err


@pytest.mark.slow
def test_checkpoint_then_resume_from_the_command_line(tmp_path):
    import grpo_tiny
    import ray

    out = str(tmp_path / "run")
    short = ["--sft-steps", "20", "--eval-every", "0", "--heldout", "16"]
    ray.shutdown()
    try:
        grpo_tiny.main(["--out", out, "--rl-steps", "2", "--checkpoint-every", "2", *short])
        ckpt = os.path.join(out, "checkpoints", "step_2")
        assert os.path.isfile(os.path.join(ckpt, "train_state.json"))
        assert os.path.isdir(os.path.join(ckpt, "reference")) and os.path.isdir(os.path.join(ckpt, "deepspeed"))
        summary = grpo_tiny.main(["--out", out + "_resumed", "--rl-steps", "3", "--resume", ckpt, *short])
    finally:
        ray.shutdown()
    rows = [json.loads(line) for line in open(os.path.join(out + "_resumed", "metrics.jsonl"))]
    assert [r["step"] for r in rows if "reward/mean" in r] == [2]  # continued at step 2; no SFT again
    assert not any("loss/sft" in r for r in rows)
    assert summary["rl_steps"] == 3
