"""The gradient of a tied embedding and output head, made without two (V, H) temporaries.

Where the output head shares the input embeddings' weight (SmolLM2, the small Qwen2.5 and Llama 3.2
models), that weight's gradient is the sum of two (V, H) parts: the head's, a product, and the
embedding's, a scatter of the rows the batch used. PyTorch makes both in full and adds them out of
place: the head's part reaches the autograd engine as a transposed view, which the engine does not add
into in place, and the embedding's backward zeroes a new (V, H) tensor to scatter a few hundred rows
into. On CPU each new (V, H) tensor lands on fresh pages: on SmolLM2 (49152 x 576, fp32) the zeroing
and the add took about 0.33 s of each micro-batch's backward (docs/benchmarks.md, session 70).

``folded_tied_gradient(model)`` changes, while it is open, how the two parts are made, not their sum:

* the head's part is one contiguous product, not a view, so the engine adds the other part into it in
  place;
* the embedding's part is scattered into a (V, H) buffer kept between backward passes (on CPU; on
  other devices a new one from the caching allocator each time), after zeroing the rows the previous
  scatter wrote.

The gradients are the same numbers (fp32: bit for bit on the tests' models). It does nothing where
the pair is not a plain ``nn.Embedding`` tied to a bias-free ``nn.Linear``, where the weight is frozen,
or partitioned by ZeRO-3 (whose hooks gather it per module).
"""
from __future__ import annotations

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
    """One embedding's kept buffer and the graph that holds it (at most one at a time: a buffer
    handed to the engine by one backward must not be rewritten by another in the same pass)."""

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None
        self.rows: Optional[torch.Tensor] = None  # the rows the last scatter wrote
        self.owner = None  # weakref to the token of the graph that will scatter next

    def take(self) -> Optional[object]:
        """A token for a forward pass whose backward will use the buffer, or None while another
        graph that will use it is alive (that forward runs as PyTorch's own)."""
        if self.owner is not None and self.owner() is not None:
            return None
        token = _Token()
        self.owner = weakref.ref(token)
        return token

    def scatter(self, ids: torch.Tensor, grad: torch.Tensor, shape: torch.Size, padding_idx: Optional[int]):
        rows, values = ids.reshape(-1), grad.reshape(-1, shape[1])
        if padding_idx is not None:  # as nn.Embedding: the padding row gets no gradient
            real = rows != padding_idx
            rows, values = rows[real], values[real]
        buf = self.buffer
        if buf is None or buf.shape != shape or buf.dtype != grad.dtype or buf.device != grad.device:
            buf = grad.new_zeros(shape)
        elif self.rows is not None:
            buf.index_fill_(0, self.rows, 0)
        buf.index_add_(0, rows, values)
        if keeps_buffer(buf.device):
            self.buffer, self.rows = buf, rows
        self.owner = None
        return buf


def keeps_buffer(device: torch.device) -> bool:
    """On a CPU a new (V, H) tensor is fresh pages each time; a GPU's caching allocator already reuses
    its memory, and a kept buffer there would hold it between steps for nothing."""
    return device.type == "cpu"


class _Token:
    """Lives as long as the graph of the forward pass that took it."""


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, scatter: _Scatter, token: _Token, padding_idx: Optional[int]):
        ctx.save_for_backward(ids)
        ctx.scatter, ctx.token, ctx.padding_idx, ctx.shape = scatter, token, padding_idx, weight.shape
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        return None, ctx.scatter.scatter(ids, grad, ctx.shape, ctx.padding_idx), None, None, None


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


def tied_pair(model) -> Optional[tuple]:
    """``(embedding, head)`` of ``model`` (or of a DeepSpeed engine's module) when they can be folded:
    a plain ``nn.Embedding`` (no max_norm, frequency scaling or sparse gradient) whose trainable
    weight a bias-free ``nn.Linear`` head shares, not partitioned by ZeRO-3; else None."""
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
    if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
        return None
    return emb, head


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
    scatter = _SCATTERS.setdefault(emb, _Scatter())

    def lookup(ids):
        w = emb.weight
        token = scatter.take() if torch.is_grad_enabled() and w.requires_grad else None
        if token is None:
            return F.embedding(ids, w, emb.padding_idx)
        return _Lookup.apply(ids, w, scatter, token, emb.padding_idx)

    def project(x):
        return _Head.apply(x, head.weight) if torch.is_grad_enabled() else F.linear(x, head.weight)

    emb.forward, head.forward = lookup, project
    try:
        yield
    finally:
        del emb.forward, head.forward
