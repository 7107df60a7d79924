"""How rows are laid out: prompts left-padded, completions right-padded, and the position ids
that make a padded prompt see an unpadded one's positions (architecture section 9, pitfall). Shared
by generation, scoring, batching and the value model."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def left_pad(seqs: Sequence[np.ndarray], pad_id: int):
    """``(ids (B, P), attention_mask (B, P))`` with every row right-aligned."""
    P = max(len(s) for s in seqs)
    ids = np.full((len(seqs), P), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), P), dtype=np.int64)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, P - len(s):], mask[i, P - len(s):] = s, 1
    return ids, mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only: ``cumsum(mask) - 1``, 0 on left padding. (B, L)"""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def pad_right(arrays: Sequence[np.ndarray], T: int, dtype=np.float32) -> np.ndarray:
    out = np.zeros((len(arrays), T), dtype=dtype)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = a
    return out


def pack_completions(prompt_ids: Sequence[np.ndarray], completion_ids: Sequence[np.ndarray], pad_id: int):
    """Prompts left-padded to P, completions right-padded to T, concatenated.

    Returns ``(input_ids (B, P+T), attention_mask (B, P+T), P, T)`` numpy int64.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    p_ids, p_mask = left_pad(prompt_ids, pad_id)
    T = max(1, max(len(c) for c in completion_ids))
    c_ids = np.full((len(completion_ids), T), pad_id, dtype=np.int64)
    c_mask = np.zeros((len(completion_ids), T), dtype=np.int64)
    for i, c in enumerate(completion_ids):
        c_ids[i, : len(c)], c_mask[i, : len(c)] = c, 1
    return np.concatenate([p_ids, c_ids], 1), np.concatenate([p_mask, c_mask], 1), p_ids.shape[1], T
