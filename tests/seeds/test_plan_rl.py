"""The seeds' plan's RL loop (seeds/004 Phase 3): the data buffer's explicit position, advantages
against a constant baseline, an inference engine that takes the trainers' weights every
``sync_every`` steps from their checkpoint, and ``run_rl_training`` as printed over the one-process
backend and over the Ray trainer group, step for step the same."""
import asyncio

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from primitives.types import GenerationConfig
from rl_primitives import (
    AsyncRolloutManager,
    DataBuffer,
    HFInferenceEngine,
    PyTorchTrainingBackend,
    RayTrainingBackend,
    RLTrainingConfig,
    RolloutConfig,
    Sample,
    compute_advantages,
    compute_reward,
    run_rl_training,
)

PROMPTS = ["12+34=", "5+6=", "70+8=", "1+1=", "9+9="]


def pg_loss(logits, labels, loss_mask, advantages):
    """The plan's loss (its ``grpo_loss``): each row's mean completion logprob times its advantage."""
    logp = F.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    per_row = (logp * loss_mask).sum(1) / loss_mask.sum(1).clamp(min=1.0)
    return -(per_row * advantages).mean()


def odd_length(rollout) -> float:
    return float(len(rollout.text) % 2)


def test_the_data_buffer_serves_in_order_across_epochs_and_resumes_from_its_position():
    buffer = DataBuffer(PROMPTS)
    assert buffer.get_prompts(3) == PROMPTS[:3] and buffer.get_prompts(4) == PROMPTS[3:] + PROMPTS[:2]
    assert (buffer.epoch_id, buffer.sample_offset) == (1, 2)
    shuffled = DataBuffer(PROMPTS, shuffle=True, seed=3)
    first = shuffled.get_prompts(7)
    assert sorted(first[:5]) == sorted(PROMPTS) and first[:5] != PROMPTS  # one epoch: a permutation
    again = DataBuffer(PROMPTS, shuffle=True, seed=3, epoch_id=shuffled.epoch_id,
                       sample_offset=shuffled.sample_offset)
    assert again.get_prompts(6) == shuffled.get_prompts(6)  # a buffer made at the position serves the same
    with pytest.raises(ValueError, match=r"position \(epoch 0, offset 5\) is outside 5 prompts"):
        DataBuffer(PROMPTS, sample_offset=5)


def test_advantages_and_rewards_of_the_plan(tiny_model, tokenizer):
    assert compute_advantages([1.0, 0.0, 0.5], baseline=0.5) == [0.5, -0.5, 0.0]
    sample = Sample(np.arange(3), np.arange(3), np.ones(3))
    assert compute_reward(sample._replace(metadata={"correct": True})) == 1.0
    assert compute_reward(sample._replace(metadata={"reward": 0.25, "correct": True})) == 0.25
    assert compute_reward(sample) == 0.0
    from rl_primitives import create_rollout

    rollout = create_rollout(tiny_model, tokenizer, "1+1=", GenerationConfig(max_new_tokens=3, seed=0))
    assert compute_reward(rollout, odd_length) == odd_length(rollout)  # seeds/003's (rollout, reward_fn)
    with pytest.raises(ValueError, match=r"compute_advantages\(rewards, baseline\) takes numbers. seeds/001's "
                                         r"compute_advantages\(rollouts, normalize=...\) subtracts one mean"):
        compute_advantages([rollout])
    with pytest.raises(ValueError, match=r"compute_reward\(Rollout\): without a reward_fn it grades the plan's"):
        compute_reward(rollout)


def engine_of(path) -> HFInferenceEngine:
    return HFInferenceEngine(path, GenerationConfig(max_new_tokens=4, temperature=1.0), odd_length, seed=7)


def run_plan(backend, engine, steps: int, sync_every: int) -> list:
    buffer = DataBuffer(PROMPTS)
    manager = AsyncRolloutManager(buffer, RolloutConfig(batch_size=3, generate_fn=engine.generate))
    config = RLTrainingConfig(num_steps=steps, sync_every=sync_every, baseline=0.5, log_every=1, checkpoint_every=0)
    return asyncio.run(run_rl_training(backend, buffer, manager, [engine], config))


def test_run_rl_training_as_printed_in_one_process(tiny_model_path, tmp_path, capsys):
    """Four steps, weights to the engine after step 2: the lines the plan prints, the engine's
    samples of the first three steps made at weight version 0 and the last at 1, the engine's
    weights those of the step-2 checkpoint, the samples' loss on the completion alone."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    backend = PyTorchTrainingBackend(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pg_loss,
                                     checkpoint_dir=str(tmp_path))
    engine = engine_of(tiny_model_path)
    seen = []
    generate = engine.generate
    engine.generate = lambda prompts: seen.append(generate(prompts)) or seen[-1]
    metrics = run_plan(backend, engine, 4, 2)
    out = capsys.readouterr().out
    assert "Starting RL training...\n  Steps: 4\n  Weight sync every: 2 steps" in out
    assert out.count("  Synced weights to 1 engines") == 1 and out.count("Step ") == 4
    assert "RL training complete!" in out
    assert [[s.metadata["weight_version"] for s in batch] for batch in seen] == [[0] * 3] * 3 + [[1] * 3]
    rewards = [[s.metadata["reward"] for s in batch] for batch in seen]
    assert [m["mean_reward"] for m in metrics] == pytest.approx([np.mean(r) for r in rewards], abs=1e-12)
    assert [m["data_epoch"] for m in metrics] == [0, 0, 1, 1]  # where each batch began: 3 prompts a step from 5
    step2 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "step_2"))
    for (name, a), b in zip(engine.model.state_dict().items(), step2.state_dict().values()):
        assert torch.equal(a, b), name
    s = seen[0][0]
    prompt_len = int((s.loss_mask == 0).sum())
    assert list(s.input_ids[:prompt_len]) == list(engine.tokenizer("12+34=", add_special_tokens=False).input_ids)
    assert s.loss_mask[prompt_len:].all() and len(s.input_ids) > prompt_len


@pytest.mark.ray
def test_run_rl_training_on_the_ray_trainer_group_equals_one_process(ray_local, tiny_model_path, tmp_path):
    """The same loop over two ZeRO-2 trainer ranks: the same losses, gradient norms and rewards at
    each step; the engine's weights after the sync are the trainers' own (their checkpoint's hf/)."""
    from cluster.ray_wing.config import ClusterConfig
    from cluster.ray_wing.groups import fan_out, gather
    from cluster.ray_wing.roles import build_sft_cluster, shutdown_cluster
    from primitives.types import ModelConfig
    from rl_actors.deepspeed_rank import TrainerConfig, adamw

    cfg = TrainerConfig(lr=1e-3, micro_batch_size=2, adam_eps=1e-6)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    local = run_plan(PyTorchTrainingBackend(model, adamw(model.parameters(), cfg), pg_loss,
                                            checkpoint_dir=str(tmp_path / "local")), engine_of(tiny_model_path), 3, 2)
    cluster = build_sft_cluster(ModelConfig(tiny_model_path), ClusterConfig(trainers=2), cfg)
    try:
        engine = engine_of(tiny_model_path)
        remote = run_plan(RayTrainingBackend(cluster, pg_loss, checkpoint_dir=str(tmp_path / "ray")), engine, 3, 2)
        assert len(remote) == len(local) == 3
        for a, b in zip(remote, local):
            assert a["mean_reward"] == b["mean_reward"]
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        trained = gather(fan_out(cluster.trainers, "full_state"), cluster.timeout_s)[0]
        for name, p in engine.model.named_parameters():
            np.testing.assert_array_equal(p.detach().numpy(), trained[name], err_msg=name)
        assert engine.weight_version == 1
    finally:
        shutdown_cluster(cluster, keep=False)
