"""The tied embedding's gradient folded (``primitives.model.tied_gradient``): the gradients PyTorch's own
modules give, without the two (V, H) temporaries, and nothing changed where the pair cannot be folded."""
import copy

import numpy as np
import pytest
import torch
from torch.profiler import profile

from primitives.fixtures.tiny import TinyModelSpec, build_tiny_model
from primitives.maths import algorithms as algos
from primitives.maths.batching import make_batch
from primitives.model import tied_gradient as tg
from primitives.model.training import (
    forward_backward,
    loss_fn_forward_backward,
    sft_forward_backward,
    step_counts,
)
from tests.primitives.test_training import scored  # noqa: F401 (a fixture)


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(got: dict, want: dict) -> None:
    """Bit for bit: the fold changes how the two parts are made, not their values or their sum's order."""
    assert got.keys() == want.keys()
    for n, w in want.items():
        err = float((got[n] - w).abs().max())
        assert torch.equal(got[n], w), f"{n}: gradients differ by up to {err} (largest {float(w.abs().max())})"


def _both(model, run) -> tuple:
    """``run(model)``'s gradients with PyTorch's own pair, then folded, on two copies of ``model``."""
    out = []
    for on in (False, True):
        m = copy.deepcopy(model)
        m.zero_grad(set_to_none=True)
        with tg.folding(on):
            run(m)
        out.append(_grads(m))
    return tuple(out)


def _sft_arrays(tokenizer, rows=5, length=9, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, len(tokenizer), size=(rows, length))
    attn = np.ones_like(ids)
    for i in range(rows):  # right padding of several lengths, the pad id in the ids
        attn[i, length - i:] = 0
        ids[i, length - i:] = tokenizer.pad_token_id
    return ids, attn, attn.copy()


@pytest.mark.parametrize("packing", [True, False])
def test_rl_step_gradients_are_pytorchs(tiny_model, tokenizer, scored, packing, monkeypatch):  # noqa: F811
    """Every parameter's accumulated gradient over several micro-batches, packed and padded, as PyTorch's
    modules make it."""
    import primitives.model.logprobs as lp

    monkeypatch.setattr(lp, "PACK_MIN_SHARE", 0.0 if packing else 2.0)
    algo = algos.grpo(kl_coef=0.0)
    batch = make_batch(scored, algo, tokenizer.pad_token_id)
    assert (batch.input_ids == tokenizer.pad_token_id).any()
    plain, folded = _both(tiny_model, lambda m: forward_backward(m, batch, algo, step_counts(batch),
                                                                micro_batch_size=5))
    _same(folded, plain)


def test_sft_and_user_loss_gradients_are_pytorchs(tiny_model, tokenizer):
    ids, attn, lm = _sft_arrays(tokenizer)
    plain, folded = _both(tiny_model, lambda m: sft_forward_backward(m, ids, attn, lm, int(lm[:, 1:].sum()), 2))
    _same(folded, plain)

    def loss_fn(logits, labels, mask, advantages):
        logp = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return -(logp * mask * advantages[:, None]).sum() / mask.sum()

    arrays = {"input_ids": ids, "attention_mask": attn, "advantages": np.linspace(-1, 1, len(ids))}
    plain, folded = _both(tiny_model, lambda m: loss_fn_forward_backward(m, arrays, loss_fn, len(ids), 2))
    _same(folded, plain)


def _loss(model, ids):
    return model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()


def test_kept_buffer_is_rezeroed_between_passes(tiny_model, tokenizer):
    """The second backward touches other rows than the first: the first's rows must not leak into it,
    whatever rows either used (random ids, several passes, gradients cleared between). The pad id, attended
    here, is the embedding's padding row: nn.Embedding gives it no gradient (the head's part it keeps)."""
    V, pad = tiny_model.config.vocab_size, tokenizer.pad_token_id
    assert tiny_model.get_input_embeddings().padding_idx == pad
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, V, (2, 3 + k), generator=gen) for k in range(5)]
    batches.insert(1, torch.full((1, 4), 7))  # one row alone after many
    batches[3][:, 1:] = pad
    want, got = [], []
    for on, out in ((False, want), (True, got)):
        m = copy.deepcopy(tiny_model)
        with tg.folding(on), tg.folded_tied_gradient(m):
            for ids in batches:
                m.zero_grad(set_to_none=True)
                _loss(m, ids).backward()
                out.append(_grads(m))
    for g, w in zip(got, want):
        _same(g, w)
    assert tg._SCATTERS[m.get_input_embeddings()].buffer is not None  # kept on CPU


def test_two_graphs_in_one_backward_and_a_dropped_graph(tiny_model):
    """Two forward passes before one backward of both: the engine holds the first's scatter (with no head
    part to add it into) when the second scatters, which then takes a new buffer. A forward whose graph is
    dropped unused changes nothing; the kept buffer is the same one from pass to pass."""
    a, b = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[4, 5, 6], [9, 9, 1]])

    def body(m, ids):  # the hidden states alone: no head in the backward
        return m.model(input_ids=ids).last_hidden_state.pow(2).mean()

    def run(m):
        with tg.folded_tied_gradient(m):
            _loss(m, b)  # dropped: its graph dies here
            (_loss(m, a) + 2 * _loss(m, b)).backward()
            kept = tg._SCATTERS.get(m.get_input_embeddings())
            buf = None if kept is None else kept.buffer
            (body(m, a) + body(m, b)).backward()
            assert kept is None or kept.buffer is buf  # the one the engine held was left, then used again

    plain, folded = _both(tiny_model, run)
    _same(folded, plain)


def test_no_vocabulary_sized_temporaries(tokenizer):
    """The reason for the fold: PyTorch's own pair zeroes a new (V, H) tensor and adds out of place into
    another; folded, after the first pass neither is made (the one (V, H) add left is in place)."""
    model = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=64, intermediate_size=96, num_hidden_layers=1))
    V, H = model.get_input_embeddings().weight.shape
    ids = torch.randint(0, V, (3, 11), generator=torch.Generator().manual_seed(0))

    def made(on: bool) -> set:
        with tg.folding(on), tg.folded_tied_gradient(model):
            _loss(model, ids).backward()  # the first pass makes the kept buffer
            model.zero_grad(set_to_none=True)
            with profile(record_shapes=True) as prof:
                _loss(model, ids).backward()
        return {e.name for e in prof.events() if any(list(s) == [V, H] for s in e.input_shapes)}

    plain, folded = made(False), made(True)
    zeroing = {"aten::fill_", "aten::zero_"}
    assert "aten::add" in plain and zeroing & plain  # if PyTorch stops making these, the fold is moot
    assert not ({"aten::add"} | zeroing) & folded
    assert "aten::add_" in folded


def test_forward_without_gradients_is_untouched(tiny_model):
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        want = tiny_model(input_ids=ids).logits
        with tg.folded_tied_gradient(tiny_model):
            got = tiny_model(input_ids=ids).logits
    assert torch.equal(got, want)
    assert "forward" not in vars(tiny_model.get_input_embeddings())  # put back on leaving


def _untied(tokenizer):
    m = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone())
    return m


def _frozen(tokenizer):
    m = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    m.get_input_embeddings().weight.requires_grad_(False)
    return m


def _zero3(tokenizer):
    m = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    m.get_input_embeddings().weight.ds_id = 0  # what ZeRO-3 marks its partitioned parameters with
    return m


def _biased(tokenizer):
    m = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    m.lm_head.bias = torch.nn.Parameter(torch.zeros(m.config.vocab_size))
    return m


def _scaled(tokenizer):
    m = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    m.get_input_embeddings().scale_grad_by_freq = True
    return m


def _patched(tokenizer):
    m = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    emb = m.get_input_embeddings()
    emb.forward = lambda ids: torch.nn.functional.embedding(ids, emb.weight)  # someone else's
    return m


def _bf16(tokenizer):
    return build_tiny_model(tokenizer, TinyModelSpec(hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=1)).to(torch.bfloat16)


def _off_the_cpu(tokenizer):  # the device rule, on the one device every machine has besides the CPU
    m = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    m = m.to("meta")
    m.lm_head.weight = m.get_input_embeddings().weight  # the move untied them
    return m


@pytest.mark.parametrize("make", [_untied, _frozen, _zero3, _biased, _scaled, _patched, _bf16, _off_the_cpu])
def test_pairs_it_cannot_fold_are_left_alone(tokenizer, make):
    m = make(tokenizer)
    emb, head = m.get_input_embeddings(), m.get_output_embeddings()
    before = (vars(emb).get("forward"), vars(head).get("forward"))
    with tg.folded_tied_gradient(m):
        assert (vars(emb).get("forward"), vars(head).get("forward")) == before
    assert (vars(emb).get("forward"), vars(head).get("forward")) == before


def test_forwards_restored_after_an_error_and_nesting_is_harmless(tiny_model):
    emb, head = tiny_model.get_input_embeddings(), tiny_model.get_output_embeddings()
    assert tg.tied_pair(tiny_model) == (emb, head)
    with pytest.raises(RuntimeError, match="inside"):
        with tg.folded_tied_gradient(tiny_model):
            assert "forward" in vars(emb) and "forward" in vars(head)
            with tg.folded_tied_gradient(tiny_model):  # the inner one leaves the outer's in place
                pass
            assert "forward" in vars(emb) and "forward" in vars(head)
            raise RuntimeError("inside")
    assert "forward" not in vars(emb) and "forward" not in vars(head)


def test_a_torch_without_the_use_counts_takes_a_new_buffer_each_time(tiny_model, monkeypatch):
    """``held_elsewhere`` reads private counts; without them every scatter after the first takes a new
    buffer: the same gradients."""
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    ids = [torch.tensor([[1, 2, 3, 4]]), torch.tensor([[5, 6], [7, 8]])]
    assert tg.held_elsewhere(torch.zeros(2))

    def run(m):
        with tg.folded_tied_gradient(m):
            for x in ids:
                _loss(m, x).backward()

    plain, folded = _both(tiny_model, run)
    _same(folded, plain)


def test_a_retained_graph_backwarded_again_with_another(tiny_model):
    """A graph kept by ``retain_graph`` and backwarded again together with a second one: the engine holds the
    first's scatter (no head part to add it into) when the second scatters, which then takes a new buffer."""
    a, b = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[10, 11, 12]])

    def body(m, ids):
        return m.model(input_ids=ids).last_hidden_state.pow(2).sum()

    def run(m):
        with tg.folded_tied_gradient(m):
            la = body(m, a)
            la.backward(retain_graph=True)
            (la + body(m, b)).backward()
            la2 = _loss(m, a)
            la2.backward(retain_graph=True)
            (la2 + _loss(m, b)).backward()

    plain, folded = _both(tiny_model, run)
    _same(folded, plain)


def test_ids_the_caller_rewrites_between_passes(tokenizer):
    """The rows to zero next are the ids' own copy: an SFT caller that reuses one array for each batch (its
    rows rewritten in place) must not make the fold zero the new batch's rows and leave the old ones. The
    model has no padding id (as Qwen2.5's configs), so no mask copies the ids on the way."""
    model = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    emb = model.get_input_embeddings()
    emb.padding_idx = None
    ids = np.array([[5, 6, 7, 8, 9]])
    ones = np.ones_like(ids)

    def run(m):
        with tg.folded_tied_gradient(m):
            for first in (5, 40):
                ids[:] = np.arange(first, first + ids.shape[1])
                m.zero_grad(set_to_none=True)
                sft_forward_backward(m, ids, ones, ones, int(ones[:, 1:].sum()))

    plain, folded = _both(model, run)
    _same(folded, plain)


class _Tied(torch.nn.Module):
    """An embedding, one layer and a tied head: enough for a double backward (SDPA on CPU has none)."""

    def __init__(self, V=50, H=8):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mid = torch.nn.Embedding(V, H), torch.nn.Linear(H, H)
        self.head = torch.nn.Linear(H, V, bias=False)
        self.head.weight = self.emb.weight

    def get_input_embeddings(self):
        return self.emb

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def test_autocast_and_double_backward_run_as_pytorchs(tiny_model):
    """Under autocast the pair is left as it is (the head's product would mix dtypes); a double backward
    (``create_graph``) gets a gradient that is part of a graph, and no kept buffer is made part of one."""
    ids = torch.tensor([[3, 1, 4, 1, 5]])

    def autocast(m):
        with tg.folded_tied_gradient(m):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = m(input_ids=ids).logits
            logits.float().logsumexp(-1).sum().backward()

    plain, folded = _both(tiny_model, autocast)
    _same(folded, plain)

    def double(m):
        with tg.folded_tied_gradient(m):
            m(ids).logsumexp(-1).sum().backward()  # a kept buffer first
            (g,) = torch.autograd.grad(m(ids).logsumexp(-1).sum(), m.emb.weight, create_graph=True)
            g.pow(2).sum().backward()
            kept = tg._SCATTERS.get(m.emb)
            assert kept is None or not kept.buffer.requires_grad

    plain, folded = _both(_Tied(), double)
    for n, w in plain.items():  # the second derivative goes through the fold's own backward: rounding apart
        torch.testing.assert_close(folded[n], w, rtol=1e-6, atol=1e-6 * float(w.abs().max()))


def test_a_model_copied_or_pickled_inside_the_block(tiny_model):
    """A copy made while the block is open runs its own weights through its class's forward (it is not
    folded), and the model pickles."""
    import pickle

    m = copy.deepcopy(tiny_model)
    ids = torch.tensor([[2, 7, 1, 8]])
    with tg.folded_tied_gradient(m):
        twin = copy.deepcopy(m)
        thawed = pickle.loads(pickle.dumps(m))
    twin.get_input_embeddings().weight.data.add_(1.0)  # the copy's own weight, not the original's
    want = copy.deepcopy(twin)  # the copy without the block's forwards
    for mod in (want.get_input_embeddings(), want.get_output_embeddings()):
        vars(mod).pop("forward", None)
    with torch.no_grad():
        assert torch.equal(thawed(input_ids=ids).logits, m(input_ids=ids).logits)
        assert torch.equal(twin(input_ids=ids).logits, want(input_ids=ids).logits)
    for x in (twin, want):
        x.zero_grad(set_to_none=True)
        _loss(x, ids).backward()
    _same(_grads(twin), _grads(want))


def test_checkpointed_layers(tiny_model, tokenizer):
    """Each decoder layer recomputed in the backward (``gradient_checkpointing``): the same gradients."""
    from primitives.model.training import enable_gradient_checkpointing

    model = copy.deepcopy(tiny_model)
    enable_gradient_checkpointing(model, "trainer")
    ids, attn, lm = _sft_arrays(tokenizer, seed=5)
    plain, folded = _both(model, lambda m: sft_forward_backward(m, ids, attn, lm, int(lm[:, 1:].sum()), 2))
    _same(folded, plain)
