"""Recompute per-token logprobs (and entropy) of completions under a model.

The trainer differentiates through ``completion_logprobs``; reference workers call it
under ``torch.no_grad``. Position ids come from the attention mask exactly as during
generation, so a left-padded prompt scores the same as an unpadded one.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Optional, Sequence

import numpy as np
import torch

from primitives.model.packing import (
    PackPlan,
    padding_share,
    plan_for,
    scatter_completions,
    supports_packing,
    tree_masks,
)
from primitives.padding import pack_completions, position_ids_from_mask

# Pack a micro-batch when packing leaves out at least this share of its padded tokens
# (padding, each row's last token, a shared prompt's repeats). Packing's own work (the plan, ~0.15 ms for 64 rows; the
# packed mask; the scatter back) is small, so the break-even share is small too: on CPU,
# 1 thread, at 1.6% (SmolLM2, all completions full) packed and padded tie within noise, at
# 9% (tiny model, all completions full) packed is ~2-5% faster, at 27% (the default job)
# 1.35x (train step) and 1.4x (reference) (benchmarks/bench_padding.py). Below 2% there is
# nothing worth saving.
PACK_MIN_SHARE = 0.02


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` in fp32 over the vocabulary (temperature 0: 1). At
    temperature 1 the logits are not divided: the same numbers, without a pass over (rows, V) and its
    backward."""
    t = temperature if temperature > 0 else 1.0
    logits = logits.float()
    return torch.log_softmax(logits if t == 1.0 else logits / t, dim=-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``targets``. (B, T, V), (B, T) -> (B, T)"""
    return log_softmax(logits, temperature).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution at each position. (B, T, V) -> (B, T)"""
    logp = log_softmax(logits, temperature)
    return -(logp.exp() * logp).sum(-1)


def disable_dropout(model) -> None:
    """Set every dropout probability in ``model`` to 0, in place (as TRL and OpenRLHF do).

    Logprobs must be a function of the weights alone: with dropout the trainer's ratio
    and KL compare two random draws. ``nn.Dropout`` modules get ``p = 0``, and so do float
    attributes named ``*dropout*`` (Qwen2's ``attention_dropout``, read at forward time).
    The model's config is left alone, so a saved checkpoint keeps its dropout settings.
    Train mode stays usable (gradient checkpointing needs it).
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)


def check_layout(input_ids, attention_mask, prompt_len: int) -> None:
    """A ``Batch``-layout input: ids and mask of one shape, the prompt inside the sequence."""
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} differ in shape")
    if not 0 < prompt_len < input_ids.shape[1]:
        raise ValueError(f"prompt_len {prompt_len} must lie inside the sequence length {input_ids.shape[1]}")


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                        temperature: float = 1.0, micro_batch_size: Optional[int] = None,
                        with_entropy: bool = False, packing: Optional[bool] = None, share_prompts: bool = True,
                        entropy_grad: bool = True):
    """Logprobs of the completion tokens of a ``Batch``-layout input.

    ``input_ids``/``attention_mask`` are (B, P + T) with prompts left-padded to ``prompt_len``
    (P). Returns ``(logp (B, T), entropy (B, T) or None)``; gradients flow unless the
    caller disables them. ``micro_batch_size`` bounds the rows in one forward pass.
    Dropout is switched off first (``disable_dropout``).

    ``packing``: score each micro-batch packed (``primitives.model.packing``: real tokens only) or
    padded; None chooses per micro-batch (``use_packing``). Both give the same values on real
    completion tokens; off them (right padding) the padded forward gives a value of the pad
    token and the packed one 0: every caller masks those out. ``share_prompts``: when packed,
    rows of a micro-batch with the same prompt (a group) run that prompt once, their
    completions attending to it through a tree mask. ``entropy_grad=False``: the entropy is made
    without autograd (a metric only), which keeps no (tokens, V) tensor for a backward.
    """
    check_layout(input_ids, attention_mask, prompt_len)
    if packing and not supports_packing(model):
        raise ValueError(f"packing=True but {type(getattr(model, 'module', model)).__name__} is not a model packing "
                         f"was checked for (primitives.model.packing.supports_packing); score it padded")
    disable_dropout(model)
    step = micro_batch_size or input_ids.shape[0]
    logps, ents = [], []
    for s in range(0, input_ids.shape[0], step):
        ids, mask = input_ids[s: s + step], attention_mask[s: s + step]
        plan = None
        if packing or (packing is None and use_packing(model, ids, mask, prompt_len, share_prompts)):
            plan = plan_for(model, ids.cpu().numpy(), mask.cpu().numpy(), prompt_len, share_prompts)
        if plan is not None and len(plan.targets):
            logp, ent = _packed_logprobs(model, plan, ids.device, temperature, with_entropy, entropy_grad)
        else:  # padded, also when no row has a completion token to score
            logp, ent = _padded_logprobs(model, ids, mask, prompt_len, temperature, with_entropy, entropy_grad)
        logps.append(logp)
        ents.append(ent)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def use_packing(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                share_prompts: bool = True) -> bool:
    """Pack this micro-batch? When the model takes packed rows (``supports_packing``) and
    packing leaves out at least ``PACK_MIN_SHARE`` of the padded forward's tokens."""
    return supports_packing(model) and padding_share(input_ids.cpu().numpy(), attention_mask.cpu().numpy(),
                                                     prompt_len, share_prompts) >= PACK_MIN_SHARE


def takes_logits_to_keep(model) -> bool:
    module = getattr(model, "module", model)  # a DeepSpeed engine's model
    return "logits_to_keep" in inspect.signature(module.forward).parameters


def _padded_logprobs(model, ids, mask, prompt_len: int, temperature: float, with_entropy: bool,
                     entropy_grad: bool = True):
    """The (B, P + T) rows as they are: position ids from the mask, padding masked out."""
    T = ids.shape[1] - prompt_len
    # logits only where they predict a completion token (the last T + 1 positions, less the last)
    keep = {"logits_to_keep": T + 1} if takes_logits_to_keep(model) else {}
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                   use_cache=False, **keep).logits
    pred = logits[:, -(T + 1): -1]  # position P-1+t predicts completion token t
    logp = token_logprobs(pred, ids[:, prompt_len:], temperature)
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        return logp, token_entropy(pred, temperature)


def _packed_logprobs(model, plan: PackPlan, device, temperature: float, with_entropy: bool,
                     entropy_grad: bool = True):
    """The rows of ``plan`` end to end, logits only at the K positions that predict a
    completion token, then each of the N scored tokens taken from its logit (``plan.source``)
    and scattered back to (B, T). Without shared prompts there is no attention mask:
    transformers reads the sequence starts from the position ids; with them, the tree mask."""
    as_tensor = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    module = getattr(model, "module", model)
    mask = tree_masks(plan, model, device) if plan.shared else None
    columns = np.flatnonzero(plan.keep.any(0))  # the positions some row keeps, in every row
    with head_on_rows(module, as_tensor(plan.keep[:, columns])):
        logits = model(input_ids=as_tensor(plan.input_ids), position_ids=as_tensor(plan.position_ids),
                       attention_mask=mask, use_cache=False, logits_to_keep=as_tensor(columns)).logits
    kept = int(plan.keep.sum())
    if logits.shape[:-1] != (kept,):
        raise ValueError(f"{type(module).__name__} returned logits of shape {tuple(logits.shape)} for {kept} kept "
                         f"positions; score it padded (packing=False)")
    logp_K = log_softmax(logits, temperature)  # (K, V); a prompt's last row serves each completion
    source = as_tensor(plan.source)
    logp = logp_K[source, as_tensor(plan.targets)]  # (N,)
    if not with_entropy:
        return scatter_completions(logp, plan), None
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        ent = scatter_completions(-(logp_K.exp() * logp_K).sum(-1)[source], plan)
    return scatter_completions(logp, plan), ent


@contextmanager
def head_on_rows(module, keep: torch.Tensor):
    """While the block runs, ``module``'s output head gets only the hidden states where ``keep``
    (R, U) is true, row-major: (K, H) in, (K, V) logits out. The head's (R, U, V) logits and the
    boolean pick from them, with its backward (a zeroed (R, U, V) gradient and a scatter), are
    not made: on SmolLM2's 49k vocabulary about 0.1 s of a 32-row train step on CPU. Whatever the
    model does to the logits after the head (a cast, a scale) is element-wise, so it sees the same
    numbers."""
    head = module.get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda _, args: (args[0][keep], *args[1:]))
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def rollout_logprobs(model, rollouts: Sequence, pad_id: int, temperature: float = 1.0,
                     micro_batch_size: Optional[int] = None) -> list:
    """Per-rollout logprob arrays (T_i,) float32 of each rollout's own completion tokens."""
    ids, mask, P, _ = pack_completions([r.prompt_ids for r in rollouts],
                                       [r.completion_ids for r in rollouts], pad_id)
    device = next(model.parameters()).device
    logp, _ = completion_logprobs(model, torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device),
                                  P, temperature, micro_batch_size)
    logp = logp.float().cpu().numpy()
    return [logp[i, : len(r.completion_ids)].astype(np.float32) for i, r in enumerate(rollouts)]


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      loss_mask: torch.Tensor) -> torch.Tensor:
    """SFT layout (right-padded full sequences): logprob of every next token. (B, L) -> (B, L-1)

    ``loss_mask`` is unused here but checked for shape so callers pass the right layout.
    """
    if loss_mask.shape != input_ids.shape:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    disable_dropout(model)
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask), use_cache=False).logits
    return token_logprobs(logits[:, :-1], input_ids[:, 1:])
