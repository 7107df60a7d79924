"""Reward-shaping formulas on plain numbers (no torch: a reward worker imports them)."""
from __future__ import annotations

from typing import Callable


def overlong_penalty(max_len: int, buffer: int, penalty: float = 1.0) -> Callable[[int], float]:
    """DAPO soft overlong punishment for one length (arXiv 2503.14476, eq. 13), as a function
    ``L -> penalty``: 0 up to ``max_len - buffer``, then linear down to ``-penalty`` at
    ``max_len``, and ``-penalty`` beyond."""
    if buffer <= 0 or buffer > max_len:
        raise ValueError(f"overlong buffer must be in (0, max_len={max_len}], got {buffer}")

    def value(length: int) -> float:
        start = max_len - buffer
        if length <= start:
            return 0.0
        if length <= max_len:
            return -penalty * (length - start) / buffer
        return -penalty

    return value
