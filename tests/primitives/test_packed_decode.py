"""Decoding with the linear layers' weights packed for oneDNN (``primitives.model.packed_decode``):
the eager loop's tokens and logprobs for the same seed, weights read anew at every call, the
layers given back their own forward, autograd left alone, and the batches ``auto`` packs."""
import copy

import numpy as np
import pytest
import torch

from primitives.model import packed_decode
from primitives.model.generation import generate_tokens
from primitives.model.packed_decode import packed_linears
from primitives.model.static_decode import decode_mode
from primitives.types import GenerationConfig
from tests.primitives.decoding import PROMPTS, SAMPLING_IDS, SAMPLINGS, assert_samples_alike, sample

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@pytest.fixture
def products(monkeypatch):
    """Counts of the packed products and of the weights packed while the test runs."""
    counts = {"products": 0, "packed": 0}
    real_product, real_pack = packed_decode.packed_product, packed_decode.pack

    def product(*args):
        counts["products"] += 1
        return real_product(*args)

    def pack(*args):
        counts["packed"] += 1
        return real_pack(*args)

    monkeypatch.setattr(packed_decode, "packed_product", product)
    monkeypatch.setattr(packed_decode, "pack", pack)
    return counts


def _linears(model) -> int:
    return sum(type(m) is torch.nn.Linear for m in model.modules())


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_packed_layers_sample_what_the_eager_loop_samples(tiny_model, tokenizer, products, sampling):
    """12 rows of prompts of 4 widths, shared prefills, q/k/v with biases (Qwen2): the same tokens,
    finish reasons and logprobs (within 1e-5) as the eager loop from the same seed, and the
    logprobs are what the trainer recomputes; every linear layer ran packed at every forward."""
    eager = sample(tiny_model, tokenizer, "eager", **sampling)
    assert products == {"products": 0, "packed": 0}
    packed = sample(tiny_model, tokenizer, "packed", **sampling)
    assert_samples_alike(packed, eager, tiny_model, tokenizer, sampling)
    layers, forwards = _linears(tiny_model), max(r.num_tokens for r in eager)  # a prefill, then a step a token
    assert products["packed"] == layers == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    assert products["products"] == layers * forwards


def test_a_call_packs_the_weights_as_they_are_then(tiny_model, tokenizer):
    """Weights changed in place between two calls (as a sync's copy writes them, through ``.data``,
    which no version counter sees) are the ones the next call samples from."""
    model = copy.deepcopy(tiny_model)
    before = sample(model, tokenizer, "packed", n=2)
    with torch.no_grad():
        for p in model.parameters():
            p.data.copy_(p.data * 1.5 + 0.01)
    after_packed = sample(model, tokenizer, "packed", n=2)
    after_eager = sample(model, tokenizer, "eager", n=2)
    assert [r.completion_ids.tolist() for r in after_packed] == [r.completion_ids.tolist() for r in after_eager]
    assert max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in zip(after_packed, after_eager)) < 1e-5
    assert [r.completion_ids.tolist() for r in after_packed] != [r.completion_ids.tolist() for r in before]


def test_chunks_of_one_call_share_one_packing(tiny_model, tokenizer, products):
    """``batch_size`` 4 decodes the 12 rows in 3 batches; the weights are packed once for them all."""
    chunked = sample(tiny_model, tokenizer, "packed", batch_size=4)
    assert products["packed"] == _linears(tiny_model)
    whole = sample(tiny_model, tokenizer, "eager", batch_size=4)
    assert [r.completion_ids.tolist() for r in chunked] == [r.completion_ids.tolist() for r in whole]


def test_the_block_gives_the_layers_back(tiny_model):
    """Inside, every linear layer has a forward of its own and a nested block packs nothing;
    after it, even when it ends in an error, no layer keeps one and no mark stays on the model."""
    layers = [m for m in tiny_model.modules() if type(m) is torch.nn.Linear]
    with pytest.raises(RuntimeError, match="inside"):
        with packed_linears(tiny_model, rows=4) as count:
            assert count == len(layers) and all("forward" in m.__dict__ for m in layers)
            with packed_linears(tiny_model) as inner:
                assert inner == 0
            assert all("forward" in m.__dict__ for m in layers)  # the inner block took nothing away
            raise RuntimeError("inside")
    assert not any("forward" in m.__dict__ for m in tiny_model.modules())
    assert packed_decode.ACTIVE not in tiny_model.__dict__


def test_products_and_gradients_inside_the_block(products):
    """A layer with a bias: the packed product equals ``F.linear`` on 1-D, 2-D and 3-D inputs and on a
    transposed one; with grad on and a weight that trains, autograd's own product runs and its
    gradients are the ones outside the block."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40)
    inputs = [torch.randn(24), torch.randn(5, 24), torch.randn(2, 3, 24), torch.randn(24, 6).t()]
    with torch.no_grad():
        plain = [layer(x) for x in inputs]
    x = torch.randn(6, 24)
    layer(x).square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    with packed_linears(layer, rows=5) as count:
        assert count == 1
        with torch.no_grad():
            for p, y in zip(inputs, plain):
                assert _close(layer(p), y)
        seen = products["products"]
        layer(x).square().sum().backward()
        assert products["products"] == seen == len(inputs)
    for p, g in zip(layer.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-5, atol=1e-5))


def test_what_is_not_packed(tiny_model, monkeypatch):
    """Weights under ``PACK_MIN_BYTES`` (16 MiB: a 4096 x 1024 float32 weight packs, 4095 x 1024
    does not), bfloat16 weights, a subclass of Linear (its forward may do more) and ZeRO-3's
    partitioned parameters (``ds_id``: no weight between forwards) are left alone."""
    monkeypatch.setattr(packed_decode, "PACK_MIN_BYTES", 16 << 20)
    sizes = torch.nn.Sequential(torch.nn.Linear(1024, 4096, bias=False), torch.nn.Linear(1024, 4095, bias=False))
    with packed_linears(sizes) as count:
        assert count == 1 and "forward" in sizes[0].__dict__ and "forward" not in sizes[1].__dict__
    assert not packed_decode.can_pack(tiny_model)
    monkeypatch.setattr(packed_decode, "PACK_MIN_BYTES", 0)
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    assert not packed_decode.can_pack(torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.bfloat16)))
    assert not packed_decode.can_pack(torch.nn.Sequential(Scaled(4, 4)))
    mixed = torch.nn.Sequential(Scaled(4, 4), torch.nn.Linear(4, 4))
    with packed_linears(mixed) as count:
        assert count == 1 and "forward" not in mixed[0].__dict__
    zero3 = copy.deepcopy(tiny_model)
    next(zero3.parameters()).ds_id = 0
    assert packed_decode.can_pack(tiny_model) and not packed_decode.can_pack(zero3)


def test_modes(tiny_model):
    """``auto`` packs on a CPU from 8 rows and 16 new tokens; ``packed`` is refused where nothing packs."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    rows, steps = packed_decode.PACK_MIN_ROWS, packed_decode.PACK_MIN_STEPS
    assert decode_mode(tiny_model, "auto", cpu, rows, steps) == "packed"
    assert decode_mode(tiny_model, "auto", cpu, rows - 1, steps) == "eager"
    assert decode_mode(tiny_model, "auto", cpu, rows, steps - 1) == "eager"
    assert decode_mode(tiny_model, "auto", cuda, rows, steps) == "captured"
    assert decode_mode(tiny_model, "eager", cpu, rows, steps) == "eager"
    assert decode_mode(tiny_model, "packed", cpu, 1, 1) == "packed"
    with pytest.raises(ValueError, match="decode='packed' packs float32 linear layers .* on cuda"):
        decode_mode(tiny_model, "packed", cuda)
    with pytest.raises(ValueError, match="Sequential on cpu has none"):
        decode_mode(torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.bfloat16)), "packed", cpu)


def test_auto_packs_a_big_batch_and_not_a_single_row(tiny_model, tokenizer, products):
    """Through ``generate_tokens``, with the module's default ``PACK_MIN_BYTES``: 12 rows x 16 tokens pack
    every linear layer, the tiny model's small ones too; one row (a tool turn) and 12 rows x 15 tokens
    do not pack."""
    ids = [np.array([5, 6, 7])] * 12
    generate_tokens(tiny_model, tokenizer, ids, GenerationConfig(max_new_tokens=16), torch.Generator().manual_seed(0))
    assert products["packed"] == _linears(tiny_model)
    generate_tokens(tiny_model, tokenizer, ids[:1], GenerationConfig(max_new_tokens=16),
                    torch.Generator().manual_seed(0))
    generate_tokens(tiny_model, tokenizer, ids, GenerationConfig(max_new_tokens=15), torch.Generator().manual_seed(0))
    assert products["packed"] == _linears(tiny_model)


def test_a_forward_set_by_someone_else_is_kept(products):
    """A layer that already has a forward of its own (accelerate's hooks set one) is not packed and
    keeps it; one given a forward by someone else inside the block keeps that one after it."""
    torch.manual_seed(0)
    hooked, other = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(hooked, other)
    hook = hooked.forward = lambda x: torch.nn.Linear.forward(hooked, x) + 1
    with packed_linears(model) as count:
        assert count == 1 and hooked.__dict__["forward"] is hook
        later = other.forward = lambda x: torch.nn.Linear.forward(other, x) * 2
    assert hooked.__dict__["forward"] is hook and other.__dict__["forward"] is later
    assert products["packed"] == 1


def test_an_input_off_the_cpu_or_not_float32_takes_the_layers_own_product(monkeypatch, products):
    """The packed product runs only for float32 inputs on the CPU; a float64 input and one on
    another device (``meta`` here) go to ``F.linear``, as without the block."""
    layer = torch.nn.Linear(6, 4)
    own = []
    monkeypatch.setattr(packed_decode.F, "linear", lambda x, w, b: own.append(x.dtype) or torch.zeros(()))
    with packed_linears(layer), torch.no_grad():
        layer(torch.ones(2, 6))
        layer(torch.ones(2, 6, dtype=torch.float64))
        layer(torch.ones(2, 6, device="meta"))
    assert products["products"] == 1 and own == [torch.float64, torch.float32]


def test_adapters_over_packed_base_layers(tiny_model, tokenizer, products):
    """A PEFT model (what ``model.lora`` builds): its wrappers are not plain ``Linear``s and are not
    packed; the plain layers under them are (the base layers, the head, and here, where every size
    packs, the adapters' A and B), and the adapters (B made nonzero, so they move the logits) add to
    the base products as without packing: the eager loop's samples, within 1e-5."""
    from primitives.model.lora import with_lora
    from primitives.types import LoraConfig

    torch.manual_seed(3)
    model = with_lora(copy.deepcopy(tiny_model), LoraConfig(rank=4, alpha=8.0)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    base = sample(tiny_model, tokenizer, "eager")
    eager = sample(model, tokenizer, "eager")
    assert [r.completion_ids.tolist() for r in eager] != [r.completion_ids.tolist() for r in base]  # adapters act
    packed = sample(model, tokenizer, "packed")
    assert_samples_alike(packed, eager, model, tokenizer, {"temperature": 1.0})
    assert products["packed"] == _linears(model) == _linears(tiny_model) + 2 * 14  # and A, B on 14 projections


def test_a_generator_workers_engine_packs_its_batch(tiny_model, tokenizer, products):
    """``HFEngine.generate`` (what an HF generator worker and a trainer rank call) with ``decode: auto``:
    4 prompts x 3 samples x 16 tokens pack once, and sample what the eager loop samples from the same
    sampler key."""
    from primitives.io.data import PromptItem
    from rl_actors.hf_engine import HFEngine

    engine = HFEngine(tiny_model, tokenizer)
    items = [PromptItem(i, p) for i, p in enumerate(PROMPTS)]
    auto = engine.generate(items, GenerationConfig(max_new_tokens=16, n=3), 0, engine.sampler(0, 0, 0, items))
    assert products["packed"] == _linears(tiny_model)
    eager = engine.generate(items, GenerationConfig(max_new_tokens=16, n=3, decode="eager"), 0,
                            engine.sampler(0, 0, 0, items))
    assert products["packed"] == _linears(tiny_model)
    assert_samples_alike(auto, eager, tiny_model, tokenizer, {"temperature": 1.0})
