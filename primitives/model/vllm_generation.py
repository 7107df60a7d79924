"""Sampling with vLLM's offline ``LLM`` in the caller's process: the request a ``GenerationConfig``
becomes, what a completion becomes, and the seeds' ``vllm_generator`` (a custom generation backend
for ``create_rollout(llm, tokenizer, prompt, gen_config, generator=vllm_generator)``). The generator
worker's vLLM engine (``rl_actors.vllm_engine``) builds its requests and reads its completions here
too, so both sample and score alike.

Behaviour logprobs must be ``log_softmax(logits / T)`` of the sampled token (``T`` 1 when greedy),
the distribution the trainer and the reference score at. Which vLLM returns depends on how the
``LLM`` was built (its ``logprobs_mode``): ``raw_logprobs``, vLLM's default, are of the logits
before temperature (right only at ``T`` 1 or greedy); ``processed_logprobs`` are after temperature
and after top-k / top-p, renormalised over the kept tokens (right only without top-k / top-p);
the ``*_logits`` modes are not logprobs at all. ``behaviour_logprob_error`` names the mismatch.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from primitives.model.generation import GenerationOutput
from primitives.model.prompts import encode_prompts
from primitives.types import VLLM_MIN_TEMPERATURE, Generation, GenerationConfig

PROCESSED = "processed_logprobs"


def sampling_params(gen: GenerationConfig, seed: Optional[int]):
    """vLLM's ``SamplingParams`` for one completion of ``gen``: the sampled token's logprob
    (``logprobs=0``), stop strings kept in the text (as the HF sampler keeps them), ``top_k`` 0
    as vLLM's "off" (-1)."""
    from vllm import SamplingParams

    return SamplingParams(n=1, max_tokens=gen.max_new_tokens, temperature=gen.temperature,
                          top_p=gen.top_p, top_k=gen.top_k if gen.top_k > 0 else -1,
                          stop=list(gen.stop) or None, stop_token_ids=list(gen.stop_token_ids) or None,
                          include_stop_str_in_output=True, logprobs=0, seed=seed)


def completion_output(output) -> GenerationOutput:
    """vLLM's first completion of a ``RequestOutput`` as a ``GenerationOutput``: its tokens, their
    logprobs, ``length`` or ``stop`` (an EOS, a stop string or a stop token), its text."""
    c = output.outputs[0]
    ids = np.asarray(c.token_ids, dtype=np.int64)
    logp = np.asarray([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], dtype=np.float32)
    return GenerationOutput(ids, logp, "length" if c.finish_reason == "length" else "stop", c.text)


def behaviour_logprob_error(logprobs_mode: str, gen: GenerationConfig) -> Optional[str]:
    """Why an ``LLM`` built with ``logprobs_mode`` cannot return ``gen``'s behaviour logprobs
    (``log_softmax(logits / T)`` of the sampled token, ``T`` 1 when greedy), or None when it can."""
    greedy = gen.temperature == 0
    truncated = [name for name, on in ((f"top_p {gen.top_p}", gen.top_p < 1), (f"top_k {gen.top_k}", gen.top_k > 0))
                 if on]
    if 0 < gen.temperature < VLLM_MIN_TEMPERATURE:
        return (f"vLLM raises a temperature below {VLLM_MIN_TEMPERATURE} to {VLLM_MIN_TEMPERATURE} (a warning, not an "
                f"error), so it would sample and score at {VLLM_MIN_TEMPERATURE}, not at {gen.temperature}, where the "
                f"trainer scores; use temperature 0 (greedy) or at least {VLLM_MIN_TEMPERATURE}")
    if logprobs_mode.endswith("_logits"):
        return (f"the LLM was built with logprobs_mode '{logprobs_mode}', which returns logits, not logprobs; "
                f"build it with LLM(..., logprobs_mode='{PROCESSED}')")
    if logprobs_mode == "raw_logprobs" and gen.temperature not in (0, 1):
        return (f"the LLM was built with logprobs_mode 'raw_logprobs' (vLLM's default): its logprobs are of "
                f"softmax(logits), before temperature {gen.temperature}, not of the softmax(logits / T) the rollout "
                f"was sampled from and the trainer scores; build it with LLM(..., logprobs_mode='{PROCESSED}')")
    if logprobs_mode == PROCESSED and truncated and not greedy:
        return (f"with {' and '.join(truncated)} vLLM's processed logprobs are renormalised over the tokens top-p / "
                f"top-k keep, while the trainer's, the reference's and the HF sampler's are of the full "
                f"softmax(logits / T), so the importance weight would be the kept mass, not the policies' gap; "
                f"use top_p 1.0 and top_k 0 (or, at temperature 1, an LLM built with logprobs_mode 'raw_logprobs', "
                f"whose logprobs are before truncation)")
    return None


def vllm_generator(model, tokenizer, prompt, config: GenerationConfig) -> Generation:
    """The seeds' custom generation backend: one completion of ``prompt`` (a str or a
    ``Conversation``, rendered and tokenised as the HF sampler does, ``config.template_kwargs``
    included) by ``model``, a vLLM ``LLM``, as a ``Generation`` (text, logprobs, token ids, finish
    reason). Pass it as ``create_rollout(llm, tokenizer, prompt, gen_config, generator=vllm_generator)``.

    Unlike the seeds' version it samples with ``config.top_k``, ``stop`` and ``stop_token_ids``
    and ``seed`` too (``create_rollouts`` gives completion k of a group ``seed + k``), and it
    refuses, before sampling, an ``LLM`` whose logprobs would not be ``log_softmax(logits / T)``
    of the sampled tokens (``behaviour_logprob_error``): the seeds' ``LLM(model)`` returns vLLM's
    raw logprobs, before temperature. Build it with ``LLM(model, logprobs_mode='processed_logprobs')``.
    """
    logprobs_mode = getattr(getattr(model, "model_config", None), "logprobs_mode", None)
    if not (callable(getattr(model, "generate", None)) and isinstance(logprobs_mode, str)):
        raise TypeError(f"vllm_generator samples with a vLLM LLM (vllm.LLM(model, logprobs_mode="
                        f"'{PROCESSED}')), got {type(model).__name__}; a transformers model samples with "
                        f"create_rollout's own sampler (no generator=)")
    error = behaviour_logprob_error(logprobs_mode, config)
    if error:
        raise ValueError(f"vllm_generator: {error}")
    ids = encode_prompts(tokenizer, [prompt], config.template_kwargs)[0]
    output = model.generate([{"prompt_token_ids": ids.tolist()}], sampling_params(config, config.seed),
                            use_tqdm=False)[0]
    out = completion_output(output)
    return Generation(text=out.text, logprobs=out.logprobs, token_ids=out.completion_ids,
                      finish_reason=out.finish_reason)
