"""Batched sampling from a Hugging Face causal LM with per-token behaviour logprobs.

Why our own decode loop over ``model(...)`` with a KV cache rather than ``model.generate``:
the behaviour logprob of each token must be exactly what the trainer recomputes
(``log_softmax(logits / temperature)``, the same position ids from the same attention
mask), sampling must be seedable per call, and stop strings are checked per row.

Layout: prompts are left-padded; position ids are ``cumsum(attention_mask) - 1`` so a
padded prompt sees the same positions as an unpadded one (architecture section 9, pitfall).

Behaviour logprobs are of the full tempered distribution ``softmax(logits / T)``, also with
top-k / top-p: tokens are drawn from the truncated, renormalised distribution, but their
logprobs are not renormalised over the kept set. They mean what the trainer recomputes
(``primitives.model.logprobs``), so with the same weights the importance weight is 1 and it
measures only the gap between the policies (architecture sections 6-7). vLLM's processed logprobs
are renormalised over the kept set; ``cluster.jobs.checks`` refuses vLLM with top-k / top-p where
the importance weight is applied.

The sampling generator lives on the model's device (``draw`` takes its uniforms on the device
of the probabilities, and torch refuses a generator on another one).

Prompts are rendered by ``primitives.model.prompts``; ``primitives.env.rollouts`` takes one
prompt end to end in one process (``create_rollout``) for notebooks.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, NamedTuple, Optional, Sequence

import numpy as np
import torch

from primitives.model import kv_cache, packed_decode, static_decode
from primitives.model.logprobs import log_softmax
from primitives.model.prompts import encode_prompts
from primitives.padding import left_pad, position_ids_from_mask
from primitives.types import GenerationConfig, Rollout, group_id, make_uid


class GenerationOutput(NamedTuple):
    completion_ids: np.ndarray  # (T,) int64, eos included when produced
    logprobs: np.ndarray  # (T,) float32 log_softmax(logits / temperature) of each token (no top-k/top-p renormalising)
    finish_reason: str  # "stop" | "length"
    text: str  # decoded completion, special tokens removed


# Rows with the same prompt prefill it once (``_prefill``); False prefills every row.
SHARE_PREFILL = True


# ----------------------------------------------------------------------------- sampling

def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf. (B, V) -> (B, V)"""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, config: GenerationConfig, generator=None):
    """Pick the next token of each row; returns ``(tokens (B,), logprobs (B,))``.

    The logprob is under ``log_softmax(logits / temperature)`` without the top-k/top-p
    truncation, the same quantity the trainer recomputes (temperature 0 counts as 1): the
    token is drawn from the truncated distribution, its logprob is of the full one (not
    ``log_softmax`` of the filtered logits, which would differ by log(the kept mass)).
    ``generator`` must be on the device of ``logits``.
    """
    temperature = config.temperature if config.temperature > 0 else 1.0
    logp_all = log_softmax(logits, temperature)
    if config.temperature <= 0:
        tokens = logits.argmax(-1)
    else:
        truncated = (0 < config.top_k < logits.shape[-1]) or config.top_p < 1.0
        # top-k, top-p and softmax see logits up to a shift per row: the log-probabilities serve
        probs = filter_logits(logp_all, config.top_k, config.top_p).softmax(-1) if truncated else logp_all.exp()
        tokens = draw(probs, generator)
    return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1)


def draw(probs: torch.Tensor, generator=None) -> torch.Tensor:
    """One token per row of ``probs`` (B, V; rows need not sum to 1), by inverse CDF: one uniform
    per row against the row's cumulative sum in float64 (error ~V x 1e-16, where float32's ~V x 6e-8
    would misweigh rare tokens). ``torch.multinomial`` draws V exponentials per row instead, which
    on a CPU cost 45 ms a decode step for 32 rows of a 49k vocabulary, against about 3 here. A token
    of probability 0 is never drawn: rounding that lands past the last boundary takes the last
    token with mass. On a device without float64 (Apple's MPS) the uniform is drawn there in
    float32 and the sums are taken on the CPU."""
    wide = float64_device(probs.device)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device,
                   dtype=torch.float64 if wide == probs.device else torch.float32)
    return inverse_cdf(probs.to(wide), u.to(wide, torch.float64)).to(probs.device)


def float64_device(device: torch.device) -> torch.device:
    """``device``, or the CPU where ``device`` has no float64 (MPS)."""
    return torch.device("cpu") if device.type == "mps" else device


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row whose cumulative mass first exceeds ``u`` (B, 1; in [0, 1]) times the
    row's total; (B,) int64. A row with a NaN or an infinity, or without mass, is refused: it would
    draw one fixed token again and again (``torch.multinomial`` refused it too)."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    bad = ~torch.isfinite(total) | (total <= 0) | (probs < 0).any(-1, keepdim=True)
    if bad.any():
        rows = bad.squeeze(-1).nonzero().squeeze(-1).tolist()
        raise ValueError(f"sampling: the probabilities of row(s) {rows[:8]} hold a NaN, an infinity or a negative "
                         "value, or no mass at all (logits gone non-finite: a diverged update, an overflow in a "
                         "half-precision forward, a broken checkpoint)")
    tokens = torch.searchsorted(cdf, u * total, right=True).clamp(max=probs.shape[-1] - 1)
    empty = probs.gather(-1, tokens) <= 0
    if empty.any():  # rare: looked for only then (a pass over (B, V) that cost 4 ms a decode step on SmolLM2)
        last = (cdf < total).sum(-1, keepdim=True)  # the first index reaching the total: the last with mass
        tokens = torch.where(empty, last, tokens)
    return tokens.squeeze(-1)


def check_sampler_device(generator: Optional[torch.Generator], device: torch.device,
                         config: GenerationConfig) -> None:
    """A sampling generator on another device than the model is refused before any forward,
    naming both: the sampler draws on the probabilities' device."""
    if generator is None or config.temperature <= 0 or generator.device.type == device.type:
        return
    raise ValueError(f"the sampling generator is on {generator.device} but the model is on {device}: "
                     f"the sampler draws on the model's device; build the generator there, "
                     f"torch.Generator(device={str(device)!r})")


def _stop_cut(tokenizer, ids: list, stops: Sequence[str]) -> Optional[int]:
    """Number of tokens to keep if a stop string has been produced, else None."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not any(s in text for s in stops):
        return None
    for k in range(1, len(ids) + 1):  # shortest prefix that contains a stop string
        if any(s in tokenizer.decode(ids[:k], skip_special_tokens=True) for s in stops):
            return k
    return len(ids)


@torch.no_grad()
def generate_tokens(model, tokenizer, prompt_ids: Sequence[np.ndarray], config: GenerationConfig,
                    generator: Optional[torch.Generator] = None) -> list:
    """Sample one completion for each prompt row (no expansion by ``config.n``).

    Returns a ``GenerationOutput`` per row. A row ends at eos ("stop"), after the first
    stop string it produces ("stop", the stop string kept), or at ``max_new_tokens`` ("length").
    ``generator`` (when sampling, ``temperature > 0``) must be on the model's device.
    """
    if not len(prompt_ids):
        raise ValueError("generate_tokens: no prompts")
    if config.max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {config.max_new_tokens}")
    device = next(model.parameters()).device
    check_sampler_device(generator, device, config)
    ids_np, mask_np = left_pad(prompt_ids, tokenizer.pad_token_id)
    ids, mask = torch.from_numpy(ids_np).to(device), torch.from_numpy(mask_np).to(device)
    B, eos = ids.shape[0], tokenizer.eos_token_id
    out_tokens = torch.full((B, config.max_new_tokens), tokenizer.pad_token_id, dtype=torch.long)
    out_logp = torch.zeros((B, config.max_new_tokens), dtype=torch.float32)
    lengths = torch.zeros(B, dtype=torch.long)
    reasons = ["length"] * B
    active = torch.ones(B, dtype=torch.bool)
    stop_ids = torch.tensor(([] if eos is None else [eos]) + list(config.stop_token_ids), dtype=torch.long)

    was_training = model.training
    model.eval()
    rows_np = np.concatenate([ids_np, mask_np], 1)
    mode = static_decode.decode_mode(model, config.decode, device, B, config.max_new_tokens)
    with _packed(model, mode, B), kv_cache.grouped_attention():
        steps = decode_steps(model, ids, mask, config, lambda i, m, p: _prefill(model, rows_np, i, m, p), mode)
        feed = None
        for t in range(config.max_new_tokens):
            logits = steps.first() if t == 0 else steps.next(feed, active)
            tokens, logp = sample_next(logits, config, generator)
            tokens, logp = tokens.cpu(), logp.cpu()
            out_tokens[active, t], out_logp[active, t], lengths[active] = tokens[active], logp[active], t + 1
            stopped = active & torch.isin(tokens, stop_ids)
            for i in torch.nonzero(stopped).flatten().tolist():
                reasons[i] = "stop"
            active &= ~stopped
            if config.stop:
                for i in torch.nonzero(active).flatten().tolist():
                    keep = _stop_cut(tokenizer, out_tokens[i, : t + 1].tolist(), config.stop)
                    if keep is not None:
                        active[i], reasons[i], lengths[i] = False, "stop", keep
            if not active.any():
                break
            feed = torch.where(active, tokens, torch.full_like(tokens, tokenizer.pad_token_id))
    model.train(was_training)

    results = []
    for i in range(B):
        n = int(lengths[i])
        comp = out_tokens[i, :n].numpy().astype(np.int64)
        results.append(GenerationOutput(comp, out_logp[i, :n].numpy().astype(np.float32), reasons[i],
                                        tokenizer.decode(comp.tolist(), skip_special_tokens=True)))
    return results


def _packed(model, mode: str, rows: int):
    """``packed_linears`` over the block when ``mode`` is ``packed``, else nothing."""
    return packed_decode.packed_linears(model, rows) if mode == "packed" else nullcontext()


# EagerSteps drops the rows that ended once no more than this share of those decoded still run: a
# copy of the cache's rows (``batch_select_indices``) against a quarter of the rows' products at every
# later step.
COMPACT_SHARE = 0.75


class EagerSteps:
    """The decode of one batch over a ``DynamicCache`` that grows by a column per step (the
    mask too), written in place into room reserved after the prefill (``kv_cache.reserve``):
    ``first()`` prefills, ``next(feed, active)`` makes one step; both return the rows' last
    logits (B, V). ``primitives.model.static_decode.StaticSteps`` is the static-cache twin.

    Rows that ended leave the batch: once at most ``COMPACT_SHARE`` of the rows decoded still
    run, the cache, mask and positions keep only those (``batch_select_indices``; where every
    cache layer is a dynamic one, ``kv_cache.rows_selectable``), and later steps compute only them.
    The rows that left get logits of 0 (their samples are not read), so the sampler still draws one
    number per row of the batch, and every row keeps its stream."""

    def __init__(self, model, ids: torch.Tensor, mask: torch.Tensor, prefill, room: int = 0):
        self.model, self.ids, self.mask, self.prefill, self.room = model, ids, mask, prefill, room
        self.positions = position_ids_from_mask(mask)
        self.past: Any = None  # the cache the prefill returns
        self.rows = torch.arange(ids.shape[0])  # the batch's rows still decoded, in order

    def first(self) -> torch.Tensor:
        self.past, logits = self.prefill(self.ids, self.mask, self.positions)
        kv_cache.reserve(self.past, self.room)
        return logits

    def next(self, feed: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """``feed`` (rows,): the tokens just sampled, pad where a row ended; ``active``: rows still decoding."""
        running = active[self.rows]
        if int(running.sum()) <= COMPACT_SHARE * len(self.rows) and kv_cache.rows_selectable(self.past):
            keep = torch.nonzero(running).flatten()
            self.past.batch_select_indices(keep.to(self.ids.device))
            self.mask, self.positions, self.rows = self.mask[keep], self.positions[keep], self.rows[keep]
            running = running[keep]
        self.mask = torch.cat([self.mask, running[:, None].to(self.mask.device, self.mask.dtype)], dim=1)
        self.positions = self.positions[:, -1:] + 1
        out = self.model(input_ids=feed[self.rows][:, None].to(self.ids.device), attention_mask=self.mask,
                         position_ids=self.positions, past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        logits = out.logits[:, -1, :]
        if len(self.rows) == len(active):
            return logits
        full = logits.new_zeros(len(active), logits.shape[-1])
        full[self.rows.to(logits.device)] = logits
        return full


def decode_steps(model, ids: torch.Tensor, mask: torch.Tensor, config: GenerationConfig, prefill, mode: str):
    """The batch's decode in ``mode`` (``static_decode.decode_mode``): eager (its layers packed or
    not, ``primitives.model.packed_decode``), or over a static cache, compiled or not."""
    if mode in ("eager", "packed"):
        return EagerSteps(model, ids, mask, prefill, config.max_new_tokens - 1)  # the prefill wrote the first column
    forward = static_decode.compiled_forward(model) if mode == "captured" else None
    return static_decode.StaticSteps(model, ids, mask, config.max_new_tokens, prefill, forward)


def _prefill(model, rows_np: np.ndarray, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
    """The prompts' forward: ``(kv cache, last logits (B, V))``, the logits of the last position
    only where the model takes ``logits_to_keep`` (not (B, P, V) of which one column is read: for
    long prompts and large vocabularies the biggest tensor of the call). Rows with the same prompt
    (``rows_np``: ids and mask side by side, equal for equal prompts; a
    group's n samples) run it once and share the cache, copied to each row (``reorder_cache``
    with repeated indices, as beam search reorders it), so a group of 8 prefills 1/8 of the
    tokens. The rows' logits are the same numbers either way, up to the last bits a kernel
    chosen for another batch size may change (on CPU the samples are the same: tested)."""
    from primitives.model.logprobs import takes_logits_to_keep

    last = {"logits_to_keep": 1} if takes_logits_to_keep(model) else {}  # not (B, P, V) logits for one column
    unique, first, inverse = np.unique(rows_np, axis=0, return_index=True, return_inverse=True)
    if SHARE_PREFILL and len(unique) < len(rows_np) and _has_cache_class(model):
        keep = torch.from_numpy(first).to(ids.device)
        out = model(input_ids=ids[keep], attention_mask=mask[keep], position_ids=positions[keep], use_cache=True,
                    **last)
        rows = torch.from_numpy(inverse.reshape(-1)).to(ids.device)
        out.past_key_values.reorder_cache(rows)
        return out.past_key_values, out.logits[:, -1, :][rows]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **last)
    return out.past_key_values, out.logits[:, -1, :]


def _has_cache_class(model) -> bool:
    """A transformers model: its forward returns a ``Cache``, which ``reorder_cache`` copies rows of."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def generate_rollouts(model, tokenizer, items: Sequence, config: GenerationConfig,
                      policy_version: int = 0, generator: Optional[torch.Generator] = None,
                      batch_size: Optional[int] = None) -> list:
    """``config.n`` rollouts per prompt item (a ``PromptItem``), grouped by prompt.

    ``batch_size`` and ``config.max_batch_rows`` cap the rows decoded together (``row_batches``).
    Uids are ``e{epoch}/i{index}/s{k}``.
    """
    if not items:
        raise ValueError("generate_rollouts: no prompt items")
    if config.n < 1:
        raise ValueError(f"GenerationConfig.n must be >= 1, got {config.n}")
    prompt_ids = encode_prompts(tokenizer, [it.prompt for it in items], config.template_kwargs)
    rows = [(it, ids, k) for it, ids in zip(items, prompt_ids) for k in range(config.n)]
    rollouts = []
    with row_batches(model, config, len(rows), batch_size, group=config.n) as batches:
        for batch in batches:
            chunk = rows[batch]
            outs = generate_tokens(model, tokenizer, [ids for _, ids, _ in chunk], config, generator)
            for (it, ids, k), o in zip(chunk, outs):
                rollouts.append(pack_rollout(it, ids, o, k, policy_version))
    return rollouts


@contextmanager
def row_batches(model, config: GenerationConfig, rows: int, batch_size: Optional[int] = None,
                group: int = 1) -> Iterator[list]:
    """Yields the slices of a call's ``rows`` that decode together, in order (sized by ``batch_rows``); the
    decode mode's weight packing (``_packed``) is made once for all of them, and a static cache holds the
    largest batch's rows for all of them (``static_decode.call_rows``)."""
    sizes = batch_rows(rows, config.max_batch_rows, batch_size, group)
    ends = np.cumsum(sizes).tolist()
    mode = static_decode.decode_mode(model, config.decode, next(model.parameters()).device, sizes[0],
                                     config.max_new_tokens)
    with _packed(model, mode, sizes[0]), static_decode.call_rows(model, sizes[0]):
        yield [slice(end - size, end) for end, size in zip(ends, sizes)]


def batch_rows(rows: int, max_batch_rows: int = 0, batch_size: Optional[int] = None, group: int = 1) -> list:
    """The sizes of the batches a call's ``rows`` decode in: one of all of them, or under a cap (the smaller
    of ``max_batch_rows`` and ``batch_size``; 0 or None: none) the fewest batches that keep to it, their
    sizes a unit apart at most, larger first, so that a static cache (rows rounded up to a bucket) serves
    every batch of a call and none is a short remainder. The unit is a group of ``group`` rows (a prompt's
    samples, which share its prefill) where the cap holds one and the rows are whole groups, else a row."""
    if max_batch_rows < 0:
        raise ValueError(f"GenerationConfig.max_batch_rows must be >= 0 (0: every row at once), got {max_batch_rows}")
    if batch_size is not None and batch_size < 0:
        raise ValueError(f"batch_size must be >= 0 (0 or None: no cap of its own), got {batch_size}")
    caps = [c for c in (max_batch_rows, batch_size) if c]
    cap = min(caps) if caps else rows
    if cap >= rows:
        return [rows]
    unit = group if 1 < group <= cap and rows % group == 0 else 1
    units = rows // unit
    batches = -(-units // (cap // unit))
    small, larger = divmod(units, batches)
    return [(small + (b < larger)) * unit for b in range(batches)]


def pack_rollout(item, prompt_ids: np.ndarray, output: GenerationOutput, sample: int = 0,
                 policy_version: int = 0) -> Rollout:
    """A single-turn ``Rollout`` from a prompt item and one generation output."""
    return Rollout(
        uid=make_uid(item.epoch, item.index, sample), group=group_id(item.epoch, item.index),
        prompt=item.prompt, prompt_ids=np.asarray(prompt_ids, dtype=np.int64),
        completion_ids=output.completion_ids,
        loss_mask=np.ones(len(output.completion_ids), dtype=np.float32),
        logprobs=output.logprobs, policy_version=policy_version,
        finish_reason=output.finish_reason, text=output.text, answer=item.answer,
        metadata=dict(item.metadata) if item.metadata else None,
    )


# ----------------------------------------------------------------------------- one process
