"""Where a weight sync's tensors go on the wire: the bucket plan every member of the group computes
from the same metadata (``bucket_plan``), and the one buffer a member lays a sync's buckets out in,
two in flight at once (``bucket_buffer``, ``bucket_slot``). ``rl_actors.weight_sync`` moves the bytes;
``meta`` here is its ``TensorMeta``s (a name, a shape, a dtype, their ``nbytes``)."""
from __future__ import annotations

from typing import Sequence

import torch


def bucket_plan(meta: Sequence, bucket_bytes: int) -> list:
    """Lists of indices into ``meta``: same-dtype runs, each at most ``bucket_bytes``
    (a single larger tensor gets a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list = []
    current: list = []
    size, dtype = 0, None
    for i, m in enumerate(meta):
        if current and (m.dtype != dtype or size + m.nbytes > bucket_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += m.nbytes
        dtype = m.dtype
    if current:
        buckets.append(current)
    return buckets


# Broadcasts of one sync in flight at once (``broadcast_buckets``): a receiver loads a bucket while the
# next arrives, the source fills the next while the last is on the wire. vLLM's layerwise reload of each
# bucket (its linear layers' kernels rebuilt) took as long as the wire on SmolLM2 (docs/benchmarks.md,
# session 71): one after the other they made its sync 1.7x an HF worker's. Two, so that the two buckets
# in flight are neighbours in the plan, one even and one odd (``bucket_slot``).
PIPELINE_DEPTH = 2
SLOT_ALIGN = 64  # bytes: where a bucket starts in a buffer (a cache line; suits every dtype's view)


def bucket_buffer(meta: Sequence, bucket_bytes: int, device, depth: int = PIPELINE_DEPTH) -> torch.Tensor:
    """One flat byte buffer for ``broadcast_buckets`` to lay every bucket of a sync out in, ``depth`` (1
    or 2) of them in flight: as large as the largest bucket of ``meta``, or with two in flight, as the
    largest two neighbouring buckets together (``bucket_slot``; SmolLM2 in fp32 at 64 MB buckets: 177 MB
    against 113 for the largest alone, its embedding). A bucket in a buffer of its own costs the first
    touch of each new page: over 32 MB (glibc's largest mmap threshold), a fresh CPU tensor is new pages
    from the kernel every time, and a 512 MB sync spent 0.6 of its 0.9 s there between two CPU
    processes (docs/benchmarks.md)."""
    if depth not in (1, 2):
        raise ValueError(f"bucket_buffer: depth {depth}; 1 or 2 buckets in flight")
    return torch.empty(buffer_bytes(bucket_plan(meta, bucket_bytes), meta, depth), dtype=torch.uint8, device=device)


def bucket_sizes(plan: list, meta: Sequence) -> list:
    """Bytes of each bucket of ``plan`` (``bucket_plan(meta, ...)``)."""
    return [sum(meta[i].nbytes for i in idx) for idx in plan]


def largest_bucket(plan: list, meta: Sequence) -> int:
    """Bytes of the largest bucket of ``plan`` (``bucket_plan(meta, ...)``)."""
    return max(bucket_sizes(plan, meta), default=0)


def buffer_bytes(plan: list, meta: Sequence, depth: int) -> int:
    """The bytes a buffer needs for ``plan`` with ``depth`` buckets in flight: the largest bucket, or the
    largest two neighbours plus the room ``bucket_slot`` aligns the back one down by."""
    sizes = bucket_sizes(plan, meta)
    if depth == 1 or len(sizes) < 2:
        return max(sizes, default=0)
    return max(a + b for a, b in zip(sizes, sizes[1:])) + SLOT_ALIGN


def bucket_slot(k: int, nbytes: int, size: int, depth: int) -> int:
    """Where bucket ``k`` of ``nbytes`` starts in a buffer of ``size`` bytes: with one in flight at 0;
    with two, even buckets at 0 and odd ones against the end (aligned down to ``SLOT_ALIGN``), so the two
    in flight, neighbours, never overlap where the buffer holds the largest two neighbours together."""
    return 0 if depth == 1 or k % 2 == 0 else (size - nbytes) // SLOT_ALIGN * SLOT_ALIGN
