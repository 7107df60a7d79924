"""Reference logprobs kept for completions seen before (seeds/003's ``cached_ref_logprobs``), done
so that a cached value is the value the reference would give now: keyed by the prompt's and the
completion's token ids, held for one sampling temperature (reference logprobs must be of the
sampling temperature's softmax), emptied when the reference moves (its weights changed in place -
an EMA or periodic update, ``update_reference_model``, an optimizer step - are seen from their
tensors' version counters; ``invalidate()`` for any other change), in an object
the caller holds and passes (not a module-level dict: seeds README error 9), bounded in size.

Worth it when the same completions come back: short answers (a number, a label) repeat within a
group and across steps, and each repeat skips its reference forward pass.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

from primitives.model.logprobs import rollout_logprobs


class ReferenceLogprobCache:
    """``cache(rollouts, temperature)``: each rollout's reference logprobs (``(T,)`` float32, its
    own completion tokens), the ones not seen before computed together in one batch
    (``primitives.model.logprobs.rollout_logprobs``). ``hits`` and ``misses`` count rollouts;
    the oldest entries go beyond ``max_entries``."""

    def __init__(self, ref_model, pad_token_id: int, temperature: float, max_entries: int = 65536):
        if temperature <= 0:
            raise ValueError(f"ReferenceLogprobCache: temperature must be > 0 (the sampling one), got {temperature}")
        if max_entries < 1:
            raise ValueError(f"ReferenceLogprobCache: max_entries must be >= 1, got {max_entries}")
        self.ref_model, self.pad_token_id, self.temperature = ref_model, pad_token_id, float(temperature)
        self.max_entries = max_entries
        self.entries: OrderedDict = OrderedDict()
        self.hits = self.misses = self.invalidations = 0
        self.seen = self._weights()

    def _weights(self) -> tuple:
        """Which tensors the reference holds and how often each was changed in place."""
        params = getattr(self.ref_model, "parameters", None)
        return tuple((id(p), p._version) for p in params()) if params is not None else ()

    @staticmethod
    def key(rollout) -> tuple:
        """The prompt's and the completion's token ids (a prompt and completion that tokenise alike are one)."""
        ids = (rollout.prompt_ids, rollout.completion_ids)
        return tuple(np.asarray(x, np.int64).tobytes() for x in ids)

    def __call__(self, rollouts: Sequence, temperature: float) -> list:
        if float(temperature) != self.temperature:
            raise ValueError(f"ReferenceLogprobCache holds logprobs at temperature {self.temperature}, asked for "
                             f"{temperature}: reference logprobs are of the sampling temperature's softmax; make a "
                             "cache per temperature")
        weights = self._weights()
        if weights != self.seen:  # the reference moved since the entries were computed
            self.invalidate()
            self.seen = weights
        keys = [self.key(r) for r in rollouts]
        todo = {k: r for k, r in zip(keys, rollouts) if k not in self.entries}
        if todo:
            computed = rollout_logprobs(self.ref_model, list(todo.values()), self.pad_token_id, self.temperature)
            for k, logp in zip(todo, computed):
                logp.setflags(write=False)
                self.entries[k] = logp
        self.misses += len(todo)
        self.hits += len(keys) - len(todo)
        out = []
        for k in keys:
            self.entries.move_to_end(k)
            out.append(self.entries[k])
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)
        return out

    def invalidate(self) -> None:
        """The reference moved: nothing cached holds (done by itself when its weights change in place)."""
        self.entries.clear()
        self.invalidations += 1

    def __len__(self) -> int:
        return len(self.entries)


def cached_ref_logprobs(*args, **kwargs):
    """Refused: the seeds' ``cached_ref_logprobs(ref_model, prompt, token_ids)`` keeps a module-level
    dict with no temperature and no notion of the reference moving."""
    raise TypeError("cached_ref_logprobs(ref_model, prompt, token_ids) caches in a hidden module-level dict, "
                    "without the sampling temperature and without being emptied when the reference moves (seeds "
                    "README errors 9 and 3); use cache = ReferenceLogprobCache(ref_model, tokenizer.pad_token_id, "
                    "gen_config.temperature) and create_batch_rollouts(..., ref_model=cache), which empties itself "
                    "when the reference's weights change")
