"""Decoding over a static KV cache (``primitives.model.static_decode``): the eager loop's tokens
and logprobs for the same seed, buckets that keep a compiled step from recompiling per call, and
the mode each device and model gets. The compiled step is traced with torch.compile's ``eager``
backend here (CUDA graphs need a GPU; ``benchmarks/gpu_step.py`` times them there)."""
import numpy as np
import pytest
import torch

from primitives.model import static_decode
from primitives.model.generation import generate_tokens
from primitives.model.static_decode import bucket_positions, bucket_rows, decode_mode
from primitives.types import GenerationConfig
from tests.primitives.decoding import PROMPTS, SAMPLING_IDS, SAMPLINGS, assert_samples_alike, sample


def test_buckets():
    assert [bucket_rows(n) for n in (1, 2, 3, 4, 5, 12, 16, 17)] == [1, 2, 4, 4, 8, 16, 16, 32]
    assert [bucket_positions(n) for n in (1, 63, 64, 65, 130)] == [64, 64, 64, 128, 192]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_static_cache_samples_what_the_eager_loop_samples(tiny_model, tokenizer, sampling):
    """12 rows (bucketed to 16: 4 rows that repeat the first and are never sampled) of prompts of
    4 widths, shared prefills: the same tokens, finish reasons and logprobs as the eager loop
    from the same seed, and the logprobs are what the trainer recomputes."""
    eager = sample(tiny_model, tokenizer, "eager", **sampling)
    static = sample(tiny_model, tokenizer, "static", **sampling)
    assert_samples_alike(static, eager, tiny_model, tokenizer, sampling)


def test_stop_strings_end_rows_alike(tiny_model, tokenizer):
    eager = sample(tiny_model, tokenizer, "eager", stop=("1",))
    static = sample(tiny_model, tokenizer, "static", stop=("1",))
    assert [(r.completion_ids.tolist(), r.finish_reason) for r in static] == \
        [(r.completion_ids.tolist(), r.finish_reason) for r in eager]
    assert any(r.finish_reason == "stop" for r in static)


@pytest.mark.no_ray
@pytest.mark.slow  # dynamo traces the model four times: the full suite's, not the edit-test loop's
def test_a_traced_step_compiles_once_per_bucket(tiny_model, tokenizer, monkeypatch):
    """The decode step traced by torch.compile (backend ``eager``: dynamo's graph, no CUDA graphs)
    gives the eager loop's tokens, and batches of 3 and 4 rows (one row bucket) and prompts of
    two widths (one position bucket) compile the step once; 5 rows (the next bucket) once more."""
    import torch._dynamo as dynamo

    torch._dynamo.reset()
    real = static_decode.compiled_forward
    monkeypatch.setattr(static_decode, "compiled_forward", lambda model: real(model, backend="eager"))
    monkeypatch.setattr(static_decode, "decode_mode", lambda model, requested, *shape: requested)
    counters = dynamo.utils.counters
    counters.clear()
    eager = sample(tiny_model, tokenizer, "eager", n=1)
    traced = sample(tiny_model, tokenizer, "captured", n=1)
    assert [r.completion_ids.tolist() for r in traced] == [r.completion_ids.tolist() for r in eager]
    first = counters["stats"]["unique_graphs"]
    assert first >= 1
    sample(tiny_model, tokenizer, "captured", n=1, prompts=PROMPTS[:3])  # 3 rows, other widths
    sample(tiny_model, tokenizer, "captured", n=1, prompts=["7+7=", "1+1="] * 2)
    assert counters["stats"]["unique_graphs"] == first
    sample(tiny_model, tokenizer, "captured", n=1, prompts=PROMPTS + ["5"])  # 5 rows: 8
    assert counters["stats"]["unique_graphs"] > first
    torch._dynamo.reset()


@pytest.mark.no_ray
@pytest.mark.slow  # a model built, decoded three times and compiled
def test_one_cache_per_model_reused_by_its_bucket_and_freed_with_it(tokenizer):
    """Batches of one bucket decode into the same cache tensors (a captured step replays rather
    than captures again); another bucket replaces the cache. A copy of the model starts without
    them, and a model that decoded, compiled too, is freed once dropped."""
    import copy
    import gc
    import weakref

    from primitives.fixtures.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    model = build_tiny_model(tokenizer, spec, seed=2)
    sample(model, tokenizer, "static", n=1)  # 4 rows
    (shape, cache) = model.__dict__[static_decode.STATE]["cache"]
    address = cache.layers[0].keys.data_ptr()
    sample(model, tokenizer, "static", n=1, prompts=PROMPTS[:3])  # 3 rows: the same bucket
    assert model.__dict__[static_decode.STATE]["cache"][1] is cache and cache.layers[0].keys.data_ptr() == address
    sample(model, tokenizer, "static", n=2)  # 8 rows
    assert model.__dict__[static_decode.STATE]["cache"][0] == (8, shape[1])
    assert copy.deepcopy(model).__dict__[static_decode.STATE]["cache"] is None
    static_decode.compiled_forward(model, backend="eager")
    dead = weakref.ref(model)
    del model, cache
    gc.collect()
    assert dead() is None


def test_a_call_in_batches_keeps_one_static_cache(tiny_model, tokenizer, monkeypatch):
    """5 rows under ``max_batch_rows`` 3 decode in batches of 3 and 2 rows, both in the 3-row batch's bucket
    (4): one cache for the call, where the 2-row batch alone would take a bucket of 2 and replace it. The
    greedy tokens are the eager loop's; after the call a lone batch takes its own bucket again."""
    shapes = []
    real = static_decode.static_cache
    monkeypatch.setattr(static_decode, "static_cache", lambda model, rows, length: shapes.append(rows) or
                        real(model, rows, length))
    prompts = PROMPTS + ["5"]
    static = sample(tiny_model, tokenizer, "static", n=1, prompts=prompts, max_batch_rows=3, temperature=0.0)
    eager = sample(tiny_model, tokenizer, "eager", n=1, prompts=prompts, temperature=0.0)
    assert shapes == [4, 4]
    assert [r.completion_ids.tolist() for r in static] == [r.completion_ids.tolist() for r in eager]
    sample(tiny_model, tokenizer, "static", n=1, prompts=prompts[:2], temperature=0.0)
    assert shapes == [4, 4, 2]


def test_models_whose_layers_do_not_all_attend_everywhere_decode_eagerly(tokenizer):
    from primitives.fixtures.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    model = build_tiny_model(tokenizer, spec, seed=2)
    assert static_decode.supports_static_cache(model)
    model.config.layer_types = ["full_attention", "sliding_attention"]
    assert decode_mode(model, "auto", torch.device("cuda")) == "eager"
    with pytest.raises(ValueError, match="full attention in every layer"):
        decode_mode(model, "static", torch.device("cpu"))


def test_modes(tiny_model):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decode_mode(tiny_model, "auto", cpu) == "eager"
    assert decode_mode(tiny_model, "auto", cuda) == "captured"
    assert decode_mode(tiny_model, "static", cpu) == "static"
    with pytest.raises(ValueError, match=r"GenerationConfig.decode must be one of .*got 'fast'"):
        decode_mode(tiny_model, "fast", cpu)

    class Custom(torch.nn.Module):
        pass

    assert decode_mode(Custom(), "auto", cuda) == "eager"
    with pytest.raises(ValueError, match=r"decode='static': Custom does not take a static cache"):
        decode_mode(Custom(), "static", cpu)


def test_a_bad_mode_is_refused_before_any_forward(tiny_model, tokenizer):
    calls = []
    hook = tiny_model.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match="GenerationConfig.decode"):
            generate_tokens(tiny_model, tokenizer, [np.array([5, 6])], GenerationConfig(max_new_tokens=3, decode="x"))
    finally:
        hook.remove()
    assert calls == []
