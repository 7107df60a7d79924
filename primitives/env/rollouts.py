"""One prompt end to end in this process - sample, score the reference, reward - for notebooks
and for inspecting what a model does (the seeds' ``create_rollout``). Training at scale goes
through ``cluster.loop.train.train``."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from primitives.env.rewards import score_rollout
from primitives.model.generation import generate_rollouts
from primitives.model.logprobs import rollout_logprobs
from primitives.types import GenerationConfig, PromptItem, Rollout


def create_rollouts(model, tokenizer, prompt: Any, gen_config: GenerationConfig = GenerationConfig(),
                    ref_model=None, reward_fn: Optional[Callable] = None, aggregate_fn: Optional[Callable] = None,
                    shaping_fn: Optional[Callable] = None,
                    generator: Optional[torch.Generator] = None) -> list:
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
    """
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
    reward_fn=my_reward)``). Training at scale goes through ``cluster.loop.train.train``.

    The arguments are ``create_rollouts``'s (which see); ``gen_config.n`` must be 1 - a group
    of several completions is ``create_rollouts``.
    """
    if gen_config.n != 1:
        raise ValueError(f"create_rollout makes one completion but gen_config.n is {gen_config.n}; "
                         f"use create_rollouts for a group of n completions")
    return create_rollouts(model, tokenizer, prompt, gen_config, ref_model=ref_model, reward_fn=reward_fn,
                           aggregate_fn=aggregate_fn, shaping_fn=shaping_fn, generator=generator)[0]
