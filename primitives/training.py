"""One training step on a model that some backend owns (plain torch here, DeepSpeed in a
Ray trainer): ``forward_backward`` then ``optim_step``, as in a Tinker-style backend.

``backward`` is passed in (``loss.backward`` by default, ``engine.backward`` under
DeepSpeed), so the same functions serve one process and a sharded trainer group.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from primitives.logprobs import completion_logprobs, sequence_logprobs
from primitives.losses import LossCounts, sft_loss
from primitives.objectives import LossInputs, policy_objective
from primitives.types import AlgorithmConfig, Batch


def step_counts(batch: Batch, max_len: int = 0) -> LossCounts:
    """Global denominators of a (whole, unsharded) step batch."""
    return LossCounts(num_tokens=batch.num_loss_tokens, num_sequences=batch.size,
                      max_len=max_len or batch.loss_mask.shape[1])


def _default_backward(loss: torch.Tensor) -> None:
    loss.backward()


def add_metrics(total: dict, new: dict) -> dict:
    out = dict(total)
    for k, v in new.items():
        out[k] = out.get(k, 0.0) + v
    return out


def forward_backward(model, batch: Batch, algo: AlgorithmConfig, counts: LossCounts,
                     micro_batch_size: Optional[int] = None, temperature: float = 1.0,
                     backward: Callable = _default_backward, loss_fn: Optional[Callable] = None,
                     loss_scale: float = 1.0) -> dict:
    """Accumulate gradients of the RL loss over ``batch`` in micro-batches.

    Each micro-batch's loss is already divided by the step's global counts, so the
    accumulated gradient is the gradient of the whole step's loss. ``loss_scale``
    compensates a backend that averages gradients over ranks (DeepSpeed: world size).
    ``loss_fn(LossInputs, algo) -> (loss, metrics)`` replaces ``policy_objective``.
    Returns metrics summed over micro-batches (they are built to add up to step values).
    """
    if batch.size == 0:
        raise ValueError("forward_backward: empty batch")
    loss_fn = loss_fn or policy_objective
    device = next(model.parameters()).device
    step = micro_batch_size or batch.size
    if algo.policy_loss == "online_dpo" and step % 2:
        step += 1  # keep (chosen, rejected) pairs in one micro-batch
    t = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    metrics: dict = {}
    model.train()
    for s in range(0, batch.size, step):
        mb = batch.select(range(s, min(s + step, batch.size)))
        logp, entropy = completion_logprobs(model, t(mb.input_ids), t(mb.attention_mask), mb.prompt_len,
                                            temperature, with_entropy=True)
        inputs = LossInputs(logp=logp, old_logp=t(mb.old_logprobs), advantages=t(mb.advantages),
                            mask=t(mb.loss_mask), counts=counts, ref_logp=t(mb.ref_logprobs), entropy=entropy)
        loss, m = loss_fn(inputs, algo)
        backward(loss * loss_scale)
        metrics = add_metrics(metrics, m)
    return metrics


def optim_step(model, optimizer, max_grad_norm: Optional[float] = 1.0, scheduler=None) -> float:
    """Clip gradients, step, zero; returns the pre-clip gradient norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_grad_norm:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        norm = torch.norm(torch.stack([p.grad.detach().norm() for p in params])) if params else torch.tensor(0.0)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def sft_forward_backward(model, input_ids: np.ndarray, attention_mask: np.ndarray, loss_mask: np.ndarray,
                         num_tokens: int, micro_batch_size: Optional[int] = None,
                         backward: Callable = _default_backward, loss_scale: float = 1.0) -> dict:
    """Masked NLL over right-padded SFT samples (loss on ``loss_mask`` targets), accumulated."""
    device = next(model.parameters()).device
    step = micro_batch_size or len(input_ids)
    total = 0.0
    model.train()
    for s in range(0, len(input_ids), step):
        ids = torch.from_numpy(input_ids[s: s + step]).to(device)
        attn = torch.from_numpy(attention_mask[s: s + step]).to(device)
        lm = torch.from_numpy(loss_mask[s: s + step]).to(device)
        logp = sequence_logprobs(model, ids, attn, lm)
        loss = sft_loss(logp, lm[:, 1:], num_tokens)
        backward(loss * loss_scale)
        total += float(loss.detach())
    return {"loss/sft": total, "sft/tokens": float(loss_mask[:, 1:].sum())}


def linear_warmup(base_lr: float, warmup_steps: int):
    """``lr_schedule(step)``: linear ramp to ``base_lr`` over ``warmup_steps``, then constant."""
    def lr_schedule(step: int) -> float:
        return base_lr * min(1.0, (step + 1) / max(warmup_steps, 1))

    return lr_schedule
