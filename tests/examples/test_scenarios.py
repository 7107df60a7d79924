"""The seeds' scenarios (examples/vector_rewards.py, algorithm_switching.py, tool_use.py,
custom_kl_ema.py, custom_pipeline.py), each run for a few steps through its ``main`` on the
test run's Ray (``main`` starts a Ray of its own, and shuts it down, only where none runs).
Each test asserts the scenario's defining behaviour from what was logged (and, for tool use,
from the rollouts sampled)."""
import importlib
import json
import os

import numpy as np
import pytest
import torch

from primitives.io.loggers import read_jsonl_metrics
from tests.conftest import ray_up

pytestmark = pytest.mark.ray  # each scenario on a local Ray


def run_example(name: str, tmp_path, *flags) -> tuple:
    """``(module, summary, metrics rows, out dir)`` of ``examples/<name>.py`` run with ``flags``,
    on the test run's Ray (``ray_up``), which ``main`` joins and leaves up, as it would a notebook's.
    The module is imported as ``examples.<name>``: the Ray actors, which have the repository
    on their path, import the functions it sends them from there."""
    ray = ray_up()
    module = importlib.import_module(f"examples.{name}")
    out = str(tmp_path / name)
    summary = module.main(["--out", out, *flags])
    assert ray.is_initialized()  # main shut down no Ray it had not started
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f) == summary
    return module, summary, read_jsonl_metrics(os.path.join(out, "metrics.jsonl")), out


# ----------------------------------------------------------------------------- vector rewards
def test_vector_rewards_log_every_component_and_their_aggregate(tmp_path):
    """Every step logs reward/<component>, and reward/mean is the user's (linear) aggregator
    applied to the component means: the reward workers aggregated each rollout's vector."""
    module, summary, history, _ = run_example("vector_rewards", tmp_path, "--steps", "3")
    assert [m["step"] for m in history] == [0, 1, 2]
    for m in history:
        components = [m[f"reward/{name}"] for name in module.COMPONENTS]
        assert m["reward/mean"] == pytest.approx(module.correctness_first(components), abs=1e-6)
        assert m["reward/mean"] != pytest.approx(float(np.mean(components)), abs=1e-3)  # not a plain mean
    assert any(m["reward/digits"] > 0 for m in history) and any(m["reward/brief"] > 0 for m in history)
    assert set(summary["reward_last10"]) == {"mean", *module.COMPONENTS}


# ----------------------------------------------------------------------------- algorithm switching
def test_piecewise_switch_grpo_dapo_online_dpo(tmp_path):
    """Two steps each of GRPO, DAPO and online DPO. DAPO's dynamic sampling drops groups whose
    rewards tie and draws more prompts (online DPO here too: a tie makes no pair); online
    DPO's pairs and accuracy come from the trainers."""
    group = 2
    module, summary, history, _ = run_example("algorithm_switching", tmp_path, "--steps", "6", "--phase-steps", "2",
                                              "--group-size", str(group))
    prompts = module.PROMPTS_PER_STEP
    assert [m["algorithm"] for m in history] == ["grpo"] * 2 + ["dapo"] * 2 + ["online_dpo"] * 2
    for m in history[:2]:
        assert m["data/prompts_drawn"] == prompts and m["data/resample_rounds"] == 0 and "dpo/pairs" not in m
        assert m["batch/rows"] == prompts * group
    for m in history[2:]:  # the groups kept (each with a reward spread) and the prompts drawn to find them
        kept = m["batch/rows"] / group
        assert 1 <= kept <= prompts and m["data/prompts_drawn"] >= prompts and m["reward/std"] > 0
        assert (m["data/prompts_drawn"] > kept) == (m["data/resample_rounds"] > 0)  # tied groups were dropped
    assert any(m["data/resample_rounds"] > 0 and m["data/prompts_drawn"] > prompts for m in history[2:])
    for m in history[4:]:
        assert m["dpo/pairs"] >= 1 and m["batch/rows"] == 2 * m["dpo/pairs"] and 0.0 <= m["dpo/accuracy"] <= 1.0
    assert summary["phases"]["dapo"]["steps"] == "2-3" and "dpo/accuracy" in summary["phases"]["online_dpo"]


def test_metric_switch_happens_the_step_after_the_threshold(tmp_path):
    """GRPO until a step's mean reward reaches the threshold, DAPO from the next step on, for
    good (even when the reward falls back below it)."""
    threshold = 0.15
    _, _, history, _ = run_example("algorithm_switching", tmp_path, "--schedule", "metric", "--steps", "12",
                                   "--switch-threshold", str(threshold))
    crossed = [m["step"] for m in history if m["reward/mean"] >= threshold]
    assert crossed and crossed[0] < len(history) - 1, "the reward never reached the threshold before the last step"
    first = crossed[0]
    assert first > 0  # the untrained model's reward is far below it
    assert [m["algorithm"] for m in history] == ["grpo"] * (first + 1) + ["dapo"] * (len(history) - first - 1)


# ----------------------------------------------------------------------------- tool use
def runs_of(mask: np.ndarray) -> list:
    """``[(value, start, end), ...]``: the maximal runs of equal values in ``mask``."""
    cuts = [0] + [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]] + [len(mask)]
    return [(float(mask[a]), a, b) for a, b in zip(cuts, cuts[1:])]


def test_tool_use_masks_tool_tokens_and_keeps_the_conversation(tmp_path, tool_caller):
    """From the tool task's SFT'd model (``--base``, then 5 steps of the example's own warm-up loop)
    the model calls the tools; tool output is in the rollout but masked (loss mask 0, logprob 0) -
    exactly the tool turns of the conversation - and the trainers' logprobs match the generator's on
    the policy tokens; the conversation keeps its roles and the prompt item's metadata survives."""
    from transformers import AutoTokenizer

    from primitives.fixtures.tiny import IM_END, IM_START, SPECIAL_TOKENS

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the warm-up runs in this process; 2 shared cores are slower with 2 threads
    try:
        module, summary, history, out = run_example(
            "tool_use", tmp_path, "--base", tool_caller, "--steps", "2", "--sft-steps", "5", "--sft-batch", "16",
            "--sft-lr", "1e-2")
    finally:
        torch.set_num_threads(threads)
    assert summary["sft_steps"] == 5 and np.isfinite(summary["sft_loss_last"])
    rl = [m for m in history if "algorithm" in m]
    assert len(rl) == 2
    for m in rl:
        assert m["tools/calls_per_rollout"] > 0 and 0.0 <= m["tools/success_rate"] <= 1.0
        assert m["mismatch/max_abs_logp_diff"] < 1e-4
    assert max(m["tools/success_rate"] for m in rl) > 0

    tok = AutoTokenizer.from_pretrained(os.path.join(out, "sft_model"))
    samples = read_jsonl_metrics(os.path.join(out, "samples.jsonl"))
    assert len(samples) == module.SAMPLES
    results = []
    for s in samples:
        meta, mask, logp = s["metadata"], np.asarray(s["loss_mask"]), np.asarray(s["logprobs"])
        assert meta["source_id"].startswith("arith-") and meta["turns"] == len(meta["conversation"])
        conv = meta["conversation"]
        assert conv[0]["role"] == "user" and {m["role"] for m in conv} <= {"user", "assistant", "tool"}
        assert (logp[mask == 0] == 0).all()
        text = {0.0: [], 1.0: []}
        for value, a, b in runs_of(mask):
            text[value].append(tok.decode(s["completion_ids"][a:b], skip_special_tokens=False))
        # policy tokens: exactly the assistant turns as sampled (a turn's closing special token is
        # not in its content: the template writes it); masked tokens: exactly the tool turns
        said = [m["content"] for m in conv if m["role"] == "assistant"]
        assert len(text[1.0]) == len(said)
        assert all(t == c or (t.startswith(c) and t[len(c):] in SPECIAL_TOKENS) for t, c in zip(text[1.0], said))
        tools = [m for m in conv if m["role"] == "tool"]
        assert text[0.0] == [f"{IM_END}\n{IM_START}tool\n<tool_response>{m['content']}</tool_response>{IM_END}\n"
                             f"{IM_START}assistant\n" for m in tools]
        results += tools
    assert results, "no held-out answer called a tool"
    if summary["python_tool"] != "on":
        pytest.skip(f"the python tool part: {summary['python_tool']}")
    assert any(m["name"] == "python" and not m["content"].startswith("error") for m in results)


# ----------------------------------------------------------------------------- custom KL and EMA reference
def test_truncated_kl_in_the_loss_and_an_ema_reference(tmp_path):
    """The trainers' KL term is the truncated k3 (never above the cap, although the plain k3
    of the same tokens is), and the EMA reference follows the policy: at step 1, where both
    runs sample from the same policy, the KL to it is smaller than to a fixed reference."""
    cap = 0.001
    _, summary, history, _ = run_example("custom_kl_ema", tmp_path, "--steps", "3", "--ema-decay", "0.5",
                                         "--kl-threshold", str(cap))
    runs = {name: [m for m in history if m["reference"] == name] for name in ("ema", "fixed")}
    assert all(len(h) == 3 for h in runs.values())
    for m in history:
        assert m["algorithm"] == "grpo_truncated_kl" and 0.0 <= m["loss/kl"] <= cap + 1e-9
    assert any(m["kl/ref_k3"] > 2 * cap for m in runs["fixed"][1:])  # the truncation binds
    ema, fixed = runs["ema"], runs["fixed"]
    assert ema[0]["kl/ref_k3"] == fixed[0]["kl/ref_k3"] == pytest.approx(0.0, abs=1e-6)  # ref = policy at start
    assert ema[1]["reward/mean"] == fixed[1]["reward/mean"]  # the same policy sampled step 1 in both runs
    assert ema[1]["kl/ref_k3"] < 0.5 * fixed[1]["kl/ref_k3"]
    assert summary["mean_over_steps"]["kl/ref_k3"]["ema"] < summary["mean_over_steps"]["kl/ref_k3"]["fixed"]


# ----------------------------------------------------------------------------- a complete custom pipeline
def test_custom_pipeline_functions_by_their_effect(tmp_path):
    """The user's reward, advantage, loss and schedule, by hand on small cases, then each one's
    effect on what the Ray run logged."""
    from primitives.maths.advantages import AdvantageInputs
    from primitives.types import Rollout

    pipeline = importlib.import_module("examples.custom_pipeline")
    rollout = Rollout("u", "g", "12+30=", np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.float32),
                      np.zeros(1, np.float32), text="40 or so", answer="42")
    assert pipeline.closeness(rollout) == pytest.approx(0.98) and pipeline.closeness(rollout._replace(text="x")) == 0
    assert pipeline.closeness(rollout._replace(text="1000")) == 0
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    x = AdvantageInputs(torch.tensor([0.0, 1.0, 1.0, 3.0, 7.0]), ("a", "a", "a", "a", "b"), mask)
    adv, returns = pipeline.rank_advantage(x, None)
    assert returns is None
    torch.testing.assert_close(adv, torch.tensor([[-0.5, -0.5], [0.0, 0.0], [0.0, 0.0], [0.5, 0.5], [0.0, 0.0]]))

    kl_coef, target = 0.05, 0.01
    _, summary, history, _ = run_example("custom_pipeline", tmp_path, "--steps", "3", "--kl-coef", str(kl_coef),
                                         "--kl-target", str(target))
    for m in history:
        assert m["algorithm"] == "reinforce_rank"
        assert abs(m["pipeline/adv_sum"]) < 1e-5 and m["pipeline/adv_abs_max"] <= 0.5 + 1e-6  # centred ranks
        assert m["loss/total"] == pytest.approx(m["loss/policy"] + m["pipeline/kl_coef"] * m["loss/kl"], abs=1e-6)
        assert 0.0 <= m["reward/min"] <= m["reward/max"] <= 1.0
    assert any(m["pipeline/adv_abs_max"] == pytest.approx(0.5) for m in history)
    assert any(m["reward/mean"] > 0 for m in history)
    # the adaptive KL controller: the coefficient each step used follows from the step before
    assert history[0]["pipeline/kl_coef"] == pytest.approx(kl_coef, rel=1e-9)
    for before, now in zip(history, history[1:]):
        error = np.clip(before["loss/kl"] / target - 1.0, -0.2, 0.2)
        assert now["pipeline/kl_coef"] == pytest.approx(before["pipeline/kl_coef"] * (1 + pipeline.KL_GAIN * error),
                                                        rel=1e-6)
    assert history[1]["pipeline/kl_coef"] == pytest.approx((1 - 0.2 * pipeline.KL_GAIN) * kl_coef)  # KL 0 at step 0
    assert summary["kl_coef_first"] == pytest.approx(kl_coef)
