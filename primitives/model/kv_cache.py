"""The eager decode loop's key/value cache without its two copies a step.

transformers' ``DynamicCache`` grows by ``torch.cat`` at every step, so each step copies every
layer's whole cache; and its SDPA attention, given a mask (left-padded rows always have one),
repeats a grouped-query model's key and value heads to the query heads (``repeat_kv``) before each
product, another copy of the whole cache times the group size. On SmolLM2 (9 query heads over 3
key/value heads, 30 layers), 32 rows of 46-token chat prompts and 16 new tokens on CPU, these were
about 0.3 s of a 2 s generation (docs/benchmarks.md, 2026-12-01).

* ``reserve(cache, room)`` turns each plain ``DynamicLayer`` of a filled cache into a
  ``ReservedLayer``: its keys and values move into buffers with room for up to ``ROOM_STEP`` more
  positions, each step writes its column in place, and a full buffer grows by another
  ``ROOM_STEP``, never past ``room`` (a long generation whose rows end early does not hold the
  longest cache from the start). The layer hands out views of the filled part, so everything that
  reads a ``DynamicLayer`` (the mask's sizes, the sequence length) reads the same. Past ``room``, or
  after a reorder, the layer frees its buffers and grows as a ``DynamicLayer`` does.
* ``grouped_attention()`` is a block in which transformers' ``sdpa`` attention on CPU tensors passes
  the grouped heads to ``scaled_dot_product_attention`` as they are (``enable_gqa``), instead of
  repeating them, whenever there is a mask: the same product (tested against the repeated heads;
  torch 2.13's CPU flash kernel takes the groups without copying them). Outside CPU, without groups,
  where gradients are needed, and in other threads, transformers' own function runs. The switch is a
  per-thread flag read by one wrapper installed in transformers' registry, so blocks in two threads
  never see each other's setting.
* ``rows_selectable(cache)``: whether the decode may drop rows that ended from ``cache``
  (``batch_select_indices``): only where every layer is a plain or reserved ``DynamicLayer``.
  Other layers hold states that selection would not select (a linear-attention layer's
  convolution and recurrent states, a quantized layer's residual).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F

try:
    from transformers.cache_utils import DynamicLayer
except ImportError:  # a transformers without cache layers: reserve() changes nothing
    DynamicLayer = object  # type: ignore[misc,assignment]

ROOM_STEP = 256  # positions a reserved layer grows by: one copy of the cache per 256 decode steps


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of buffers with room to grow in place."""

    keys: torch.Tensor
    values: torch.Tensor
    _room_keys: Optional[torch.Tensor] = None
    _room_values: Optional[torch.Tensor] = None
    _limit: int = 0  # the most positions the buffers will be grown to

    def reserve(self, room: int) -> None:
        self._limit = self.keys.shape[-2] + room
        self._grow()

    def _grow(self, need: int = 0) -> tuple:
        """Move the filled part into buffers of ``ROOM_STEP`` more positions, or of ``need`` if that is more
        (``_limit`` at most); returns the buffers."""
        n = self.keys.shape[-2]
        size = min(self._limit, max(need, n + ROOM_STEP))
        room_keys = self.keys.new_empty(*self.keys.shape[:-2], size, self.keys.shape[-1])
        room_values = self.values.new_empty(*self.values.shape[:-2], size, self.values.shape[-1])
        room_keys[..., :n, :] = self.keys
        room_values[..., :n, :] = self.values
        self._room_keys, self._room_values = room_keys, room_values
        self.keys, self.values = room_keys[..., :n, :], room_values[..., :n, :]
        return room_keys, room_values

    def _viewing(self) -> bool:
        """The keys are still the buffers' leading part: not a reordered, moved or emptied copy."""
        room = self._room_keys
        return (room is not None and self._room_values is not None and self.is_initialized
                and self.keys.data_ptr() == room.data_ptr())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = self.keys.shape[-2] if self.is_initialized else 0
        end = n + key_states.shape[-2]
        room_keys, room_values = self._room_keys, self._room_values
        if (room_keys is None or room_values is None or not self._viewing()
                or self.keys.shape[:-2] != key_states.shape[:-2] or end > self._limit):
            self._room_keys = self._room_values = None  # not needed again: free them
            return super().update(key_states, value_states, *args, **kwargs)  # grows by cat from here on
        if end > room_keys.shape[-2]:
            room_keys, room_values = self._grow(end)  # full, the limit not reached: another ROOM_STEP, or more
        room_keys[..., n:end, :] = key_states
        room_values[..., n:end, :] = value_states
        self.keys, self.values = room_keys[..., :end, :], room_values[..., :end, :]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Only the rows ``indices``, with their room: rows leave a batch whose rows ended."""
        room_keys, room_values = self._room_keys, self._room_values
        if room_keys is None or room_values is None or not self._viewing():
            return super().batch_select_indices(indices)
        n = self.keys.shape[-2]
        self._room_keys, self._room_values = room_keys[indices], room_values[indices]
        self.keys, self.values = self._room_keys[..., :n, :], self._room_values[..., :n, :]

    def reset(self) -> None:
        self._room_keys = self._room_values = None
        super().reset()


def reserve(cache, room: int) -> int:
    """Give each plain ``DynamicLayer`` of ``cache`` (filled by a prefill) room to grow in place by up to
    ``room`` positions (module docstring); returns how many layers it changed. A cache of another
    kind, or layers of another class (sliding windows, quantized, linear attention), are left as they are."""
    if DynamicLayer is object or room <= 0:
        return 0
    changed = 0
    for layer in getattr(cache, "layers", ()):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.dim() == 4 and layer.keys.numel():
            layer.__class__ = ReservedLayer
            layer.reserve(room)
            changed += 1
    return changed


def rows_selectable(cache) -> bool:
    """Every layer of ``cache`` is a plain or reserved ``DynamicLayer``, whose ``batch_select_indices``
    selects all it holds (module docstring)."""
    layers = list(getattr(cache, "layers", None) or ())
    return (DynamicLayer is not object and hasattr(cache, "batch_select_indices") and bool(layers)
            and all(type(layer) in (DynamicLayer, ReservedLayer) for layer in layers))


_GROUPED = threading.local()  # .on: this thread is inside a grouped_attention() block
_WRAPPED = "_rayrl_grouped"  # set on the wrapper installed in transformers' registry


def _grouped_sdpa(original):
    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                  **kwargs):
        groups = getattr(module, "num_key_value_groups", 1)
        if (not getattr(_GROUPED, "on", False) or groups <= 1 or attention_mask is None
                or query.device.type != "cpu" or torch.is_grad_enabled()
                or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
                or kwargs.get("output_attentions") or query.shape[1] != key.shape[1] * groups):
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            is_causal=is_causal, **kwargs)
        # with a mask transformers' function runs is_causal=False too: the mask is the whole pattern
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    setattr(attention, _WRAPPED, original)
    return attention


def _install() -> bool:
    """Put the grouped wrapper in front of transformers' ``sdpa`` function, once; whether it is there."""
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return False
    mapping = AttentionInterface._global_mapping
    current = mapping.get("sdpa")
    if current is None:
        return False
    if not hasattr(current, _WRAPPED):
        mapping["sdpa"] = _grouped_sdpa(current)
    return True


@contextmanager
def grouped_attention():
    """Within the block, in this thread, transformers' ``sdpa`` attention keeps grouped key/value heads
    grouped on CPU (module docstring)."""
    if not _install():
        yield
        return
    before = getattr(_GROUPED, "on", False)
    _GROUPED.on = True
    try:
        yield
    finally:
        _GROUPED.on = before
