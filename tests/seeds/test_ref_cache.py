"""The reference-logprob cache: a completion seen before gets the value the reference computed for
it (equal to computing it again), only unseen ones reach the reference, one temperature per
cache, emptied when the reference moves; the seeds' module-level cache is refused."""
import numpy as np
import pytest
import torch

import rl_primitives as rp
from primitives.model.logprobs import rollout_logprobs
from primitives.types import Rollout


def _rollout(prompt, completion, k):
    return Rollout(f"e0/i{k}/s0", f"e0/i{k}", "p", np.asarray(prompt, np.int64), np.asarray(completion, np.int64),
                   np.ones(len(completion), np.float32), np.zeros(len(completion), np.float32))


class Counting(torch.nn.Module):
    """The tiny model, counting the sequences each forward pass scores."""

    def __init__(self, model):
        super().__init__()
        self.model, self.rows = model, 0

    def forward(self, *args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.rows += int(ids.shape[0])
        return self.model(*args, **kwargs)


def test_cached_values_equal_the_reference_and_only_unseen_completions_are_scored(tiny_model, tokenizer):
    ref = Counting(tiny_model)
    pad = tokenizer.pad_token_id
    a, b, c = _rollout([5, 6, 7], [8, 9], 0), _rollout([5, 6, 7], [8, 10, 11], 1), _rollout([4], [8, 9], 2)
    cache = rp.ReferenceLogprobCache(ref, pad, temperature=0.7, max_entries=3)
    first = cache([a, b, a._replace(uid="e0/i0/s1")], 0.7)  # a twice in one batch: scored once
    assert (cache.misses, cache.hits, ref.rows) == (2, 1, 2)
    direct = rollout_logprobs(tiny_model, [a, b], pad, 0.7)
    np.testing.assert_allclose(first[0], direct[0], atol=1e-6)
    np.testing.assert_allclose(first[1], direct[1], atol=1e-6)
    assert first[2] is first[0]
    again = cache([b, c], 0.7)  # b cached; c has a's completion after another prompt: its own entry
    assert again[0] is first[1] and (cache.misses, cache.hits, ref.rows) == (3, 2, 3)
    np.testing.assert_allclose(again[1], rollout_logprobs(tiny_model, [c], pad, 0.7)[0], atol=1e-6)
    assert not np.allclose(again[1], first[0])  # same completion, another prompt: other logprobs
    with pytest.raises(ValueError, match="temperature 0.7, asked for 1.0"):
        cache([a], 1.0)
    cache.invalidate()
    assert len(cache) == 0 and len(cache([a], 0.7)) == 1 and ref.rows == 4


def test_the_oldest_entries_go_beyond_the_bound(tiny_model, tokenizer):
    cache = rp.ReferenceLogprobCache(tiny_model, tokenizer.pad_token_id, 1.0, max_entries=2)
    rows = [_rollout([5], [6 + k], k) for k in range(3)]
    cache(rows, 1.0)
    assert len(cache) == 2 and list(cache.entries) == [cache.key(rows[1]), cache.key(rows[2])]


def test_create_batch_rollouts_with_a_cache_gives_the_references_values(tiny_model, tokenizer):
    config = rp.GenerationConfig(max_new_tokens=3, temperature=1.0, num_return_sequences=4)
    cache = rp.ReferenceLogprobCache(tiny_model, tokenizer.pad_token_id, 1.0)
    torch.manual_seed(0)
    batch = rp.create_batch_rollouts(tiny_model, tokenizer, ["1+1=", "2+2="], config, ref_model=cache)
    direct = rollout_logprobs(tiny_model, list(batch.rollouts), tokenizer.pad_token_id, 1.0)
    for r, d in zip(batch.rollouts, direct):
        np.testing.assert_allclose(r.ref_logprobs, d, atol=1e-6)
    assert cache.hits + cache.misses == 8 and cache.misses == len(cache)


def test_the_seeds_module_level_cache_is_refused():
    with pytest.raises(TypeError, match="ReferenceLogprobCache"):
        rp.cached_ref_logprobs(None, "prompt", [1, 2])


def test_the_cache_empties_itself_when_the_reference_moves(tiny_model, tokenizer):
    """An EMA move of the reference (``update_reference_model``, in place) is seen without
    ``invalidate()``: the next call scores again and gives the moved reference's values."""
    ref, policy = rp.create_reference_model(tiny_model), rp.create_reference_model(tiny_model)
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(0.5)
    row = _rollout([5, 6, 7], [8, 9], 0)
    cache = rp.ReferenceLogprobCache(ref, tokenizer.pad_token_id, 1.0)
    before = cache([row], 1.0)[0]
    assert cache([row], 1.0)[0] is before and cache.misses == 1
    rp.update_reference_model(ref, policy, rp.create_ref_update_fn("ema", decay=0.5), step=1)
    after = cache([row], 1.0)[0]
    assert cache.invalidations == 1 and cache.misses == 2
    np.testing.assert_allclose(after, rollout_logprobs(ref, [row], tokenizer.pad_token_id, 1.0)[0], atol=1e-6)
    assert not np.allclose(after, before)
