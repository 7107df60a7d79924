"""The one-process example (grpo_single_process.py): SFT then GRPO lifts held-out accuracy; outputs are written."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.mark.slow
@pytest.mark.no_ray  # one process: under make test it runs beside the Ray tests, where its policy is made
def test_single_process_example_lifts_heldout_accuracy(tmp_path, sft_policy):
    """From the default task's SFT'd policy (``--base``; the example's own 1500-step warm-up is the
    default job's SFT stage over the same ``train_sft`` loop, which made that policy), 10 more SFT
    steps and 40 GRPO steps lift held-out accuracy by 10 points or more (0.617 -> 0.875 from the policy the
    default job's Ray run made; the policy made in one process starts lower)."""
    import grpo_single_process as example

    out = str(tmp_path / "run")
    summary = example.main(["--out", out, "--base", sft_policy, "--sft-steps", "10", "--rl-steps", "40",
                            "--heldout", "128"])
    assert summary["sft_steps"] == 10 and not os.path.exists(os.path.join(out, "base_model"))
    assert summary["accuracy_after_rl"] >= summary["accuracy_before_rl"] + 0.10
    assert summary["reward_mean_last5"] > summary["reward_mean_first5"]
    with open(os.path.join(out, "summary.json")) as f:
        written = json.load(f)
    for key in ("accuracy_before_rl", "accuracy_after_rl", "rl_steps", "wall_s"):
        assert key in written
    assert written["rl_steps"] == 40
    evals = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if "eval/accuracy" in line]
    assert [e["step"] for e in evals] == [19, 39]
    for name in ("metrics.jsonl", "curves.png", "final_model/model.safetensors", "final_model/tokenizer.json"):
        assert os.path.exists(os.path.join(out, name)), name


def test_bad_flags_fail_before_work(capsys):
    import grpo_single_process as example

    with pytest.raises(SystemExit):
        example.parse_args(["--group-size", "1"])
    assert "--group-size must be at least 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        example.parse_args(["--base", "/nonexistent/model"])
    assert "--base /nonexistent/model: not an HF model directory" in capsys.readouterr().err
