"""Decoding on a CPU with the linear layers' weights packed once for oneDNN.

A decode step multiplies a few rows (the batch) by every weight matrix. On a CPU, torch's
``F.linear`` hands each product to a GEMM that first copies the whole weight into its blocked
layout. A weight that fits in the caches is copied there cheaply; one that does not is read from
memory twice a product, and at a few rows that copy costs more than the product. oneDNN can take the
weight already in its layout (``torch.ops.mkldnn._reorder_linear_weight``, the op inductor's CPU
freezing uses). At 32 rows, 2 threads, fp32, here (32 MiB of L3): SmolLM2's 49k x 576 head (108 MiB)
took 57 -> 22.6 ms, and weights of 16 to 128 MiB took 0.33-0.71 of their time, paying their packing
back within 2.4 to 10.6 products; weights of 3 to 8 MiB took 0.58-0.65 but needed 10 to 16
(docs/benchmarks.md, 2026-11-30).

``packed_linears(model)`` packs, once, every ``torch.nn.Linear`` whose weight is float32 on the CPU
(and at least ``PACK_MIN_BYTES``, 0 by default), and points the layer's forward at the packed copy until
the block ends, when the layers get their own forward back and the copies are freed. The packing reads the
weights as they are when the block starts, so a weight changed later (a sync, an optimizer step) is
never served stale: a generation call packs anew. ``GenerationConfig.decode="auto"`` packs only
batches of many rows and tokens (``worth_packing``), where the weights measured paid their packing
back. The copies take memory while the call runs: about the model's linear weights again (SmolLM2:
540 MB); ``decode="eager"`` does without them.

On SmolLM2 (4 chat prompts x 8 samples x 16 tokens, 2 threads, ``benchmarks/bench_packed_decode.py``,
16 rounds in one process, packing included): the eager loop 3.54 s, the head alone packed 0.889 of
it, every layer packed **0.755** (211 weights packed in 0.19 s), 2026-12-01 session 69. On a machine
whose ``F.linear`` ran the decode's 32-row products at 121 GFLOPS (2026-11-30) packing every layer had
been no faster than the head alone (0.87-0.94 against 0.84-0.91); on this one ``F.linear`` ran them at
64 GFLOPS and the packed product at 118. The layers' products in one stacked weight per parent (q, k, v;
gate, up: vLLM's fused layers) were measured too, and were slower (0.784). The products differ from
``F.linear``'s in the last bits (another summation order), as a kernel chosen for another batch size
does.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

# decode="auto" packs on a CPU a batch of at least PACK_MIN_ROWS rows and PACK_MIN_STEPS new tokens:
# SmolLM2's head packs in 35-83 ms and saves 23 ms a product at 8 rows, 35 at 32, 9 at one row; the
# weights of 16-128 MiB measured paid their packing back within 2.4-10.6 products at 32 rows, those of
# 1-4 MiB (SmolLM2's layers) within 16 decode steps of 32 rows (module docstring).
PACK_MIN_ROWS = 8
PACK_MIN_STEPS = 16
PACK_MIN_BYTES = 0  # a floor on the weights packed (every float32 linear layer by default)
ACTIVE = "_rayrl_packed_linears"  # in the model's __dict__ while its layers run packed


def can_pack(model) -> bool:
    """oneDNN's packed linear is in this torch, and ``model`` has a packable layer: a
    ``torch.nn.Linear`` (not a subclass, whose forward may do more) with a float32 weight of at
    least ``PACK_MIN_BYTES`` on the CPU. ZeRO-3's partitioned parameters (``ds_id``) hold no weight
    between forwards: never. Inside a ``packed_linears`` block on ``model``: yes (packed already)."""
    if model.__dict__.get(ACTIVE):
        return True
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return False
    return any(_packable(m) for m in model.modules())


def worth_packing(model, rows: int, new_tokens: int) -> bool:
    """``decode="auto"``'s rule on a CPU: a batch big and long enough to pay the packing back."""
    return rows >= PACK_MIN_ROWS and new_tokens >= PACK_MIN_STEPS and can_pack(model)


def _packable(module) -> bool:
    """A plain ``nn.Linear`` with a large float32 CPU weight and the class's own forward (not one an
    instance was given, as accelerate's hooks and an enclosing ``packed_linears`` set)."""
    w = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and "forward" not in module.__dict__ and w is not None
            and w.dtype == torch.float32
            and w.device.type == "cpu" and w.dim() == 2 and w.numel() > 0
            and w.numel() * w.element_size() >= PACK_MIN_BYTES)


def _packed_forward(layer: torch.nn.Linear, packed: torch.Tensor) -> Callable:
    weight, bias = layer.weight, layer.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or (torch.is_grad_enabled() and (
                x.requires_grad or weight.requires_grad
                                                                      or (bias is not None and bias.requires_grad))):
            return F.linear(x, weight, bias)
        out = packed_product(x.reshape(-1, x.shape[-1]), packed, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


def pack(weight: torch.Tensor, rows: int = 0) -> torch.Tensor:
    """``weight`` (out, in), float32 on the CPU, in oneDNN's blocked layout for products of about ``rows`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows or None)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` (rows, in) and ``packed = pack(weight)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@contextmanager
def packed_linears(model, rows: int = 0) -> Iterator[int]:
    """Within the block, ``model``'s packable linear layers (``can_pack``) multiply by a oneDNN-packed copy of
    their weight as it was when the block began (module docstring). ``rows`` hints the batch size
    the layout is chosen for (0: oneDNN's default). Yields the number of layers packed; a block
    inside another on the same model packs nothing and yields 0."""
    if model.__dict__.get(ACTIVE):
        yield 0
        return
    layers = [m for m in model.modules() if _packable(m)]
    model.__dict__[ACTIVE] = True
    ours: dict = {}
    try:
        with torch.no_grad():
            for layer in layers:
                layer.forward = ours[id(layer)] = _packed_forward(layer, pack(layer.weight, rows))
        yield len(layers)
    finally:
        for layer in layers:
            if layer.__dict__.get("forward") is ours.get(id(layer)):  # not one set since by someone else
                layer.__dict__.pop("forward", None)
        model.__dict__.pop(ACTIVE, None)
