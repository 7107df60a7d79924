"""Decode steps over a static KV cache, captured into CUDA graphs on a GPU.

The eager decode loop (``primitives.model.generation``) grows a ``DynamicCache`` and its
attention mask by one column per step, so every step has new shapes. On a GPU a decode step
of a small or mid-sized model is dozens of small kernels whose launches cost more than their
work: HF ``generate`` with a static cache and ``torch.compile(mode="reduce-overhead")`` (CUDA
graphs) decoded 256 rows of a 1.3B model in 0.80 s where our eager loop took 2.05 s (issue 34).

Here each batch decodes over a transformers ``StaticCache`` of fixed shape: ``rows`` rounded up
to a power of two and ``positions`` (prompt width plus the token budget) rounded up to a multiple
of ``LENGTH_STEP``, with a 2-D attention mask of that many columns, filled as tokens arrive.
A decode step then has the same shapes at every step of every batch of the same bucket, so a
compiled step captures once per bucket, not once per call. The extra rows repeat the first row
and are never sampled (sampling draws only the real rows, so the random stream is the eager
loop's); the extra columns are masked.

The prompts are prefilled eagerly, as the eager loop does (rows with the same prompt share it),
and their keys and values are copied into the static cache. The tokens and logprobs are the
eager loop's for the same seed (the logits differ in the last bits: attention sums over masked
columns too; tested on CPU, where the static cache runs uncompiled).

Modes (``GenerationConfig.decode``): ``eager``; ``packed`` (the eager loop with the linear
layers' weights packed for oneDNN, CPU only: ``primitives.model.packed_decode``); ``static`` (this
cache, uncompiled); ``captured`` (compiled; on CUDA with CUDA graphs); ``auto``: ``captured`` on
CUDA for a transformers model whose class supports a static cache, ``packed`` on a CPU for a batch
that pays the packing back (``packed_decode.worth_packing``), else ``eager``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

from primitives.types import DECODE_MODES

LENGTH_STEP = 64  # cache positions are rounded up to a multiple of this
RECOMPILES = 64  # shapes torch.compile may specialise one forward's code for (its default, 8, is a few buckets)
# held in the model's own __dict__ (a cycle the collector frees with the model, not a global that keeps it)
STATE = "_rayrl_static_decode"


def bucket_rows(rows: int) -> int:
    """Rows rounded up to a power of two: 1, 2, 4, 8, ..."""
    return 1 << max(0, int(rows) - 1).bit_length()


def bucket_positions(positions: int) -> int:
    """Cache positions rounded up to a multiple of ``LENGTH_STEP``."""
    return -(-int(positions) // LENGTH_STEP) * LENGTH_STEP


def supports_static_cache(model) -> bool:
    """A transformers 5 model whose class declares it can run with a static cache under
    ``torch.compile`` (``_can_compile_fullgraph``; PEFT wrappers are looked through) and whose
    layers all attend over every position: a sliding-window layer's eager cache keeps only the
    window, and linear-attention layers keep no keys, so neither copies into this cache."""
    try:
        import transformers
        from transformers import PreTrainedModel
    except ImportError:
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if int(transformers.__version__.split(".")[0]) < 5 or not isinstance(base, PreTrainedModel):
        return False
    config = base.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    full = set(layer_types) <= {"full_attention"} if layer_types is not None else \
        not (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))
    return full and bool(getattr(base, "_can_compile_fullgraph", False))


def decode_mode(model, requested: str, device: torch.device, rows: int = 0, new_tokens: int = 0) -> str:
    """The mode a batch of ``rows`` rows and up to ``new_tokens`` tokens decodes in: ``requested``,
    with ``auto`` resolved (see the module; ``packed``: ``primitives.model.packed_decode``)."""
    from primitives.model import packed_decode

    if requested not in DECODE_MODES:
        raise ValueError(f"GenerationConfig.decode must be one of {DECODE_MODES}, got {requested!r}")
    if requested == "auto":
        if device.type == "cuda":
            return "captured" if supports_static_cache(model) else "eager"
        cpu = device.type == "cpu" and packed_decode.worth_packing(model, rows, new_tokens)
        return "packed" if cpu else "eager"
    if requested == "packed":
        if device.type != "cpu" or not packed_decode.can_pack(model):
            raise ValueError(f"GenerationConfig.decode='packed' packs float32 linear layers "
                             f"(plain torch.nn.Linear) for oneDNN on a CPU; "
                             f"{type(model).__name__} on {device} has none (or this torch lacks oneDNN): use "
                             f"decode='eager' or 'auto'")
        return requested
    if requested != "eager" and not supports_static_cache(model):
        raise ValueError(f"GenerationConfig.decode={requested!r}: {type(model).__name__} does not take a static "
                         f"cache (transformers 5, _can_compile_fullgraph, full attention in every layer); use "
                         f"decode='eager'")
    return requested


class DecodeState(dict):
    """What decoding keeps on a model: its compiled forwards and its last static cache. A copy of
    the model (a reference made by ``copy.deepcopy``, a pickle) starts without them."""

    def __init__(self):
        super().__init__(compiled={}, cache=None, rows=0)  # rows: the call's largest batch (``call_rows``)

    def __deepcopy__(self, memo):
        return DecodeState()

    def __reduce__(self):
        return DecodeState, ()


def _state(model) -> DecodeState:
    state = model.__dict__.get(STATE)
    if state is None:
        state = model.__dict__[STATE] = DecodeState()
    return state


@contextmanager
def call_rows(model, rows: int) -> Iterator[None]:
    """Within the block, a static cache on ``model`` holds at least ``rows`` rows (bucketed): a call
    decoded in batches a row apart (``generation.batch_rows``: 3 and 2 rows) keeps one cache and one
    captured step for all of them instead of swapping buckets (4, 2) at every batch."""
    state = _state(model)
    before, state["rows"] = state["rows"], rows
    try:
        yield
    finally:
        state["rows"] = before


def compiled_forward(model, backend: Optional[str] = None) -> Callable:
    """``model``'s forward compiled once per model (each bucket specialises it once, not each call):
    ``reduce-overhead`` (CUDA graphs) on CUDA, else inductor's default; ``backend`` picks another
    torch.compile backend (the CPU tests trace with ``eager``)."""
    compiled, key = _state(model)["compiled"], backend or "default"
    if key not in compiled:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILES)
        cuda = next(model.parameters()).device.type == "cuda"
        kwargs = {"backend": backend} if backend else {"mode": "reduce-overhead" if cuda else "default"}
        compiled[key] = torch.compile(model.forward, dynamic=False, **kwargs)
    return compiled[key]


def static_cache(model, rows: int, length: int):
    """A ``StaticCache`` of ``rows`` x ``length`` for ``model``, emptied: the last one, when it has
    that shape (its tensors keep their addresses, so a captured step replays instead of capturing
    again), else a new one that replaces it (one cache per model, the memory of one batch)."""
    from transformers import StaticCache

    state = _state(model)
    kept = state["cache"]
    if kept is not None and kept[0] == (rows, length):
        kept[1].reset()
        return kept[1]
    state["cache"] = None  # the old one's memory goes before the new one's comes
    cache = StaticCache(config=model.config, max_cache_len=length)
    state["cache"] = ((rows, length), cache)
    return cache


class StaticSteps:
    """The decode of one batch over a static cache: ``first()`` prefills, ``next(feed, active)``
    makes one step. Both return the real rows' last logits ``(rows, V)``."""

    def __init__(self, model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, prefill: Callable,
                 forward: Optional[Callable] = None):
        from primitives.padding import position_ids_from_mask

        self.model, self.prefill, self.forward = model, prefill, forward or model
        self.rows, width = ids.shape
        self.padded = bucket_rows(max(self.rows, _state(model)["rows"]))
        length = bucket_positions(width + max_new_tokens)
        self.cache = static_cache(model, self.padded, length)
        extra = self.padded - self.rows  # rows that repeat row 0, never sampled
        self.take = torch.cat([torch.arange(self.rows), torch.zeros(extra, dtype=torch.long)]).to(ids.device)
        self.ids, self.width, self.step = ids, width, 0
        self.mask = torch.zeros((self.padded, length), dtype=mask.dtype, device=mask.device)
        self.mask[:, :width] = mask[self.take]
        self.prompt_positions = position_ids_from_mask(mask)
        self.positions = self.prompt_positions[self.take][:, -1:]

    def first(self) -> torch.Tensor:
        """Prefill the prompts (eagerly, rows with one prompt sharing it) and copy their keys and
        values into the static cache."""
        past, logits = self.prefill(self.ids, self.mask[: self.rows, : self.width], self.prompt_positions)
        place = torch.arange(self.width, device=self.ids.device)
        for i, layer in enumerate(past.layers):
            self.cache.update(layer.keys[self.take], layer.values[self.take], i, {"cache_position": place})
        return logits

    def next(self, feed: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """One decode step: ``feed`` (rows,) the tokens just sampled (pad where a row ended),
        ``active`` (rows,) the rows still decoding."""
        column = self.width + self.step
        self.step += 1
        self.mask[: self.rows, column] = active.to(self.mask.device, self.mask.dtype)
        self.positions = self.positions + 1
        if self.forward is not self.model and self.ids.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs were read: reuse them
        out = self.forward(input_ids=feed.to(self.ids.device)[self.take][:, None], attention_mask=self.mask,
                           position_ids=self.positions, past_key_values=self.cache, use_cache=True)
        return out.logits[: self.rows, -1, :]

