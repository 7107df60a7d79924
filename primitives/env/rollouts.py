"""One prompt end to end in this process - sample, score the reference, reward - for notebooks
and for inspecting what a model does (the seeds' ``create_rollout``). Training at scale goes
through ``cluster.loop.train.train``."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from primitives.env.rewards import score_rollout
from primitives.model.generation import GenerationOutput, generate_rollouts, pack_rollout
from primitives.model.logprobs import rollout_logprobs
from primitives.model.prompts import encode_prompts
from primitives.types import GenerationConfig, PromptItem, Rollout


def create_rollouts(model, tokenizer, prompt: Any, gen_config: GenerationConfig = GenerationConfig(),
                    ref_model=None, reward_fn: Optional[Callable] = None, aggregate_fn: Optional[Callable] = None,
                    shaping_fn: Optional[Callable] = None, generator=None,
                    generate_fn: Optional[Callable] = None, tool_parser: Optional[Callable] = None) -> list:
    """The group of ``gen_config.n`` rollouts of one prompt, in this process: for notebooks
    and for inspecting what the model does. Training at scale goes through
    ``cluster.loop.train.train``, which batches prompts, spreads work over actors and syncs weights.

    ``prompt``: a str, a ``Conversation`` (needs a chat template), or a ``PromptItem``; a bare
    prompt becomes ``PromptItem(index=0, prompt=prompt)``, so uids are ``e0/i0/s{k}`` and the
    group is ``e0/i0``. ``policy_version`` is 0. Sampling uses ``generator`` when given, else a
    private generator seeded with ``gen_config.seed`` on the model's device, else the global
    torch RNG. A given ``generator`` must be on the model's device.

    ``ref_model`` (same tokenizer): sets ``ref_logprobs (T,)`` - its logprobs of the same
    completion tokens at ``gen_config.temperature``, the temperature the behaviour logprobs
    use (temperature 0, greedy, scores at 1.0, as the behaviour logprobs do). Its dropout is
    switched off in place (``primitives.model.logprobs.disable_dropout``).

    ``reward_fn`` (``rollout -> float`` or a vector with ``aggregate_fn``; ``shaping_fn(rollout,
    reward) -> float``): sets ``reward`` (and ``reward_vector``) through
    ``primitives.env.rewards.score_rollout``, after ``ref_logprobs`` so shaping can read them.
    Without it ``reward`` stays None.

    ``generate_fn(model, tokenizer, prompt, gen_config) -> Generation`` (the seeds' custom generation
    backend, also accepted as ``generator=`` as the seeds pass it) generates instead of the model's
    own sampler, once per completion: it returns the completion's ``token_ids``, ``text``,
    ``finish_reason`` and per-token ``logprobs`` (floats, or vLLM's ``Logprob`` records). Logprobs it
    does not return are the policy ``model``'s own of those tokens at the config's temperature. It is
    called with ``n`` 1 and, where ``gen_config.seed`` is set, completion k gets ``seed + k``, so a
    seeded group's completions differ. ``primitives.model.vllm_generation.vllm_generator`` is one
    for a vLLM ``LLM``.

    ``tool_parser(text) -> [ToolCall]`` (single-turn tool tracking, the seeds' extension point):
    sets ``tool_calls`` from each completion's text, before the reward so it can read them; nothing
    is executed (``primitives.env.tools.execute_and_track_tools`` runs them; a conversation that
    feeds the results back to the model is ``multiturn_rollout``).
    """
    item = prompt if isinstance(prompt, PromptItem) else PromptItem(index=0, prompt=prompt)
    if callable(generator) and not isinstance(generator, torch.Generator):
        generator, generate_fn = None, generator  # the seeds' generator=<a generation function>
    if generate_fn is not None:
        rollouts = [custom_rollout(generate_fn, model, tokenizer, item, gen_config, k) for k in range(gen_config.n)]
    else:
        if generator is None and gen_config.seed is not None:
            device = next(model.parameters()).device
            generator = torch.Generator(device=device).manual_seed(gen_config.seed)
        rollouts = generate_rollouts(model, tokenizer, [item], gen_config, generator=generator)
    if tool_parser is not None:
        rollouts = [r._replace(tool_calls=parsed_tool_calls(tool_parser, r.text)) for r in rollouts]
    if ref_model is not None:
        with torch.no_grad():
            refs = rollout_logprobs(ref_model, rollouts, tokenizer.pad_token_id, gen_config.temperature)
        rollouts = [r._replace(ref_logprobs=lp) for r, lp in zip(rollouts, refs)]
    if reward_fn is not None:
        rollouts = [score_rollout(r, reward_fn, aggregate_fn, shaping_fn) for r in rollouts]
    return rollouts


def parsed_tool_calls(tool_parser: Callable, text: str) -> tuple:
    """``tool_parser(text)`` as a tuple of ``ToolCall``s; anything else is a named error."""
    from primitives.env.tools import ToolCall
    from primitives.hooks import fn_name

    calls = tuple(tool_parser(text))
    wrong = [type(c).__name__ for c in calls if not isinstance(c, ToolCall)]
    if wrong:
        raise ValueError(f"tool_parser {fn_name(tool_parser)} returned {wrong[0]}; expected a list of "
                         f"primitives.env.tools.ToolCall(name, arguments, id)")
    return calls


def create_rollout(model, tokenizer, prompt: Any, gen_config: GenerationConfig = GenerationConfig(),
                   ref_model=None, reward_fn: Optional[Callable] = None, aggregate_fn: Optional[Callable] = None,
                   shaping_fn: Optional[Callable] = None, generator=None,
                   generate_fn: Optional[Callable] = None, tool_parser: Optional[Callable] = None) -> Rollout:
    """One completion of ``prompt`` as a ``Rollout``, in this process: for notebooks and for
    inspecting what the model does (``create_rollout(model, tokenizer, "12+34=", gen_config,
    reward_fn=my_reward)``). Training at scale goes through ``cluster.loop.train.train``.

    The arguments are ``create_rollouts``'s (which see); ``gen_config.n`` must be 1 - a group
    of several completions is ``create_rollouts``.
    """
    if gen_config.n != 1:
        raise ValueError(f"create_rollout makes one completion but gen_config.n is {gen_config.n}; "
                         f"use create_rollouts for a group of n completions")
    return create_rollouts(model, tokenizer, prompt, gen_config, ref_model=ref_model, reward_fn=reward_fn,
                           aggregate_fn=aggregate_fn, shaping_fn=shaping_fn, generator=generator,
                           generate_fn=generate_fn, tool_parser=tool_parser)[0]


def custom_rollout(generate_fn: Callable, model, tokenizer, item: PromptItem, gen_config: GenerationConfig,
                   sample: int) -> Rollout:
    """Completion ``sample`` of ``item`` by a generation function of the user's (``create_rollouts``'
    ``generate_fn``), as a ``Rollout``: its tokens, text and finish reason, and its logprobs or, where
    it returns none, the policy model's of the same tokens."""
    import numpy as np

    name = getattr(generate_fn, "__name__", repr(generate_fn))
    seed = None if gen_config.seed is None else gen_config.seed + sample  # a group's completions differ
    out = generate_fn(model, tokenizer, item.prompt, gen_config._replace(n=1, seed=seed))
    token_ids = getattr(out, "token_ids", None)  # a list or an array
    ids = np.asarray([] if token_ids is None else list(token_ids), dtype=np.int64)
    if ids.size == 0:
        raise ValueError(f"generate_fn {name} returned no token_ids: a rollout is trained on its tokens, so the "
                         f"function must return them (a Generation(text, logprobs, token_ids, finish_reason))")
    raw = getattr(out, "logprobs", None)
    logprobs = None
    if raw is not None:
        logprobs = np.asarray([float(getattr(lp, "logprob", lp)) for lp in raw], dtype=np.float32)
        if logprobs.shape != ids.shape:
            raise ValueError(f"generate_fn {name} returned {len(logprobs)} logprobs for {len(ids)} tokens")
    prompt_ids = encode_prompts(tokenizer, [item.prompt], gen_config.template_kwargs)[0]
    text = getattr(out, "text", None)
    rollout = pack_rollout(item, prompt_ids, GenerationOutput(
        ids, logprobs if logprobs is not None else np.zeros(len(ids), dtype=np.float32),
        getattr(out, "finish_reason", None) or "length",
        text if text is not None else tokenizer.decode(ids, skip_special_tokens=True)), sample=sample)
    if logprobs is None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"generate_fn {name} returned no logprobs, and the model is not a torch module that "
                             f"could score its tokens: return the sampled tokens' logprobs")
        with torch.no_grad():
            scored = rollout_logprobs(model, [rollout], tokenizer.pad_token_id, gen_config.temperature or 1.0)[0]
        rollout = rollout._replace(logprobs=scored)
    return rollout
