"""The seeds' plan (seeds/004): ``forward_backward(batch)`` and ``optim_step()`` futures, in one
process and on the Ray trainer group, against a hand-written torch loop and against each other
(1 rank vs 2, ZeRO-2 and 3, rows that do not split evenly); ``run_sft_training`` as printed."""
import asyncio
import copy
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from rl_primitives import PyTorchTrainingBackend, RayTrainingBackend, Sample, TrainingConfig, run_sft_training
from rl_primitives.plan import collate_batch, nll_loss


def grpo_loss(logits, labels, loss_mask, advantages):
    """seeds/004's GRPO loss as printed (its logits and labels already aligned by the backend)."""
    log_probs = F.log_softmax(logits, dim=-1)
    target_log_probs = log_probs.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    masked_log_probs = target_log_probs * loss_mask
    seq_log_probs = masked_log_probs.sum(dim=1) / loss_mask.sum(dim=1).clamp(min=1.0)
    return -(seq_log_probs * advantages).mean()


def batch_of(rows: int, seed: int, length: int = 9) -> dict:
    g = np.random.default_rng(seed)
    ids = g.integers(3, 40, size=(rows, length))
    mask = np.ones((rows, length), np.float32)
    mask[:, :3] = 0  # the prompt
    mask[0, -2:] = 0  # a shorter completion
    return {"input_ids": ids, "labels": ids.copy(), "loss_mask": mask,
            "advantages": g.normal(size=rows).astype(np.float32)}


def by_hand(model, optimizer, batch, clip=1.0) -> tuple:
    """One update as a user writes it in torch: logits at t against the token at t + 1."""
    ids = torch.as_tensor(batch["input_ids"])
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    loss = grpo_loss(logits[:, :-1].float(), ids[:, 1:], torch.as_tensor(batch["loss_mask"])[:, 1:],
                     torch.as_tensor(batch["advantages"]))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), float(norm)


def weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_one_step_equals_a_hand_written_torch_loop(tiny_model_path):
    """forward_backward + optim_step on the plan's GRPO loss: the loss, the gradient norm and every
    weight of a hand-written torch update of the same batch, exactly."""
    mine = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    theirs = copy.deepcopy(mine)
    backend = PyTorchTrainingBackend(mine, torch.optim.AdamW(mine.parameters(), lr=1e-3), grpo_loss)
    opt = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    for step in range(2):
        batch = batch_of(5, step)
        fwd = backend.forward_backward(batch).result()
        opt_metrics = backend.optim_step().result()
        loss, norm = by_hand(theirs, opt, batch)
        assert fwd["loss"] == pytest.approx(loss, rel=1e-6) and fwd["rows"] == 5
        assert opt_metrics["grad_norm"] == pytest.approx(norm, rel=1e-6) and opt_metrics["lr"] == 1e-3
    for (name, a), b in zip(weights(mine).items(), weights(theirs).values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=name)


def test_micro_batches_and_two_calls_accumulate_as_plain_backward_calls(tiny_model_path):
    """Micro-batches of 2 rows give the whole batch's mean (each weighted by its rows); two
    forward_backward calls before a step add their gradients, as two ``backward()`` calls do."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    batch = batch_of(5, 3)
    halves = [{k: v[s] for k, v in batch.items()} for s in (slice(0, 2), slice(2, 5))]

    def gradients(calls, micro):
        model = copy.deepcopy(base)
        backend = PyTorchTrainingBackend(model, torch.optim.SGD(model.parameters(), lr=0.0), grpo_loss,
                                         micro_batch_size=micro)
        losses = [backend.forward_backward(b).result()["loss"] for b in calls]
        return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (whole,), g_whole = gradients([batch], None)
    (micro,), g_micro = gradients([batch], 2)
    assert micro == pytest.approx(whole, rel=1e-6)
    for n in g_whole:
        torch.testing.assert_close(g_micro[n], g_whole[n], rtol=1e-5, atol=1e-7, msg=n)
    two, g_two = gradients(halves, None)
    hand = copy.deepcopy(base)
    for half in halves:  # what a torch user's two backward calls leave
        ids = torch.as_tensor(half["input_ids"])
        logits = hand(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        grpo_loss(logits[:, :-1], ids[:, 1:], torch.as_tensor(half["loss_mask"])[:, 1:],
                  torch.as_tensor(half["advantages"])).backward()
    for n, p in hand.named_parameters():
        torch.testing.assert_close(g_two[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)
    assert len(two) == 2


def test_the_calls_refuse_what_they_cannot_use(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    backend = PyTorchTrainingBackend(model, torch.optim.AdamW(model.parameters(), lr=1e-3), grpo_loss)
    with pytest.raises(RuntimeError, match=r"optim_step\(\) with no forward_backward\(batch\) since the last step"):
        backend.optim_step()
    with pytest.raises(ValueError, match=r"batch must be a dict with 'input_ids'"):
        backend.forward_backward([[1, 2, 3]])
    bad = batch_of(3, 0)
    bad["loss_mask"] = bad["loss_mask"][:, :4]
    with pytest.raises(ValueError, match=r"loss_mask has shape \(3, 4\); expected \(3, 9\), as input_ids"):
        backend.forward_backward(bad)
    with pytest.raises(ValueError, match=r"advantages has shape \(2,\); expected one entry per row \(3, ...\)"):
        backend.forward_backward({**batch_of(3, 0), "advantages": np.zeros(2, np.float32)})
    no_advantages = PyTorchTrainingBackend(model, torch.optim.AdamW(model.parameters()), nll_loss)
    with pytest.raises(ValueError, match=r"loss_fn: .*nll_loss\(logits: .* cannot take "
                                         r"\(logits, labels, loss_mask, advantages=\) \(got an unexpected keyword"):
        no_advantages.forward_backward(batch_of(3, 0))
    fwd = backend.forward_backward(batch_of(3, 0)).result()
    with pytest.raises(KeyError, match=r"'grad_norm' is known after the gradients are reduced and clipped: read it "
                                       r"from backend.optim_step\(\).result\(\)\['grad_norm'\]"):
        fwd["grad_norm"]
    assert asyncio.run(_awaited(backend)) == {"loss", "rows", "grad_norm", "lr"}
    vector = PyTorchTrainingBackend(model, torch.optim.AdamW(model.parameters()), lambda lg, lb, m: m.sum(-1))
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor \(the mean over its rows\), got "
                                         r"Tensor\(3,\)"):
        vector.forward_backward({k: v for k, v in batch_of(3, 0).items() if k != "advantages"})


async def _awaited(backend) -> set:
    """The plan's spelling: the future awaited, and its ``.result()`` awaited."""
    fwd = await backend.forward_backward(batch_of(3, 1))
    opt = await backend.optim_step().result()
    return set(fwd) | set(opt)


def samples_of(n: int, seed: int) -> list:
    g = np.random.default_rng(seed)
    out = []
    for k in range(n):
        ids = g.integers(3, 40, size=6 + k % 3)
        out.append(Sample(ids, ids, np.r_[np.zeros(3), np.ones(len(ids) - 3)]))
    return out


def test_run_sft_training_as_the_plan_prints_it(tiny_model_path, tmp_path, capsys):
    """The plan's SFT loop over the one-process backend: its lines, one metrics dict per step, a
    checkpoint every ``checkpoint_every`` steps; samples of different lengths padded by
    ``collate_batch``, which wraps around the data by the step."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    backend = PyTorchTrainingBackend(model, torch.optim.AdamW(model.parameters(), lr=1e-3), nll_loss,
                                     checkpoint_dir=str(tmp_path))
    samples = samples_of(5, 0)
    metrics = asyncio.run(run_sft_training(backend, samples, TrainingConfig(num_steps=3, batch_size=2, log_every=1,
                                                                            checkpoint_every=2)))
    out = capsys.readouterr().out
    assert "Starting SFT training...\n  Samples: 5\n  Steps: 3\n  Batch size: 2" in out
    assert out.count("Step ") == 3 and "Training complete!" in out
    assert f"Saved checkpoint to {tmp_path / 'step_2'}" in out and os.path.isdir(tmp_path / "step_2")
    assert [m["step"] for m in metrics] == [0, 1, 2] and all(m["grad_norm"] > 0 for m in metrics)
    wrapped = collate_batch(samples, 2, 2)  # step 2 of 5 samples by 2: samples 4 (7 tokens) and 0 (6)
    assert wrapped["input_ids"].shape == (2, 7) and wrapped["input_ids"][0].tolist() == list(samples[4].input_ids)
    assert wrapped["attention_mask"][1].tolist() == [1] * 6 + [0] and wrapped["loss_mask"][1, -1] == 0


def raising_on_marked(logits, labels, loss_mask, advantages):
    """The plan's loss, raising on a batch whose advantages are marked (all 100)."""
    if bool((advantages == 100).all()):
        raise ValueError("a marked batch")
    return grpo_loss(logits, labels, loss_mask, advantages)


def test_a_failed_forward_backward_drops_the_update(tiny_model_path):
    """One process: the gradients of the calls before the failure are dropped with it, and the
    error says so; the next update starts clean."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    backend = PyTorchTrainingBackend(model, torch.optim.SGD(model.parameters(), lr=0.1), raising_on_marked)
    backend.forward_backward(batch_of(3, 0)).result()
    with pytest.raises(ValueError, match="a marked batch") as e:
        backend.forward_backward({**batch_of(3, 1), "advantages": np.full(3, 100, np.float32)})
    assert "the gradients accumulated since the last optim_step were dropped" in "".join(e.value.__notes__)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="no forward_backward"):
        backend.optim_step()


@pytest.mark.ray
@pytest.mark.parametrize("ranks, stage", [(1, 2), (2, 2), (2, 3), (3, 1)])
def test_the_ray_trainer_group_computes_the_one_process_update(ray_local, tiny_model_path, ranks, stage):
    """The same two steps through the trainer group the jobs use and through the one-process
    backend, each step two forward_backward calls (5 rows: shards of 3/2 or 2/2/1; then 2 rows, so
    a third rank has none) and the second step at its own lr: the same losses, gradient norms and
    final weights. An open update refuses an RL or SFT update until it steps; a failed
    forward_backward spoils the update on every rank."""
    from cluster.ray_wing.config import ClusterConfig
    from cluster.ray_wing.groups import fan_out, gather
    from cluster.ray_wing.roles import build_sft_cluster, shutdown_cluster
    from primitives.types import ModelConfig
    from rl_actors.deepspeed_rank import TrainerConfig, adamw

    # adam_eps 1e-6: Adam's first steps are lr * g / (|g| + eps), so where |g| is near eps another summation
    # order over ranks moves a weight by up to lr * dg / (4 eps): test_trainer_zero explains the choice
    cfg = TrainerConfig(zero_stage=stage, lr=1e-3, micro_batch_size=2, adam_eps=1e-6)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    local = PyTorchTrainingBackend(model, adamw(model.parameters(), cfg), raising_on_marked, micro_batch_size=2)
    cluster = build_sft_cluster(ModelConfig(tiny_model_path), ClusterConfig(trainers=ranks, zero_stage=stage), cfg)
    try:
        remote = RayTrainingBackend(cluster, raising_on_marked)
        for step, lr in enumerate((None, 5e-4)):
            for batch in (batch_of(5, 10 + step), batch_of(2, 20 + step)):
                futures = remote.forward_backward(batch)  # under way while this process computes its own
                mine = local.forward_backward(batch).result()
                assert futures.result()["loss"] == pytest.approx(mine["loss"], rel=1e-5)
            theirs, ours = remote.optim_step(lr).result(), local.optim_step(lr).result()
            assert theirs["grad_norm"] == pytest.approx(ours["grad_norm"], rel=1e-5)
            assert theirs["lr"] == ours["lr"] == (lr or 1e-3)
        final = gather(fan_out(cluster.trainers, "full_state"), cluster.timeout_s)[0]
        diffs = np.concatenate([np.abs(final[n] - p.detach().numpy()).ravel() for n, p in model.named_parameters()])
        assert diffs.max() < 0.02 * cfg.lr and diffs.mean() < 1e-3 * cfg.lr, (diffs.max(), diffs.mean())
        remote.forward_backward(batch_of(5, 0)).result()
        with pytest.raises(Exception, match="must be stepped"):
            gather(fan_out(cluster.trainers, "sft_step", *_sft_arrays()), cluster.timeout_s)
        remote.optim_step().result()
        if ranks == 2 and stage == 2:
            with pytest.raises(Exception, match="a marked batch"):
                remote.forward_backward({**batch_of(4, 1), "advantages": np.full(4, 100, np.float32)}).result()
            with pytest.raises(Exception, match="a forward_backward failed part-way here"):
                remote.optim_step().result()
    finally:
        shutdown_cluster(cluster, keep=False)


def _sft_arrays() -> tuple:
    ids = np.arange(3, 12).reshape(1, 9)
    return ids, np.ones_like(ids), np.ones((1, 9), np.float32)
