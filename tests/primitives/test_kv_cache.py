"""The eager decode's cache without its per-step copies (``primitives.model.kv_cache``): room
reserved once and written in place, grouped key/value heads passed to attention unrepeated, and
the same samples as transformers' own cache and attention."""
import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from primitives.model import generation, kv_cache
from tests.primitives.decoding import SAMPLING_IDS, SAMPLINGS, assert_samples_alike, sample


@pytest.fixture
def spied(monkeypatch):
    """Counts of the layers ``reserve`` changed and of the attention products made with grouped heads."""
    counts = {"reserved": 0, "grouped": 0}
    real_reserve, real_sdpa = kv_cache.reserve, torch.nn.functional.scaled_dot_product_attention

    def reserve(*args):
        n = real_reserve(*args)
        counts["reserved"] += n
        return n

    def sdpa(*args, **kwargs):
        counts["grouped"] += bool(kwargs.get("enable_gqa"))
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(kv_cache, "reserve", reserve)
    monkeypatch.setattr(kv_cache, "F", SimpleNamespace(scaled_dot_product_attention=sdpa))  # kv_cache's own calls only
    return counts


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_the_eager_loop_samples_what_transformers_own_cache_samples(tiny_model, tokenizer, spied, monkeypatch,
                                                                   sampling):
    """12 rows of prompts of 4 widths with shared prefills, a model of 4 query heads over 2 key/value
    heads: the same tokens, finish reasons and logprobs (within 1e-5) as with transformers' growing
    cache and repeated heads, and what the trainer recomputes; every layer's cache was reserved,
    and every decode step's attention took the heads grouped. The room grows in steps of 4 here (twice
    in 12 tokens)."""
    monkeypatch.setattr(kv_cache, "ROOM_STEP", 4)
    ours = sample(tiny_model, tokenizer, "eager", **sampling)
    layers = tiny_model.config.num_hidden_layers
    assert spied["reserved"] == layers  # one call, one cache
    steps = max(r.num_tokens for r in ours)  # a prefill, then a step per token
    assert spied["grouped"] == layers * steps  # the prefill's too: its mask is there (left padding)
    monkeypatch.setattr(kv_cache, "reserve", lambda cache, room: 0)
    monkeypatch.setattr(kv_cache, "grouped_attention", contextlib.nullcontext)
    theirs = sample(tiny_model, tokenizer, "eager", **sampling)
    assert_samples_alike(ours, theirs, tiny_model, tokenizer, sampling)


def _filled_layer(rows=3, heads=2, n=4, dim=5, seed=0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(rows, heads, n, dim, generator=g), torch.randn(rows, heads, n, dim, generator=g)
    layer = DynamicLayer()
    layer.update(k, v)
    return layer, k, v


class _Cache:
    def __init__(self, *layers):
        self.layers = list(layers)


def test_reserved_room_grows_in_steps_then_as_before(monkeypatch):
    """Room for 3 more positions in steps of 2: the first two steps are written into one buffer, the
    third into a grown one, each view equal to the concatenation; the fourth, past the room, grows
    by concatenation and frees the buffers; a reorder copies rows as a ``DynamicLayer``'s does, and
    an emptied layer fills again as one does."""
    monkeypatch.setattr(kv_cache, "ROOM_STEP", 2)
    layer, k, v = _filled_layer()
    other, _, _ = _filled_layer(seed=1)
    assert kv_cache.reserve(_Cache(layer), room=3) == 1
    assert type(layer) is kv_cache.ReservedLayer and torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    g = torch.Generator().manual_seed(2)
    new = lambda rows=3: (torch.randn(rows, 2, 1, 5, generator=g), torch.randn(rows, 2, 1, 5, generator=g))  # noqa: E731
    buffers = []
    for step in range(4):
        k1, v1 = new()
        keys, values = layer.update(k1, v1)
        k, v = torch.cat([k, k1], -2), torch.cat([v, v1], -2)
        assert torch.equal(keys, k) and torch.equal(values, v)
        assert layer.get_seq_length() == 5 + step and layer.get_mask_sizes(1) == (6 + step, 0)
        buffers.append(keys.data_ptr())
    assert buffers[0] == buffers[1] != buffers[2]  # 4 + 2 positions, then grown to the limit of 4 + 3
    assert layer._room_keys is None and layer._room_values is None  # past the room: freed
    rows = torch.tensor([2, 0, 0])
    layer.reorder_cache(rows)
    assert torch.equal(layer.keys, k[rows]) and torch.equal(layer.values, v[rows])
    k1, v1 = new()
    keys, values = layer.update(k1, v1)
    assert torch.equal(keys, torch.cat([k[rows], k1], -2)) and torch.equal(values, torch.cat([v[rows], v1], -2))
    assert type(other) is DynamicLayer  # a layer of another cache stays what it was
    layer.reset()  # emptied: filled again as a DynamicLayer is, and rows selected from nothing
    layer.batch_select_indices(torch.tensor([0]))
    k1, v1 = new()
    keys, values = layer.update(k1, v1)
    assert torch.equal(keys, k1) and torch.equal(values, v1)


def test_an_update_of_more_positions_than_a_room_step_grows_to_hold_it(monkeypatch):
    """Steps of 2 positions, room for 6: an update of 3 positions at once (a chunk, not a decode step) and
    then one of 3 more land in place in one buffer grown to hold them, each view the concatenation."""
    monkeypatch.setattr(kv_cache, "ROOM_STEP", 2)
    layer, k, v = _filled_layer()
    kv_cache.reserve(_Cache(layer), room=6)
    g = torch.Generator().manual_seed(3)
    pointers = []
    for _ in range(2):
        k1, v1 = torch.randn(3, 2, 3, 5, generator=g), torch.randn(3, 2, 3, 5, generator=g)
        keys, values = layer.update(k1, v1)
        k, v = torch.cat([k, k1], -2), torch.cat([v, v1], -2)
        assert torch.equal(keys, k) and torch.equal(values, v)
        pointers.append(keys.data_ptr())
    assert layer._room_keys is not None and layer._room_keys.shape[-2] == 4 + 6  # in room to the end
    assert pointers[0] != pointers[1]  # grown once more for the second


def test_rows_selected_keep_their_room():
    """Rows leaving the batch (``batch_select_indices``) take their room along: the next step is
    written in place after the rows kept."""
    layer, k, v = _filled_layer()
    kv_cache.reserve(_Cache(layer), room=2)
    rows = torch.tensor([0, 2])
    layer.batch_select_indices(rows)
    assert torch.equal(layer.keys, k[rows]) and torch.equal(layer.values, v[rows])
    buffer, k1 = layer.keys.data_ptr(), torch.randn(2, 2, 1, 5)
    keys, values = layer.update(k1, -k1)
    assert keys.data_ptr() == buffer
    assert torch.equal(keys, torch.cat([k[rows], k1], -2)) and torch.equal(values, torch.cat([v[rows], -k1], -2))


def test_rows_are_selectable_from_dynamic_layers_only():
    """A cache of plain and reserved dynamic layers may drop rows; one with any other layer (a
    sliding window, linear attention, quantized) may not, nor an empty one."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    class Cache(_Cache):
        def batch_select_indices(self, indices):
            pass

    plain, reserved = _filled_layer()[0], _filled_layer()[0]
    kv_cache.reserve(_Cache(reserved), room=2)
    assert kv_cache.rows_selectable(Cache(plain, reserved))
    assert not kv_cache.rows_selectable(Cache(plain, DynamicSlidingWindowLayer(sliding_window=4)))
    assert not kv_cache.rows_selectable(Cache())
    assert not kv_cache.rows_selectable(_Cache(plain))  # no batch_select_indices


def test_what_reserve_leaves_alone():
    """An empty layer, a layer of another class and a zero room are not changed."""
    empty, filled = DynamicLayer(), _filled_layer()[0]

    class Sliding(DynamicLayer):
        pass

    sliding = Sliding()
    sliding.update(*_filled_layer()[1:])
    assert kv_cache.reserve(_Cache(empty, sliding), room=4) == 0
    assert kv_cache.reserve(_Cache(filled), room=0) == 0
    assert type(empty) is DynamicLayer and type(sliding) is Sliding and type(filled) is DynamicLayer


class _Attention(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("queries", [1, 4])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_grouped_heads_give_the_repeated_heads_product(queries, mask_kind):
    """6 query heads over 2 key/value heads, rows with left padding, one query (a decode step) or
    four (a prefill): the grouped product equals transformers' product over repeated heads (1e-6)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, queries, 8, generator=g)
    k, v = torch.randn(3, 2, 7, 8, generator=g), torch.randn(3, 2, 7, 8, generator=g)
    causal = torch.arange(7)[None, :] <= torch.arange(7 - queries, 7)[:, None]  # the queries are the last positions
    allowed = causal.expand(3, 1, queries, 7).clone()
    allowed[1, :, :, :3] = False  # a left-padded row
    mask = allowed if mask_kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, -1e30)
    module = _Attention()
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    with torch.no_grad(), kv_cache.grouped_attention():
        got, _ = AttentionInterface._global_mapping["sdpa"](module, q, k, v, mask, scaling=0.3)
    assert got.shape == want.shape == (3, queries, 6, 8)
    assert float((got - want).abs().max()) < 1e-6


def test_grouped_attention_leaves_the_rest_to_transformers(monkeypatch):
    """Outside the block, under autograd, without a mask, off the CPU, and in another thread while the
    block is open, transformers' own function runs; the wrapper is installed once, and the block's end puts
    this thread back on transformers' function, also when the block raises."""
    calls = []
    mapping = AttentionInterface._global_mapping
    real = getattr(mapping["sdpa"], kv_cache._WRAPPED, mapping["sdpa"])  # transformers' own
    monkeypatch.setitem(mapping, "sdpa", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k = torch.randn(1, 6, 1, 8), torch.randn(1, 2, 3, 8)
    mask = torch.ones(1, 1, 1, 3, dtype=torch.bool)
    attend = lambda m=mask: mapping["sdpa"](_Attention(), q, k, k, m)  # noqa: E731
    with kv_cache.grouped_attention():
        installed = mapping["sdpa"]
        with kv_cache.grouped_attention():  # nested: the same wrapper
            assert mapping["sdpa"] is installed
        attend()  # grad mode on: transformers'
        with torch.no_grad():
            attend(None)  # no mask: transformers'
            attend()  # grouped: not transformers'
            assert len(calls) == 2
            mapping["sdpa"](_Attention(), q.to("meta"), k.to("meta"), k.to("meta"), mask.to("meta"))
            assert len(calls) == 3  # off the CPU (a GPU's tensors): transformers'
            calls.pop()
            other = threading.Thread(target=lambda: torch.no_grad()(attend)())
            other.start()
            other.join()
            assert len(calls) == 3  # another thread: transformers'
    with torch.no_grad():
        attend()
    assert len(calls) == 4 and mapping["sdpa"] is installed
    with pytest.raises(RuntimeError, match="inside"), kv_cache.grouped_attention():
        raise RuntimeError("inside")
    with torch.no_grad():
        attend()
    assert len(calls) == 5


def test_rows_that_ended_leave_the_batch(tiny_model, tokenizer, monkeypatch):
    """At temperature 1 rows end at different steps (here 3 of 16 early, at two steps): with a share of 0.95 the
    batch drops them as they end, so each decode step computes exactly the rows still running;
    the samples are the ones decoded with every row kept to the end."""
    monkeypatch.setattr(generation, "COMPACT_SHARE", 0.95)  # 15 of 16 rows running is few enough
    batches = []
    handle = tiny_model.register_forward_pre_hook(lambda _, args, kw: batches.append(kw["input_ids"].shape[0]),
                                                  with_kwargs=True)
    try:
        ours = sample(tiny_model, tokenizer, "eager", n=4, temperature=1.0)
    finally:
        handle.remove()
    steps = max(r.num_tokens for r in ours)
    running = [sum(r.num_tokens > t for r in ours) for t in range(1, steps)]  # the rows fed at decode step t
    assert running[0] < len(ours) and len(set(running)) >= 2  # rows ended at two steps or more
    assert batches[-len(running):] == running
    monkeypatch.setattr(generation, "COMPACT_SHARE", 0.0)  # every row decoded to the end
    kept = sample(tiny_model, tokenizer, "eager", n=4, temperature=1.0)
    assert_samples_alike(ours, kept, tiny_model, tokenizer, {"temperature": 1.0})
