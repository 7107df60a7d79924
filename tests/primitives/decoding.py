"""What the decode-mode tests share (``test_static_decode.py``, ``test_packed_decode.py``): the same
prompts sampled in a given ``GenerationConfig.decode`` mode from the same seed, and the comparison of
two such samplings with each other and with the trainer's recomputed logprobs."""
import numpy as np
import torch

from primitives.io.data import PromptItem
from primitives.model.generation import generate_rollouts
from primitives.model.logprobs import rollout_logprobs
from primitives.types import GenerationConfig

PROMPTS = ["1+2=", "12+34=", "a much longer prompt: 7+40=", "9"]  # 4 widths
SAMPLINGS = [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}, {"temperature": 0.0}]
SAMPLING_IDS = ["t1", "t0.7-topk", "greedy"]


def sample(model, tokenizer, decode, n=3, prompts=PROMPTS, batch_size=None, **kwargs) -> list:
    """``n`` rollouts of each prompt, up to 12 tokens, decoded in mode ``decode`` from seed 0 (the
    sampler on the model's device)."""
    items = [PromptItem(i, p) for i, p in enumerate(prompts)]
    config = GenerationConfig(max_new_tokens=12, n=n, decode=decode, **kwargs)
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    return generate_rollouts(model, tokenizer, items, config, generator=generator,
                             batch_size=batch_size)


def assert_samples_alike(got: list, eager: list, model, tokenizer, sampling: dict) -> None:
    """``got`` has ``eager``'s tokens and finish reasons and its logprobs within 1e-5, and they are what
    the trainer recomputes (within 1e-4); at temperature 1 the rows ended at different steps."""
    assert [r.completion_ids.tolist() for r in got] == [r.completion_ids.tolist() for r in eager]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in eager]
    if sampling == {"temperature": 1.0}:
        assert len({r.num_tokens for r in eager}) > 1  # rows ended at different steps (eos)
    assert max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in zip(got, eager)) < 1e-5
    recomputed = rollout_logprobs(model, got, tokenizer.pad_token_id, sampling["temperature"] or 1.0)
    assert max(float(np.abs(a - r.logprobs).max()) for a, r in zip(recomputed, got)) < 1e-4
