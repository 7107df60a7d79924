"""Padding-free scoring of completions: sequence packing (veRL's ``use_remove_padding``, ROLL).

A ``Batch`` row is a left-padded prompt and a right-padded completion, (B, P + T). Where
lengths vary, much of that rectangle is padding that the forward pass computes and throws
away. Packing takes each row's real tokens and lays several rows end to end in one packed
row, position ids restarting at 0 where each sequence starts:

    padded   [pad pad p p p c c pad]      packed  [p p p c | p p p p c c | p p c]
             [p p p p p c c c     ]       pos     [0 1 2 3 | 0 1 2 3 4 5 | 0 1 2]

With ``attention_mask=None`` transformers' masking utils (``find_packed_sequence_indices``,
5.x) read the sequence starts from the position ids and confine attention to each sequence;
``PACKED_ATTENTION`` and ``PACKED_MODEL_TYPES`` say where that was checked (tests compare
packed and padded logprobs to 1e-5). Each sequence's last token is left out: its logit
predicts nothing in the completion, and causal attention means no earlier position sees it.

Rows with the same prompt - a GRPO group's G completions - share it: the prompt runs once,
followed by each completion, and a tree mask lets each completion see the prompt and itself
only, its position ids going on from the prompt's end as if it were alone::

    shared   [p p p a a | b b | c]       pos  [0 1 2 3 4 | 3 4 | 3]     (a, b, c: completions)

The prompt's last logit predicts the first token of every completion (``PackPlan.source``).
Gradients through the shared prompt are the sum of what each row's copy would get, so the
values and gradients equal the padded forward's (tests, 1e-5); a group of 8 runs about a
third of the tokens (2.3-2.8x faster on the default job, 2.5-3.8x on SmolLM2's 45-token chat
prompts, ``benchmarks/bench_padding.py``). The mask is passed as a 4D tensor, which
transformers uses as it is, in every layer: a sliding window goes into it (``tree_masks``).
Without a shared prompt the plan needs none. A tree is one sequence, and sdpa/eager attend
over a whole row, so with long completions sharing can cost more than the repeated prompt:
``plan_for`` shares only where the cost model below says it is cheaper.

Trees are filled first-fit decreasing up to ``capacity`` tokens, a multiple of the longest
tree that ``packing_cost`` picks per micro-batch: sdpa/eager compute a dense (C, C) score
matrix per row, so longer rows waste less room but cost more attention per token (``key_cost``,
from the model's shape). (Flash-attention's varlen kernels have no attention cost of this
kind, but transformers packs for them one row only.)

Only the positions that predict a completion token keep their logits (``keep``); those
logits go back into the (B, T) completion layout (``scatter_completions``), so everything
downstream of the logprobs is unchanged.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

# Attention implementations whose packed masks come from the position ids (transformers'
# masking utils). flash_attention_2/3 read packed position ids only for a single row
# (``_is_packed_sequence`` wants batch size 1), so they are left out, as is anything else.
PACKED_ATTENTION = ("sdpa", "eager")
# Model families whose forward builds its mask through ``create_causal_mask(position_ids=...)``,
# checked by tests/primitives/test_packing.py against the padded forward.
PACKED_MODEL_TYPES = ("qwen2", "llama", "qwen3", "mistral")


class PackPlan(NamedTuple):
    """Where each real token of a ``Batch``-layout input goes in the packed rows.

    R packed rows of C tokens; K positions keep their logits; N completion tokens to score
    (the loss-bearing and tool tokens alike - every real completion token of every row).
    Without shared prompts K = N and ``source`` is 0 .. N-1; with them a prompt's last token
    predicts the first token of each completion in its tree, so several tokens share a logit.
    """

    input_ids: np.ndarray  # (R, C) int64 real tokens end to end, ``pad_id`` in each row's tail
    position_ids: np.ndarray  # (R, C) int64 0, 1, ... from each sequence's start (and the tail's)
    keep: np.ndarray  # (R, C) bool positions whose logit predicts a completion token
    targets: np.ndarray  # (N,) int64 the completion token to score
    source: np.ndarray  # (N,) int64 which kept logit predicts it (an index into the K kept, row-major)
    rows: np.ndarray  # (N,) int64 its row b in the (B, T) completion layout
    cols: np.ndarray  # (N,) int64 its column t there
    shape: tuple  # (B, T) of the completion layout
    segment: np.ndarray  # (R, C) int64 the tree each position belongs to; -1 in a row's tail
    branch: np.ndarray  # (R, C) int64 0 on a prompt (and the tail), j on the j-th completion of its tree

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed forward, tails included (R * C)."""
        return int(self.input_ids.size)

    @property
    def shared(self) -> bool:
        """Some tree has two completions or more: attention needs the tree mask
        (``attention_mask``), which position ids alone cannot express."""
        return bool((self.branch > 1).any())


def row_lengths(attention_mask: np.ndarray, prompt_len: int):
    """``(prompt lengths (B,), completion lengths (B,))`` of a ``Batch``-layout mask (B, P + T),
    checked to be left-padded prompts and right-padded completions."""
    P = prompt_len
    p_len, c_len = attention_mask[:, :P].sum(1), attention_mask[:, P:].sum(1)
    expect = np.concatenate([np.arange(P)[None] >= P - p_len[:, None],
                             np.arange(attention_mask.shape[1] - P)[None] < c_len[:, None]], 1)
    bad = np.flatnonzero((expect != (attention_mask != 0)).any(1))
    if len(bad):
        raise ValueError(f"attention_mask row {bad[0]} is not a left-padded prompt of width {P} followed by a "
                         f"right-padded completion: {attention_mask[bad[0]].tolist()}")
    return p_len.astype(np.int64), c_len.astype(np.int64)


def prompt_trees(input_ids: np.ndarray, p_len: np.ndarray, c_len: np.ndarray, prompt_len: int,
                 share_prompts: bool = True) -> list:
    """The rows to score (one completion token at least) grouped into trees: lists of row
    indices in order of first appearance. With ``share_prompts`` the rows of a tree have the
    same prompt tokens (a GRPO group, or any prompt that repeats); without, each row is a tree."""
    P = prompt_len
    trees: dict = {}
    for b in np.flatnonzero(c_len > 0).tolist():
        key = input_ids[b, P - p_len[b]: P].tobytes() if share_prompts else b
        trees.setdefault(key, []).append(b)
    return list(trees.values())


def tree_lengths(trees: list, p_len: np.ndarray, c_len: np.ndarray) -> np.ndarray:
    """Tokens each tree puts in a packed forward: its prompt once, then each completion less
    its last token (whose logit predicts nothing)."""
    return np.array([p_len[t[0]] + int((c_len[t] - 1).sum()) for t in trees], np.int64)


def padding_share(input_ids: np.ndarray, attention_mask: np.ndarray, prompt_len: int,
                  share_prompts: bool = True) -> float:
    """Share of the padded forward's tokens that packing leaves out: padding, each row's last
    token, rows with nothing to score and (``share_prompts``) the repeats of a shared prompt.
    0 when packing saves nothing."""
    p_len, c_len = row_lengths(attention_mask, prompt_len)
    trees = prompt_trees(input_ids, p_len, c_len, prompt_len, share_prompts)
    return 1.0 - int(tree_lengths(trees, p_len, c_len).sum()) / max(attention_mask.size, 1)


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple:
    """``(bin (n,), offset (n,), fill (bins,))``: each length placed in the first bin with
    room, longest first (a classic bin-packing heuristic; within 11/9 of the fewest bins).
    Each bin's sequences lie end to end from offset 0 up to its ``fill``."""
    order = np.argsort(-lengths, kind="stable").tolist()
    sizes = lengths.tolist()
    bins, offsets = [0] * len(sizes), [0] * len(sizes)
    fill: list = []
    smallest = min(sizes, default=0)
    open_bins: list = []  # bins that can still take the shortest sequence, in order
    for i in order:
        b = next((b for b in open_bins if fill[b] + sizes[i] <= capacity), None)
        if b is None:
            b = len(fill)
            fill.append(0)
            open_bins.append(b)
        bins[i], offsets[i] = b, fill[b]
        fill[b] += sizes[i]
        if fill[b] + smallest > capacity:
            open_bins.remove(b)
    as_array = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return as_array(bins), as_array(offsets), as_array(fill)


def key_cost(config) -> float:
    """Attention's work per token per key position, relative to the work of a layer's weights
    per token (multiply-adds; a Llama-style layer: q, k, v, o and a gated MLP). A packed row
    of C tokens costs about ``C * (1 + key_cost * C)`` per layer: sdpa and eager compute the
    whole (C, C) score matrix however many sequences share the row."""
    h, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    weights = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim + 3 * h * config.intermediate_size
    return 2 * heads * head_dim / weights  # q.k and the weighted sum of v


def row_capacity(lengths: np.ndarray, cost_per_key: float, max_factor: int = 8) -> int:
    """Tokens per packed row: the multiple k * longest (k = 1 .. ``max_factor``) whose
    first-fit-decreasing packing has the least estimated cost ``rows * C * (1 + cost_per_key * C)``.
    Longer rows leave less room unused (sequences fit together) but cost more attention per token."""
    return packing_cost(lengths, cost_per_key, max_factor)[0]


def packing_cost(lengths: np.ndarray, cost_per_key: float, max_factor: int = 8) -> tuple:
    """``(capacity, estimated cost)`` of the cheapest rows for these sequence (or tree) lengths:
    capacity a multiple k * longest (k = 1 .. ``max_factor``); the cost in token-layer units,
    ``rows * C * (1 + cost_per_key * C)``."""
    lengths = lengths[lengths > 0]
    if not len(lengths):
        return 1, 0.0
    longest, total = int(lengths.max()), int(lengths.sum())
    best, best_cost = longest, None
    for C in range(longest, longest * max_factor + 1, longest):
        at_least = max(-(-total // C), int((2 * lengths > C).sum()))  # rows no packing can go below
        if best_cost is not None and at_least * C * (1.0 + cost_per_key * C) >= best_cost:
            continue
        rows = len(first_fit_decreasing(lengths, C)[2])
        cost = rows * C * (1.0 + cost_per_key * C)
        if best_cost is None or cost < best_cost:
            best, best_cost = C, cost
        if rows == 1:  # longer rows only add tail
            break
    return best, best_cost


def plan_packing(input_ids: np.ndarray, attention_mask: np.ndarray, prompt_len: int, pad_id: int = 0,
                 capacity: Optional[int] = None, share_prompts: bool = True) -> PackPlan:
    """Pack the real tokens of a ``Batch``-layout input (B, P + T) into rows of ``capacity``
    tokens (default and minimum: the longest tree; ``packing_cost`` chooses one for a model).

    Each tree (``prompt_trees``) lies contiguous in one row: its prompt, then each completion
    less its last token, position ids going on from the prompt's end in every completion::

        tokens   [p p p a a | b b b | c]     position ids  [0 1 2 3 4 | 3 4 5 | 3]

    The prompt's last token keeps its logit once for the first token of every completion.
    Rows with no completion token are left out (nothing to score); with none to score at all
    the plan has no rows (R = 0)."""
    B, L = input_ids.shape
    P, T = prompt_len, L - prompt_len
    p_len, c_len = row_lengths(attention_mask, P)
    if ((p_len == 0) & (c_len > 0)).any():
        raise ValueError(f"row {int(np.argmax((p_len == 0) & (c_len > 0)))} has a completion but no prompt token "
                         f"to predict its first token from")
    trees = prompt_trees(input_ids, p_len, c_len, P, share_prompts)
    lengths = tree_lengths(trees, p_len, c_len)
    C = int(max(lengths.max(initial=0), capacity or 0))
    bins, offsets, fill = first_fit_decreasing(lengths, C)
    R = len(fill)
    ids = np.full(R * C, pad_id, np.int64)
    # a row's tail counts from 0 too: a sequence of its own that attends only to itself
    positions = (np.arange(C)[None] - fill[:, None]).reshape(-1)
    segment = np.full(R * C, -1, np.int64)
    branch = np.zeros(R * C, np.int64)
    predictor, rows, cols, targets = [], [], [], []  # per scored token: the flat position predicting it, ...
    for k, members in enumerate(trees):
        start, p = int(bins[k] * C + offsets[k]), int(p_len[members[0]])
        ids[start: start + p] = input_ids[members[0], P - p: P]
        positions[start: start + p] = np.arange(p)
        segment[start: start + lengths[k]] = k
        at = start + p
        for j, b in enumerate(members, 1):
            n = int(c_len[b])  # its tokens 0 .. n-2 go in; the prompt's last token predicts token 0
            ids[at: at + n - 1] = input_ids[b, P: P + n - 1]
            positions[at: at + n - 1] = p + np.arange(n - 1)
            branch[at: at + n - 1] = j
            predictor.append(np.concatenate([[start + p - 1], at + np.arange(n - 1)]))
            rows.append(np.full(n, b, np.int64))
            cols.append(np.arange(n))
            targets.append(input_ids[b, P: P + n])
            at += n - 1
    join = lambda parts: np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)  # noqa: E731
    predicted = join(predictor)  # the positions whose logits predict a target
    keep = np.zeros(R * C, bool)
    keep[predicted] = True
    return PackPlan(
        input_ids=ids.reshape(R, C), position_ids=positions.reshape(R, C), keep=keep.reshape(R, C),
        targets=join(targets), source=(np.cumsum(keep) - 1)[predicted], rows=join(rows), cols=join(cols),
        shape=(B, T), segment=segment.reshape(R, C), branch=branch.reshape(R, C),
    )


def plan_for(model, input_ids: np.ndarray, attention_mask: np.ndarray, prompt_len: int,
             share_prompts: bool = True) -> PackPlan:
    """``plan_packing`` with rows as long as ``packing_cost`` finds cheapest for ``model``, and
    prompts shared only where that is cheaper too: a tree is one sequence, and attention over
    a long tree (long completions) can cost more than its prompt repeats would."""
    p_len, c_len = row_lengths(attention_mask, prompt_len)
    per_key = key_cost(getattr(model, "module", model).config)
    capacity, cost = packing_cost(tree_lengths(prompt_trees(input_ids, p_len, c_len, prompt_len, False),
                                               p_len, c_len), per_key)
    if share_prompts:
        shared = packing_cost(tree_lengths(prompt_trees(input_ids, p_len, c_len, prompt_len, True),
                                           p_len, c_len), per_key)
        if shared[1] < cost:
            return plan_packing(input_ids, attention_mask, prompt_len, capacity=shared[0], share_prompts=True)
    return plan_packing(input_ids, attention_mask, prompt_len, capacity=capacity, share_prompts=False)


def tree_attention_mask(plan: PackPlan, implementation: str, dtype, device,
                        sliding_window: Optional[int] = None) -> torch.Tensor:
    """The (R, 1, C, C) mask of a plan with shared prompts: a position sees the earlier
    positions of its own tree that are its prompt or its own completion (and a tail only
    itself and the tail before it); with ``sliding_window`` W only those less than W
    positions back (position ids count as in the row's own unshared sequence). Boolean
    (True: attend) for sdpa, additive (0 or the dtype's lowest value) for eager, as
    transformers' own mask functions build them."""
    seg, br = torch.from_numpy(plan.segment).to(device), torch.from_numpy(plan.branch).to(device)
    C = seg.shape[1]
    causal = torch.ones(C, C, dtype=torch.bool, device=device).tril()
    mask = (seg[:, :, None] == seg[:, None, :]) & causal & ((br[:, None, :] == 0) | (br[:, :, None] == br[:, None, :]))
    if sliding_window is not None:
        pos = torch.from_numpy(plan.position_ids).to(device)
        mask &= (pos[:, :, None] - pos[:, None, :]) < sliding_window
    mask = mask[:, None]
    if implementation == "sdpa":
        return mask
    if implementation == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
    raise ValueError(f"no tree mask for attention implementation {implementation!r} (packing supports "
                     f"{', '.join(PACKED_ATTENTION)})")


def tree_masks(plan: PackPlan, model, device):
    """What a model of ``PACKED_MODEL_TYPES`` takes as ``attention_mask`` for a shared plan.
    A 4D mask goes to the attention layers as it is, sliding-window layers included, so the
    window goes into the mask: with per-layer types (Qwen2, Qwen3: ``config.layer_types``) a
    dict of one mask per type, which their forward takes in place of building its own;
    without (Mistral) the model's one ``sliding_window``, if any; Llama has none."""
    module = getattr(model, "module", model)
    config = module.config
    window = getattr(config, "sliding_window", None)
    build = lambda w=None: tree_attention_mask(plan, config._attn_implementation, module.dtype, device, w)  # noqa: E731
    layer_types = set(getattr(config, "layer_types", None) or ())
    if not layer_types:
        return build(window)
    unknown = layer_types - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"no tree mask for layer types {sorted(unknown)}; score {type(module).__name__} with "
                         f"share_prompts=False")
    return {t: build(window if t == "sliding_attention" else None) for t in layer_types}


def scatter_completions(values_N: torch.Tensor, plan: PackPlan) -> torch.Tensor:
    """Per-token values in keep order (N,) -> the (B, T) completion layout, 0 where a row has
    no token (differentiable in ``values_N``)."""
    rows = torch.from_numpy(plan.rows).to(values_N.device)
    cols = torch.from_numpy(plan.cols).to(values_N.device)
    return values_N.new_zeros(plan.shape).index_put((rows, cols), values_N)


def transformers_packs() -> bool:
    """The installed transformers reads sequence starts from position ids (its masking utils'
    ``find_packed_sequence_indices``, 5.x); older releases do not, and then every forward is
    scored padded."""
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    return hasattr(masking_utils, "find_packed_sequence_indices")


def supports_packing(model) -> bool:
    """Whether ``model`` (or the module a DeepSpeed engine wraps) takes packed rows: a
    transformers model of a family in ``PACKED_MODEL_TYPES`` with ``PACKED_ATTENTION``."""
    module = getattr(model, "module", model)
    config = getattr(module, "config", None)
    return (transformers_packs()
            and type(module).__module__.startswith("transformers.models.")
            and getattr(config, "model_type", None) in PACKED_MODEL_TYPES
            and getattr(config, "_attn_implementation", None) in PACKED_ATTENTION)
