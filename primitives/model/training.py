"""One training step on a model that some backend owns (plain torch here, DeepSpeed in a
Ray trainer): ``forward_backward`` then ``optim_step``, as in a Tinker-style backend.

``backward`` is passed in (``loss.backward`` by default, ``engine.backward`` under
DeepSpeed), so the same functions serve one process and a sharded trainer group.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import numpy as np
import torch

from primitives.hooks import call_hook
from primitives.maths.algorithms import AlgorithmConfig, pairwise
from primitives.maths.losses import LossCounts, sft_loss
from primitives.maths.metrics import merge_metrics
from primitives.maths.objectives import LossInputs, policy_objective
from primitives.model.logprobs import completion_logprobs, sequence_logprobs
from primitives.model.tied_gradient import folded_tied_gradient
from primitives.types import Batch


def step_counts(batch: Batch) -> LossCounts:
    """Global denominators of one optimizer update's (whole, unsharded) batch. The length
    normaliser is the generation budget the batch carries, not its padded width."""
    return LossCounts(num_tokens=batch.num_loss_tokens, num_sequences=batch.num_loss_sequences,
                      max_len=batch.budget, num_rows=batch.size)


def _default_backward(loss: torch.Tensor) -> None:
    loss.backward()


def _tensor(a, device):
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(device)


def pair_unit(algo: AlgorithmConfig) -> int:
    """Rows that must stay together when a batch is split: 2 keeps (chosen, rejected) pairs whole."""
    return 2 if pairwise(algo) else 1


def micro_batch_rows(micro_batch_size: int, rows: int, unit: int = 1) -> int:
    """Rows per backward pass: ``micro_batch_size`` (0: all ``rows`` at once), rounded up to even
    when rows come in (chosen, rejected) pairs (``unit`` 2), so a pair never spans two passes."""
    step = micro_batch_size or rows
    return step + 1 if unit == 2 and step % 2 else step


def entropy_in_loss(algo: AlgorithmConfig) -> bool:
    """Whether the loss may differentiate through the entropy: the default objective only with an
    entropy bonus (``entropy_coef``); a ``loss_fn`` of the user's always. Otherwise the entropy is a
    metric, made without autograd: the graph keeps no (tokens, V) tensor for it (on a 152k
    vocabulary, 0.6 GB per 1000 scored tokens in fp32)."""
    return bool(algo.entropy_coef) or algo.loss_fn is not policy_objective


def forward_backward(model, batch: Batch, algo: AlgorithmConfig, counts: LossCounts,
                     micro_batch_size: Optional[int] = None, temperature: float = 1.0,
                     backward: Callable = _default_backward, loss_scale: float = 1.0, where: str = "") -> dict:
    """Accumulate gradients of the RL loss over ``batch`` in micro-batches.

    Each micro-batch's loss is already divided by the step's global counts, so the
    accumulated gradient is the gradient of the whole step's loss. ``loss_scale``
    compensates a backend that averages gradients over ranks (DeepSpeed: world size).
    ``temperature`` is the sampling temperature: logprobs are of ``softmax(logits / T)``.
    The loss is ``algo.loss_fn(LossInputs, algo) -> (loss, metrics)``; if it raises, the error
    names it and ``where`` (the trainer's role and rank).
    Returns the micro-batches' metrics merged (``primitives.maths.metrics.merge_metrics``).
    Each micro-batch is scored packed, without its padding, where that saves work
    (``primitives.model.logprobs.use_packing``); the loss sees the same (B, T) layout either way.
    """
    if batch.size == 0:
        raise ValueError("forward_backward: empty batch")
    device = next(model.parameters()).device
    step = micro_batch_rows(micro_batch_size or 0, batch.size, pair_unit(algo))
    entropy_grad = entropy_in_loss(algo)
    parts = []
    model.train()
    with folded_tied_gradient(model):
        for s in range(0, batch.size, step):
            mb = batch.select(range(s, min(s + step, batch.size)))
            logp, entropy = completion_logprobs(model, _tensor(mb.input_ids, device),
                                                _tensor(mb.attention_mask, device), mb.prompt_len, temperature,
                                                with_entropy=True, entropy_grad=entropy_grad)
            inputs = LossInputs(logp=logp, old_logp=_tensor(mb.old_logprobs, device),
                                advantages=_tensor(mb.advantages, device), mask=_tensor(mb.loss_mask, device),
                                counts=counts, behaviour_logp=_tensor(mb.behaviour_logprobs, device),
                                ref_logp=_tensor(mb.ref_logprobs, device), entropy=entropy)
            loss, m = call_hook(algo.loss_fn, "loss_fn", inputs, algo,
                                where=f"{where}, rollouts {mb.rollouts[0].uid}..{mb.rollouts[-1].uid}".lstrip(", "))
            backward(loss * loss_scale)
            parts.append(m)
    return merge_metrics(parts)


@torch.no_grad()
def with_logprobs(model, batch: Batch, field: str = "old_logprobs", temperature: float = 1.0,
                  micro_batch_size: Optional[int] = None) -> Batch:
    """``batch`` with ``field`` set to the model's logprobs of its completion tokens (0 off the
    loss mask), no gradients: ``old_logprobs`` (the clip ratio's denominator when the batch
    gets several optimizer updates) or ``ref_logprobs`` (a reference held by a trainer rank)."""
    if batch.size == 0:
        return batch
    device = next(model.parameters()).device
    logp, _ = completion_logprobs(model, _tensor(batch.input_ids, device), _tensor(batch.attention_mask, device),
                                  batch.prompt_len, temperature, micro_batch_size)
    return batch._replace(**{field: (logp.float().cpu().numpy() * batch.loss_mask).astype(np.float32)})


def with_old_logprobs(model, batch: Batch, temperature: float = 1.0, micro_batch_size: Optional[int] = None) -> Batch:
    """``batch`` with ``old_logprobs`` set to the model's current logprobs (0 off the loss mask)."""
    return with_logprobs(model, batch, "old_logprobs", temperature, micro_batch_size)


def minibatches(batch: Batch, algo: AlgorithmConfig) -> list:
    """``algo.mini_batches`` contiguous parts of ``batch`` (whole units: rows, or pairs for a
    pairwise loss), in order; one part per unit where the batch has fewer units than that. A
    step's rows are not known before it: dynamic sampling keeps only the groups whose rewards
    differ, a pair selector only the prompts with a better and a worse completion, so a step of
    a job planned for 4 mini-batches may bring one pair; it makes one update, not an error
    after everything before it has run."""
    unit = pair_unit(algo)
    if batch.size % unit:
        raise ValueError(f"batch of {batch.size} rows is not a whole number of units of {unit}")
    units = batch.size // unit
    if units == 0:
        raise ValueError("an empty batch has no mini-batches")
    parts = min(algo.mini_batches, units)
    bounds = [unit * (units * k // parts) for k in range(parts + 1)]
    return [batch.select(range(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]


def updates_of(batch: Batch, algo: AlgorithmConfig, prepare: Callable[[Batch, bool], Batch]) -> list:
    """The optimizer updates of one rollout batch, in order: ``(part, counts)`` pairs.

    ``algo.ppo_epochs`` passes over ``algo.mini_batches`` contiguous mini-batches (``minibatches``:
    fewer for a batch with fewer units), in the same order each pass (groups stay together).
    ``counts`` are each mini-batch's global counts.
    ``prepare(mini_batch, fix_old)`` runs once per mini-batch before any update - a trainer
    rank takes its shard there - and must set ``old_logprobs`` when ``fix_old`` is true (the
    policy moves within the batch, so the clip ratio's denominator is fixed first). A
    mini-batch with no loss tokens (all rows masked) is skipped: Adam would still move the
    weights on its zero gradient.
    """
    parts = minibatches(batch, algo)
    fix_old = algo.ppo_epochs * len(parts) > 1
    prepared = [prepare(part, fix_old) for part in parts]
    counts = [step_counts(part) for part in parts]
    order = [k for _ in range(algo.ppo_epochs) for k in range(len(parts))]
    return [(prepared[k], counts[k]) for k in order if counts[k].num_tokens > 0]


def train_on_batch(model, optimizer, batch: Batch, algo: AlgorithmConfig, temperature: float = 1.0,
                   max_grad_norm: Optional[float] = 1.0, micro_batch_size: Optional[int] = None,
                   lr: Optional[float] = None) -> list:
    """One rollout batch in one process: the updates of ``updates_of``, each a
    ``forward_backward`` and an ``optim_step``. With a single update the old logprobs are
    ``logp.detach()``. Returns one metric dict per update; ``primitives.maths.metrics.mean_over_updates``
    summarises them. ``lr`` (if given) is set on every parameter group first."""
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr

    def prepare(part: Batch, fix_old: bool) -> Batch:
        return with_old_logprobs(model, part, temperature, micro_batch_size) if fix_old else part

    updates = []
    for part, counts in updates_of(batch, algo, prepare):
        m = forward_backward(model, part, algo, counts, micro_batch_size, temperature)
        m["grad_norm"] = optim_step(model, optimizer, max_grad_norm)
        m["lr"] = float(optimizer.param_groups[0]["lr"])
        updates.append(m)
    return updates


def enable_gradient_checkpointing(module, role: str) -> None:
    """Recompute each decoder layer's activations in the backward instead of keeping them from the
    forward (transformers' gradient checkpointing, non-reentrant: it takes keyword inputs such as a packed
    forward's 4-D mask, and needs no input that requires grad, so a LoRA model's frozen embedding is
    fine). A layer's kept activations go from all its intermediate tensors to its input; the backward runs
    each layer's forward once more. The same gradients (recomputed in the same order). In eval mode (a
    trainer rank generating, a reference forward) and without grad nothing is recomputed. ``module``: an
    HF model, a PEFT model around one, or a ``ValueModel`` (its ``backbone``). ``role`` names the actor
    in the error for a model that cannot."""
    target = getattr(module, "backbone", module)
    if not getattr(target, "supports_gradient_checkpointing", False):
        raise ValueError(f"{role}: cluster.gradient_checkpointing, but {type(target).__name__} does not support "
                         "gradient checkpointing (transformers' supports_gradient_checkpointing); set it to false")
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def fused_adamw(params, **settings) -> torch.optim.AdamW:
    """torch's AdamW (``settings``: lr, betas, eps, weight_decay), fused where every parameter
    allows it (floating tensors on CPU or CUDA): one kernel per tensor. torch's default on CPU
    steps each tensor through a loop of ops: SmolLM2's 272 tensors took 211-384 ms a step against
    68 ms fused, the same update up to float rounding (``benchmarks/bench_optimizer.py``)."""
    params = [dict(p, params=list(p["params"])) if isinstance(p, dict) else p for p in params]  # groups read twice
    items = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    tensors = [t[1] if isinstance(t, tuple) else t for t in items]  # named parameters: (name, tensor)
    fused = bool(tensors) and all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors)
    return torch.optim.AdamW(params, fused=fused or None, **settings)


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


def _sft_micro_losses(model, input_ids: np.ndarray, attention_mask: np.ndarray, loss_mask: np.ndarray,
                      num_tokens: int, micro_batch_size: Optional[int]):
    """Each micro-batch's masked NLL share: its target tokens' NLL divided by ``num_tokens``."""
    device = next(model.parameters()).device
    step = micro_batch_size or len(input_ids)
    for s in range(0, len(input_ids), step):
        ids = torch.from_numpy(input_ids[s: s + step]).to(device)
        attn = torch.from_numpy(attention_mask[s: s + step]).to(device)
        lm = torch.from_numpy(loss_mask[s: s + step]).to(device)
        logp = sequence_logprobs(model, ids, attn, lm)
        yield sft_loss(logp, lm[:, 1:], num_tokens)


def sft_forward_backward(model, input_ids: np.ndarray, attention_mask: np.ndarray, loss_mask: np.ndarray,
                         num_tokens: int, micro_batch_size: Optional[int] = None,
                         backward: Callable = _default_backward, loss_scale: float = 1.0) -> dict:
    """Masked NLL over right-padded SFT samples (loss on ``loss_mask`` targets), accumulated."""
    total = 0.0
    model.train()
    with folded_tied_gradient(model):
        for loss in _sft_micro_losses(model, input_ids, attention_mask, loss_mask, num_tokens, micro_batch_size):
            backward(loss * loss_scale)
            total += float(loss.detach())
    return {"loss/sft": total, "sft/tokens": float(loss_mask[:, 1:].sum())}


@torch.no_grad()
def sft_eval_loss(model, input_ids: np.ndarray, attention_mask: np.ndarray, loss_mask: np.ndarray,
                  num_tokens: int, micro_batch_size: Optional[int] = None) -> dict:
    """This part's share of the held-out masked NLL (``eval/loss_sft``; shares of all parts add
    up to the mean NLL per target token when ``num_tokens`` is the global target count)."""
    model.eval()
    total = sum(float(loss) for loss in _sft_micro_losses(model, input_ids, attention_mask, loss_mask, num_tokens,
                                                          micro_batch_size))
    return {"eval/loss_sft": total, "eval/sft_tokens": float(loss_mask[:, 1:].sum())}


ROW_ARRAYS = ("input_ids", "attention_mask", "labels", "loss_mask")


def loss_fn_forward_backward(model, arrays: dict, loss_fn: Callable, global_rows: int,
                             micro_batch_size: Optional[int] = None, backward: Callable = _default_backward,
                             loss_scale: float = 1.0) -> dict:
    """A loss of the user's over ``arrays``, accumulated (the seeds' plan: ``backend.forward_backward``).

    ``arrays``: ``input_ids`` (B, L) and optionally ``attention_mask`` (ones), ``labels`` (the
    ids) and ``loss_mask`` (ones), plus any array with one entry per row (``advantages`` (B,)).
    Each micro-batch calls ``loss_fn(logits, labels, loss_mask, **others)`` with the targets
    aligned to their logits: ``logits[:, :-1]`` (float32) with ``labels[:, 1:]`` and
    ``loss_mask[:, 1:]`` - position t predicts token t + 1. ``loss_fn`` returns the mean over the
    rows it is given; each micro-batch's is weighted by its rows / ``global_rows``, so the shares
    of every micro-batch on every rank add up to the mean over the whole batch (``loss``)."""
    device = next(model.parameters()).device
    rows = len(arrays["input_ids"])
    step = micro_batch_size or rows or 1
    total = 0.0
    model.train()
    with folded_tied_gradient(model):
        for s in range(0, rows, step):
            part = {k: torch.as_tensor(np.asarray(v[s: s + step])).to(device) for k, v in arrays.items()}
            share = len(part["input_ids"]) / global_rows * _user_loss(model, part, loss_fn)
            backward(share * loss_scale)
            total += float(share.detach())
    return {"loss": total, "rows": float(rows)}


def _user_loss(model, part: dict, loss_fn: Callable) -> torch.Tensor:
    """``loss_fn`` on one micro-batch's arrays (``loss_fn_forward_backward``), checked to be a scalar."""
    ids = part.pop("input_ids")
    attn = part.pop("attention_mask", None)
    labels = part.pop("labels", ids)
    mask = part.pop("loss_mask", torch.ones_like(ids))
    logits = model(input_ids=ids, attention_mask=attn if attn is not None else torch.ones_like(ids),
                   use_cache=False).logits
    loss = call_hook(functools.partial(loss_fn, **part) if part else loss_fn, "loss_fn", logits[:, :-1].float(),
                     labels[:, 1:], mask[:, 1:].float())
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        raise ValueError(f"loss_fn must return a scalar tensor (the mean over its rows), got "
                         f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
    return loss


def linear_warmup(base_lr: float, warmup_steps: int):
    """``lr_schedule(step)``: linear ramp to ``base_lr`` over ``warmup_steps``, then constant."""
    def lr_schedule(step: int) -> float:
        return base_lr * min(1.0, (step + 1) / max(warmup_steps, 1))

    return lr_schedule
