"""The eager decode loop's key/value cache without its two copies a step.

transformers' ``DynamicCache`` grows by ``torch.cat`` at every step, so each step copies every
layer's whole cache; and its SDPA attention, given a mask (left-padded rows always have one),
repeats a grouped-query model's key and value heads to the query heads (``repeat_kv``) before each
product, another copy of the whole cache times the group size. On SmolLM2 (9 query heads over 3
key/value heads, 30 layers), 32 rows of 46-token chat prompts and 16 new tokens on CPU, these were
about 0.3 s of a 2 s generation (docs/benchmarks.md, 2026-12-01).

* ``reserve(cache, room)`` turns each plain ``DynamicLayer`` of a filled cache into a
  ``ReservedLayer``: its keys and values move into buffers with ``room`` more positions, and each
  step writes its column in place; the layer hands out views of the filled part, so everything
  that reads a ``DynamicLayer`` (the mask's sizes, the sequence length) reads the same. A step past
  the room, or a reorder, falls back to the ``DynamicLayer``'s own growth.
* ``grouped_attention()`` is a block in which transformers' ``sdpa`` attention on CPU tensors passes
  the grouped heads to ``scaled_dot_product_attention`` as they are (``enable_gqa``), instead of
  repeating them, whenever there is a mask. The product is the same (the kernel indexes the shared
  head); outside CPU, without groups, or where gradients are needed, transformers' own function runs.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F

try:
    from transformers.cache_utils import DynamicLayer
except ImportError:  # a transformers without cache layers: reserve() changes nothing
    DynamicLayer = object  # type: ignore[misc,assignment]


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of buffers with room to grow in place."""

    keys: torch.Tensor
    values: torch.Tensor
    _room_keys: Optional[torch.Tensor] = None
    _room_values: Optional[torch.Tensor] = None

    def reserve(self, room: int) -> None:
        n = self.keys.shape[-2]
        self._room_keys = self.keys.new_empty(*self.keys.shape[:-2], n + room, self.keys.shape[-1])
        self._room_values = self.values.new_empty(*self.values.shape[:-2], n + room, self.values.shape[-1])
        self._room_keys[..., :n, :] = self.keys
        self._room_values[..., :n, :] = self.values
        self.keys, self.values = self._room_keys[..., :n, :], self._room_values[..., :n, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        room_keys, room_values = self._room_keys, self._room_values
        if room_keys is None or room_values is None or not self._fits(key_states):
            return super().update(key_states, value_states, *args, **kwargs)  # grows by cat from here on
        n = self.keys.shape[-2]
        end = n + key_states.shape[-2]
        room_keys[..., n:end, :] = key_states
        room_values[..., n:end, :] = value_states
        self.keys, self.values = room_keys[..., :end, :], room_values[..., :end, :]
        return self.keys, self.values

    def _fits(self, new: torch.Tensor) -> bool:
        """The keys are still the buffer's leading part (not a reordered or moved copy), of the
        same rows and heads as ``new``, with room for it."""
        room, keys = self._room_keys, self.keys
        return (room is not None and self.is_initialized and keys.data_ptr() == room.data_ptr()
                and keys.shape[:-2] == new.shape[:-2] and keys.shape[-2] + new.shape[-2] <= room.shape[-2])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Only the rows ``indices``, with their room: rows leave a batch whose rows ended."""
        room_keys, room_values, n = self._room_keys, self._room_values, self.keys.shape[-2]
        if room_keys is None or room_values is None or self.keys.data_ptr() != room_keys.data_ptr():
            return super().batch_select_indices(indices)
        self._room_keys, self._room_values = room_keys[indices], room_values[indices]
        self.keys, self.values = self._room_keys[..., :n, :], self._room_values[..., :n, :]

    def reset(self) -> None:
        self._room_keys = self._room_values = None
        super().reset()


def reserve(cache, room: int) -> int:
    """Give each plain ``DynamicLayer`` of ``cache`` (filled by a prefill) ``room`` more positions
    (module docstring); returns how many layers it changed. A cache of another kind, or layers of
    another class (sliding windows, quantized), are left as they are."""
    if DynamicLayer is object or room <= 0:
        return 0
    changed = 0
    for layer in getattr(cache, "layers", ()):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.dim() == 4 and layer.keys.numel():
            layer.__class__ = ReservedLayer
            layer.reserve(room)
            changed += 1
    return changed


def _grouped_sdpa(original):
    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                  **kwargs):
        groups = getattr(module, "num_key_value_groups", 1)
        if (groups <= 1 or attention_mask is None or query.device.type != "cpu" or torch.is_grad_enabled()
                or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
                or query.shape[1] != key.shape[1] * groups):
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            is_causal=is_causal, **kwargs)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    return attention


@contextmanager
def grouped_attention():
    """Within the block, transformers' ``sdpa`` attention keeps grouped key/value heads grouped on
    CPU (module docstring); its own function is back when the block ends."""
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        yield
        return
    mapping = AttentionInterface._global_mapping
    original = mapping.get("sdpa")
    if original is None:
        yield
        return
    mapping["sdpa"] = _grouped_sdpa(original)
    try:
        yield
    finally:
        mapping["sdpa"] = original
