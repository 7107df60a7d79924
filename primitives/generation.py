"""Batched sampling from a Hugging Face causal LM with per-token behaviour logprobs.

Why our own decode loop over ``model(...)`` with a KV cache rather than ``model.generate``:
the behaviour logprob of each token must be exactly what the trainer recomputes
(``log_softmax(logits / temperature)``, the same position ids from the same attention
mask), sampling must be seedable per call, and stop strings are checked per row.

Layout: prompts are left-padded; position ids are ``cumsum(attention_mask) - 1`` so a
padded prompt sees the same positions as an unpadded one (DESIGN section 9, pitfall).

Behaviour logprobs are of the full tempered distribution ``softmax(logits / T)``, also with
top-k / top-p: tokens are drawn from the truncated, renormalised distribution, but their
logprobs are not renormalised over the kept set. They mean what the trainer recomputes
(``primitives.logprobs``), so with the same weights the importance weight is 1 and it
measures only the gap between the policies (DESIGN sections 6-7). vLLM's processed logprobs
are renormalised over the kept set; ``cluster.job`` refuses vLLM with top-k / top-p where
the importance weight is applied.

The sampling generator lives on the model's device (``torch.multinomial`` draws on the
device of the probabilities, and refuses a generator on another one).

``create_rollout`` / ``create_rollouts`` take one prompt end to end in one process (sample,
reference logprobs, reward) for notebooks; training runs through ``cluster.driver.train``.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from primitives.data import PromptItem
from primitives.types import Conversation, GenerationConfig, Message, Rollout, group_id, make_uid


class GenerationOutput(NamedTuple):
    completion_ids: np.ndarray  # (T,) int64, eos included when produced
    logprobs: np.ndarray  # (T,) float32 log_softmax(logits / temperature) of each token (no top-k/top-p renormalising)
    finish_reason: str  # "stop" | "length"
    text: str  # decoded completion, special tokens removed


# ----------------------------------------------------------------------------- prompts

def message_to_dict(m: Message) -> dict:
    d = {"role": m.role, "content": m.content}
    if m.tool_calls:
        d["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    return d


def render_prompt(tokenizer, prompt: Any, tools: Optional[list] = None,
                  template_kwargs: Optional[dict] = None) -> str:
    """Text the model continues: a str as is; a Conversation through the chat template.

    ``template_kwargs``: extra template variables, e.g. ``{"enable_thinking": False}``
    (``primitives.data.chat_template_kwargs`` builds them)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt")
        return prompt
    if isinstance(prompt, Conversation):
        if not prompt.messages:
            raise ValueError("empty conversation")
        if tokenizer.chat_template is None:
            raise ValueError("a Conversation prompt needs a tokenizer with a chat template")
        msgs = [message_to_dict(m) for m in prompt.messages]
        kwargs = dict(template_kwargs or {}, **({"tools": tools} if tools else {}))
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    raise TypeError(f"prompt must be str or Conversation, got {type(prompt).__name__}")


def encode_prompts(tokenizer, prompts: Sequence[Any], template_kwargs: Optional[dict] = None) -> list:
    """Token ids (numpy int64) of each rendered prompt."""
    out = []
    for i, p in enumerate(prompts):
        text = render_prompt(tokenizer, p, template_kwargs=template_kwargs)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if not ids:
            raise ValueError(f"prompt {i} encodes to no tokens: {p!r}")
        out.append(np.asarray(ids, dtype=np.int64))
    return out


def left_pad(seqs: Sequence[np.ndarray], pad_id: int):
    """``(ids (B, P), attention_mask (B, P))`` with every row right-aligned."""
    P = max(len(s) for s in seqs)
    ids = np.full((len(seqs), P), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), P), dtype=np.int64)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, P - len(s):], mask[i, P - len(s):] = s, 1
    return ids, mask


# Rows with the same prompt prefill it once (``_prefill``); False prefills every row.
SHARE_PREFILL = True


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only: ``cumsum(mask) - 1``, 0 on left padding. (B, L)"""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


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
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    if config.temperature <= 0:
        tokens = logits.argmax(-1)
    else:
        probs = filter_logits(logits.float() / temperature, config.top_k, config.top_p).softmax(-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1)


def check_sampler_device(generator: Optional[torch.Generator], device: torch.device,
                         config: GenerationConfig) -> None:
    """A sampling generator on another device than the model is refused before any forward,
    naming both: ``torch.multinomial`` draws on the probabilities' device."""
    if generator is None or config.temperature <= 0 or generator.device.type == device.type:
        return
    raise ValueError(f"the sampling generator is on {generator.device} but the model is on {device}: "
                     f"torch.multinomial draws on the model's device; build the generator there, "
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
    past, step_ids, positions = None, None, position_ids_from_mask(mask)
    for t in range(config.max_new_tokens):
        if t == 0:
            past, logits = _prefill(model, np.concatenate([ids_np, mask_np], 1), ids, mask, positions)
        else:
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                        past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1, :]
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
        step_ids = feed[:, None].to(device)
        mask = torch.cat([mask, active[:, None].long().to(device)], dim=1)
        positions = positions[:, -1:] + 1
    model.train(was_training)

    results = []
    for i in range(B):
        n = int(lengths[i])
        comp = out_tokens[i, :n].numpy().astype(np.int64)
        results.append(GenerationOutput(comp, out_logp[i, :n].numpy().astype(np.float32), reasons[i],
                                        tokenizer.decode(comp.tolist(), skip_special_tokens=True)))
    return results


def _prefill(model, rows_np: np.ndarray, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
    """The prompts' forward: ``(kv cache, last logits (B, V))``. Rows with the same prompt
    (``rows_np``: ids and mask side by side, equal for equal prompts; a
    group's n samples) run it once and share the cache, copied to each row (``reorder_cache``
    with repeated indices, as beam search reorders it), so a group of 8 prefills 1/8 of the
    tokens. The rows' logits are the same numbers either way, up to the last bits a kernel
    chosen for another batch size may change (on CPU the samples are the same: tested)."""
    unique, first, inverse = np.unique(rows_np, axis=0, return_index=True, return_inverse=True)
    if SHARE_PREFILL and len(unique) < len(rows_np) and _has_cache_class(model):
        keep = torch.from_numpy(first).to(ids.device)
        out = model(input_ids=ids[keep], attention_mask=mask[keep], position_ids=positions[keep], use_cache=True)
        rows = torch.from_numpy(inverse.reshape(-1)).to(ids.device)
        out.past_key_values.reorder_cache(rows)
        return out.past_key_values, out.logits[:, -1, :][rows]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
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

    ``batch_size`` caps the rows decoded together. Uids are ``e{epoch}/i{index}/s{k}``.
    """
    if not items:
        raise ValueError("generate_rollouts: no prompt items")
    if config.n < 1:
        raise ValueError(f"GenerationConfig.n must be >= 1, got {config.n}")
    prompt_ids = encode_prompts(tokenizer, [it.prompt for it in items], config.template_kwargs)
    rows = [(it, ids, k) for it, ids in zip(items, prompt_ids) for k in range(config.n)]
    step = batch_size or len(rows)
    rollouts = []
    for start in range(0, len(rows), step):
        chunk = rows[start: start + step]
        outs = generate_tokens(model, tokenizer, [ids for _, ids, _ in chunk], config, generator)
        for (it, ids, k), o in zip(chunk, outs):
            rollouts.append(pack_rollout(it, ids, o, k, policy_version))
    return rollouts


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

def create_rollouts(model, tokenizer, prompt: Any, gen_config: GenerationConfig = GenerationConfig(),
                    ref_model=None, reward_fn: Optional[Callable] = None, aggregate_fn: Optional[Callable] = None,
                    shaping_fn: Optional[Callable] = None,
                    generator: Optional[torch.Generator] = None) -> list:
    """The group of ``gen_config.n`` rollouts of one prompt, in this process: for notebooks
    and for inspecting what the model does. Training at scale goes through
    ``cluster.driver.train``, which batches prompts, spreads work over actors and syncs weights.

    ``prompt``: a str, a ``Conversation`` (needs a chat template), or a ``PromptItem``; a bare
    prompt becomes ``PromptItem(index=0, prompt=prompt)``, so uids are ``e0/i0/s{k}`` and the
    group is ``e0/i0``. ``policy_version`` is 0. Sampling uses ``generator`` when given, else a
    private generator seeded with ``gen_config.seed`` on the model's device, else the global
    torch RNG. A given ``generator`` must be on the model's device.

    ``ref_model`` (same tokenizer): sets ``ref_logprobs (T,)`` - its logprobs of the same
    completion tokens at ``gen_config.temperature``, the temperature the behaviour logprobs
    use (temperature 0, greedy, scores at 1.0, as the behaviour logprobs do). Its dropout is
    switched off in place (``primitives.logprobs.disable_dropout``).

    ``reward_fn`` (``rollout -> float`` or a vector with ``aggregate_fn``; ``shaping_fn(rollout,
    reward) -> float``): sets ``reward`` (and ``reward_vector``) through
    ``primitives.rewards.score_rollout``, after ``ref_logprobs`` so shaping can read them.
    Without it ``reward`` stays None.
    """
    # logprobs and rewards import this module: importing them here keeps the import acyclic
    from primitives.logprobs import rollout_logprobs
    from primitives.rewards import score_rollout

    item = prompt if isinstance(prompt, PromptItem) else PromptItem(index=0, prompt=prompt)
    if generator is None and gen_config.seed is not None:
        device = next(model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(gen_config.seed)
    rollouts = generate_rollouts(model, tokenizer, [item], gen_config, generator=generator)
    if ref_model is not None:
        with torch.no_grad():
            refs = rollout_logprobs(ref_model, rollouts, tokenizer.pad_token_id, gen_config.temperature)
        rollouts = [r._replace(ref_logprobs=lp) for r, lp in zip(rollouts, refs)]
    if reward_fn is not None:
        rollouts = [score_rollout(r, reward_fn, aggregate_fn, shaping_fn) for r in rollouts]
    return rollouts


def create_rollout(model, tokenizer, prompt: Any, gen_config: GenerationConfig = GenerationConfig(),
                   ref_model=None, reward_fn: Optional[Callable] = None, aggregate_fn: Optional[Callable] = None,
                   shaping_fn: Optional[Callable] = None,
                   generator: Optional[torch.Generator] = None) -> Rollout:
    """One completion of ``prompt`` as a ``Rollout``, in this process: for notebooks and for
    inspecting what the model does (``create_rollout(model, tokenizer, "12+34=", gen_config,
    reward_fn=my_reward)``). Training at scale goes through ``cluster.driver.train``.

    The arguments are ``create_rollouts``'s (which see); ``gen_config.n`` must be 1 - a group
    of several completions is ``create_rollouts``.
    """
    if gen_config.n != 1:
        raise ValueError(f"create_rollout makes one completion but gen_config.n is {gen_config.n}; "
                         f"use create_rollouts for a group of n completions")
    return create_rollouts(model, tokenizer, prompt, gen_config, ref_model=ref_model, reward_fn=reward_fn,
                           aggregate_fn=aggregate_fn, shaping_fn=shaping_fn, generator=generator)[0]
