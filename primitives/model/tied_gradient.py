"""The gradient of a tied embedding and output head on a CPU, made without two (V, H) temporaries.

Where the output head shares the input embeddings' weight (SmolLM2, the small Qwen2.5 and Llama 3.2
models), that weight's gradient is the sum of two (V, H) parts: the head's, a product, and the
embedding's, a scatter of the rows the batch used. PyTorch makes both in full and adds them out of
place: the head's part reaches the autograd engine as a transposed view, which the engine does not add
into in place, and the embedding's backward zeroes a new (V, H) tensor to scatter a few hundred rows
into. On a CPU a new (V, H) tensor may land on fresh pages: on SmolLM2 (49152 x 576, fp32) the zeroing and
the add took 155-178 ms each in one profile of the job's trainer, and 0.15 s of a 5.8 s update in one process
(docs/benchmarks.md, sessions 69 and 70).

``folded_tied_gradient(model)`` changes, while it is open, how the two parts are made, not their sum:

* the head's part is one contiguous product, not a view, so the engine adds the other part into it in
  place;
* the embedding's part is scattered into a (V, H) buffer kept between backward passes (after zeroing the
  rows the previous scatter wrote), or into a new one while the engine still holds the kept one (two
  graphs in one backward, a retained graph). The kept buffer lives as long as the embedding module
  (113 MB for SmolLM2).

The gradients are the same numbers, bit for bit (tested). It does nothing where the pair is not a plain
float32 ``nn.Embedding`` on a CPU tied to a bias-free ``nn.Linear``, where the weight is frozen or
partitioned by ZeRO-3 (whose hooks gather it per module), or under autocast. On a GPU the caching
allocator already reuses memory, and a scatter by ``index_add_`` (atomics there) would not be
deterministic as PyTorch's own embedding backward is.
"""
from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F

# Off: every pair is left as PyTorch makes it (``folding``).
ENABLED = True


@contextmanager
def folding(on: bool):
    """``folded_tied_gradient`` on or off everywhere in this process while open (tests compare the two)."""
    global ENABLED
    was, ENABLED = ENABLED, on
    try:
        yield
    finally:
        ENABLED = was


class _Scatter:
    """One embedding's kept buffer and the rows its last scatter wrote."""

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None
        self.rows: Optional[torch.Tensor] = None

    def scatter(self, ids: torch.Tensor, grad: torch.Tensor, shape: torch.Size, padding_idx: Optional[int]):
        rows, values = ids.reshape(-1), grad.reshape(-1, shape[1])
        if padding_idx is not None:  # as nn.Embedding: the padding row gets no gradient
            real = rows != padding_idx
            rows, values = rows[real], values[real]
        buf = self.buffer
        if torch.is_grad_enabled():  # a double backward: the gradient is part of a graph, keep nothing of it
            return grad.new_zeros(shape).index_add(0, rows, values)
        if buf is None or buf.shape != shape or buf.dtype != grad.dtype or buf.device != grad.device:
            buf = grad.new_zeros(shape)
        elif held_elsewhere(buf):  # the engine has not added it yet: leave it, use a new one
            return grad.new_zeros(shape).index_add_(0, rows, values)
        else:
            buf.index_fill_(0, self.rows, 0)
        buf.index_add_(0, rows, values)
        # a copy: the ids may share memory with the caller's array, which it may rewrite before the next scatter
        self.buffer, self.rows = buf, rows.clone()
        return buf


def held_elsewhere(t: torch.Tensor) -> bool:
    """Whether anything but its one Python tensor refers to ``t`` or its memory (the autograd engine
    holding it in a sum not yet made, a view). A torch without the counts (private API) answers yes: a new
    buffer each time is slower, never wrong."""
    use_count, storage_count = getattr(t, "_use_count", None), getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or storage_count is None:
        return True
    return use_count() > 1 or storage_count(t.untyped_storage()._cdata) > 2


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, scatter: _Scatter, padding_idx: Optional[int]):
        ctx.save_for_backward(ids)
        ctx.scatter, ctx.padding_idx, ctx.shape = scatter, padding_idx, weight.shape
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        return None, ctx.scatter.scatter(ids, grad, ctx.shape, ctx.padding_idx), None, None


class _Head(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:  # (V, K) @ (K, H): a new contiguous tensor the engine may add into
            grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w


_SCATTERS: "weakref.WeakKeyDictionary[torch.nn.Module, _Scatter]" = weakref.WeakKeyDictionary()
_ACTIVE: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # the embeddings and heads folded now


def tied_pair(model) -> Optional[tuple]:
    """``(embedding, head)`` of ``model`` (or of a DeepSpeed engine's module) when they can be folded:
    a plain ``nn.Embedding`` (no max_norm, frequency scaling or sparse gradient) whose trainable float32
    CPU weight a bias-free ``nn.Linear`` head shares, not partitioned by ZeRO-3; else None."""
    module = getattr(model, "module", model)
    get_in, get_out = getattr(module, "get_input_embeddings", None), getattr(module, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    emb, head = get_in(), get_out()
    if type(emb) is not torch.nn.Embedding or type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    w = emb.weight
    if head.weight is not w or not w.requires_grad or hasattr(w, "ds_id"):
        return None
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return None
    if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
        return None
    return emb, head


def _folding_now(module: torch.nn.Module) -> bool:
    """Inside ``folded_tied_gradient`` for ``module``, with gradients, outside autocast."""
    return module in _ACTIVE and torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")


def _embedding_forward(emb: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    if not (_folding_now(emb) and emb.weight.requires_grad):  # a copy made inside the block lands here too
        return torch.nn.Embedding.forward(emb, ids)
    return _Lookup.apply(ids, emb.weight, _SCATTERS.setdefault(emb, _Scatter()), emb.padding_idx)


def _head_forward(head: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not _folding_now(head):
        return torch.nn.Linear.forward(head, x)
    return _Head.apply(x, head.weight)


@contextmanager
def folded_tied_gradient(model):
    """While open, ``model``'s tied embedding and head (``tied_pair``) make the shared weight's
    gradient as described above; forward passes without gradients run as before. Open it around
    forward and backward passes, not inside one."""
    pair = tied_pair(model) if ENABLED else None
    if pair is None or any("forward" in vars(m) for m in pair):  # not ours to replace (or already folded)
        yield
        return
    emb, head = pair
    # partials of module-level functions: a model copied or pickled inside the block takes them along, bound to
    # the copy, which runs its class's forward (the copy is not in _ACTIVE)
    ours = {emb: functools.partial(_embedding_forward, emb), head: functools.partial(_head_forward, head)}
    for m, forward in ours.items():
        m.forward = forward
        _ACTIVE.add(m)
    try:
        yield
    finally:
        for m, forward in ours.items():
            _ACTIVE.discard(m)
            if vars(m).get("forward") is forward:  # someone else's, set inside the block, is left alone
                del m.forward
