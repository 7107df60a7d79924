"""The embedded pretrained model (SmolLM2-135M-Instruct: a real BPE tokenizer, a chat template,
``<|im_end|>`` as end of turn) end to end on Ray: an SFT step on chat data with the loss on
assistant tokens only, then two GRPO steps at T = 0.7 - chat template, generation, reward,
reference, train, weight sync - with generator and trainer logprobs equal to < 1e-4 (fp32)."""
import numpy as np
import pytest

from cluster.loop.sft import SFTRun, train_sft
from cluster.loop.train import Hooks, RLRun, collect, train
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.config import ClusterConfig
from cluster.ray_wing.groups import fan_out, gather
from cluster.ray_wing.roles import build_rl_cluster, shutdown_cluster
from cluster.ray_wing.weights import copy_policy_to_reference, sync_weights
from primitives.env.rewards import vector_reward_fn, weighted_sum_aggregator
from primitives.fixtures.tasks import (
    ArithmeticTaskSpec,
    chat_arithmetic_items,
    chat_arithmetic_reward,
    chat_demonstration,
    make_arithmetic_task,
)
from primitives.io.data import make_prompt_source, prepare_sft_chat
from primitives.maths.algorithms import constant_schedule, grpo
from primitives.types import GenerationConfig
from rl_actors.trainer import TrainerConfig

T = 0.7
GEN = GenerationConfig(max_new_tokens=16, n=4, temperature=T)


def finished_turn(rollout) -> float:
    """1 when the model closed its turn (<|im_end|>) within the budget."""
    return float(rollout.finish_reason == "stop")


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2 as a job loads it: converted once into the model cache, which every job of the run reads."""
    from transformers import AutoTokenizer

    from cluster.jobs.inputs import resolve_model
    from primitives.types import ModelConfig

    path = resolve_model(ModelConfig("smollm2"), "", seed=0).model_name_or_path
    return path, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def items():
    # three-digit sums: the 135M model gets some right and some wrong, so groups have spread
    train_items, _ = make_arithmetic_task(ArithmeticTaskSpec(max_operand=999, num_train=32, num_heldout=1, seed=3))
    return chat_arithmetic_items(train_items)


def test_sft_sample_on_chat_data_has_loss_on_assistant_tokens_only(smollm2, items):
    _, tok = smollm2
    sample = prepare_sft_chat(tok, chat_demonstration(items[0]))
    ids, mask = np.asarray(sample.input_ids), np.asarray(sample.loss_mask) > 0
    # exactly the assistant's reply and the template's end of turn, as one run at the end
    assert tok.decode(ids[mask].tolist()) == items[0].answer + "<|im_end|>\n"
    first = int(mask.argmax())
    assert mask[first:].all() and not mask[:first].any()
    assert "user" in tok.decode(ids[~mask].tolist())


@pytest.fixture(scope="module")
def run(ray_local, smollm2, items):
    path, tok = smollm2
    cfg = ClusterConfig(generators=1, trainers=1, zero_stage=2, call_timeout_s=600)
    # a vector reward (a right sum, a closed turn) so that groups have spread to learn from
    cluster = build_rl_cluster(path, cfg, TrainerConfig(zero_stage=2, lr=1e-5, micro_batch_size=8),
                               vector_reward_fn(chat_arithmetic_reward, finished_turn), with_reference=True,
                               aggregate_fn=weighted_sum_aggregator([1.0, 0.5]))
    try:
        samples = [prepare_sft_chat(tok, chat_demonstration(it)) for it in items[:8]]
        sft = train_sft(RayBackend(cluster), samples, SFTRun(1, 8, lambda s: 1e-5, progress=False))
        sync_weights(cluster, version=0)
        copy_policy_to_reference(cluster)
        gather(fan_out(cluster.trainers, "reset_optimizer", 1e-5), cluster.timeout_s)  # as the default job does
        logged = []
        train(RayBackend(cluster), make_prompt_source(items, seed=1), constant_schedule(grpo(kl_coef=0.01)),
              RLRun(GEN, num_steps=2, prompts_per_step=3, lr_schedule=lambda s: 1e-5,
                    component_names=("correct", "finished"), progress=False),
              hooks=Hooks(logger=logged.append))
        yield cluster, sft, logged
    finally:
        shutdown_cluster(cluster)


def test_sft_then_two_rl_steps_on_the_real_model(run):
    _, sft, logged = run
    assert np.isfinite(sft["loss/sft"]) and sft["loss/sft"] > 0 and sft["sft/tokens"] > 0
    assert [m["step"] for m in logged] == [0, 1]
    assert logged[0]["kl/ref_k3"] < 1e-6  # the reference is the policy until the first update
    assert logged[1]["kl/ref_k3"] > 1e-6  # and the update moved the policy
    for m in logged:
        assert m["mismatch/max_abs_logp_diff"] < 1e-4 and m["mismatch/is_weight_mean"] == pytest.approx(1, abs=1e-4)
        assert 0.0 <= m["reward/mean"] <= 1.5 and np.isfinite(m["loss/policy"]) and np.isfinite(m["grad_norm"])
        # the named components, logged per step, rebuild the aggregated reward (weights 1 and 0.5)
        assert m["reward/correct"] + 0.5 * m["reward/finished"] == pytest.approx(m["reward/mean"], abs=1e-6)
    assert any(m["reward/std"] > 0 for m in logged)  # some group had spread ...
    assert all(m["grad_norm"] > 0 for m in logged if m["reward/std"] > 0)  # ... and moved the policy


def test_generator_and_trainer_agree_under_the_bpe_tokenizer(run, items, smollm2):
    cluster, _, _ = run
    _, tok = smollm2
    rollouts, _ = collect(RayBackend(cluster), items[:3], GEN, with_ref=False)
    assert {r.policy_version for r in rollouts} == {2}
    assert all(r.finish_reason in ("stop", "length") and r.num_tokens > 0 for r in rollouts)
    stopped = [r for r in rollouts if r.finish_reason == "stop"]
    assert all(r.completion_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") for r in stopped)
    trainer = gather(fan_out(cluster.trainers, "logprobs", rollouts, T), cluster.timeout_s)[0]
    assert max(float(np.abs(t - r.logprobs).max()) for t, r in zip(trainer, rollouts)) < 1e-4
