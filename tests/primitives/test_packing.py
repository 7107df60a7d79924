"""Sequence packing (primitives/model/packing.py): the plan worked out by hand, and packed scoring equal
to padded scoring - logprobs, entropies, gradients, micro-batches, temperature, forward_backward -
on the embedded tiny Qwen2 and on small random Llama, Qwen3 and Mistral models (fp32, 1e-5), with
distinct prompts and with prompts shared by several rows (run once, under a tree mask)."""
import numpy as np
import pytest
import torch

from primitives.maths import algorithms as algos
from primitives.maths.batching import make_batch
from primitives.model import logprobs as lp
from primitives.model import packing
from primitives.model.logprobs import completion_logprobs, rollout_logprobs
from primitives.model.packing import (
    first_fit_decreasing,
    key_cost,
    padding_share,
    plan_packing,
    row_capacity,
    scatter_completions,
    supports_packing,
    tree_attention_mask,
)
from primitives.model.training import forward_backward, step_counts, with_old_logprobs
from primitives.padding import pack_completions
from primitives.types import Rollout

ATOL = 1e-5

# prompt and completion lengths: a length-1 completion, a length-1 prompt, and a row whose
# completion is empty (all padding, loss mask 0)
PROMPT_LENS = (5, 2, 7, 1, 4, 6, 3, 5)
COMPLETION_LENS = (4, 1, 6, 3, 0, 2, 5, 1)
# "shared": rows with the same prompt (by index into PROMPT_LENS): rows 0, 2, 6 share row 0's
# (rows 0 and 2 also in the first micro-batch of 3), rows 1 and 5 row 1's (row 1 a single token,
# predicted by the prompt's last logit alone), rows 3 and 4 row 3's (row 4 has nothing to score)
SHARED_PROMPT_OF = (0, 1, 0, 3, 3, 1, 0, 7)


def _rollouts(vocab: int, seed: int = 0, prompts: str = "distinct"):
    rng = np.random.default_rng(seed)
    own = [rng.integers(4, vocab, p).astype(np.int64) for p in PROMPT_LENS]
    if prompts == "shared":
        own = [own[j] for j in SHARED_PROMPT_OF]
    out = []
    for i, (p, c) in enumerate(zip(own, COMPLETION_LENS)):
        out.append(Rollout(
            uid=f"e0/i{i // 2}/s{i % 2}", group=f"e0/i{i // 2}", prompt="x",
            prompt_ids=p,
            completion_ids=rng.integers(4, vocab, c).astype(np.int64),
            loss_mask=np.ones(c, np.float32), logprobs=rng.uniform(-3, -0.1, c).astype(np.float32),
            reward=float(rng.uniform()), ref_logprobs=rng.uniform(-3, -0.1, c).astype(np.float32)))
    return out


def _inputs(rollouts, pad_id=0):
    ids, mask, P, T = pack_completions([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id)
    return torch.from_numpy(ids), torch.from_numpy(mask), P, T


def _small(kind: str, attn: str = "sdpa", **extra):
    """A randomly initialised model of family ``kind``, built from a config (no download)."""
    import transformers

    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, **extra)
    config = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config, "qwen2": transformers.Qwen2Config,
              "mistral": transformers.MistralConfig}[kind](**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    assert model.config._attn_implementation == attn
    return model.eval()


@pytest.fixture(scope="module", params=["tiny", "llama", "llama-eager", "qwen3", "mistral", "mistral-window-3",
                                        "qwen2-window-3"])
def model(request, tiny_model):
    if request.param == "tiny":
        return tiny_model
    if request.param == "llama-eager":
        return _small("llama", "eager")
    if request.param == "mistral-window-3":  # every layer sees 3 positions back: the tree mask must too
        return _small("mistral", sliding_window=3)
    if request.param == "qwen2-window-3":  # layer 0 full attention, layer 1 a window of 3
        model = _small("qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=1)
        assert model.config.layer_types == ["full_attention", "sliding_attention"]
        return model
    return _small(request.param)


def _vocab(model):
    return model.config.vocab_size


# ----------------------------------------------------------------------------- the plan by hand

def test_first_fit_decreasing_by_hand():
    bins, offsets, fill = first_fit_decreasing(np.array([3, 5, 2, 4, 1]), capacity=5)
    # 5 -> bin 0; 4 -> bin 1; 3 -> bin 2; 2 -> bin 2 (3+2); 1 -> bin 1 (4+1)
    assert bins.tolist() == [2, 0, 2, 1, 1] and offsets.tolist() == [0, 0, 3, 0, 4]
    assert fill.tolist() == [5, 5, 5]


def test_plan_by_hand():
    # P = 3, T = 3; row 0: prompt [11 12], completion [21 22 23]; row 1: prompt [13 14 15],
    # completion [24]; row 2: prompt [16], completion empty (nothing to score)
    ids = np.array([[0, 11, 12, 21, 22, 23], [13, 14, 15, 24, 0, 0], [0, 0, 16, 0, 0, 0]])
    mask = np.array([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0]])
    plan = plan_packing(ids, mask, prompt_len=3, pad_id=9)
    # lengths without each last token: 4 and 3; capacity 4 -> two rows, the second with a tail of 1
    assert plan.input_ids.tolist() == [[11, 12, 21, 22], [13, 14, 15, 9]]
    assert plan.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]
    assert plan.keep.tolist() == [[False, True, True, True], [False, False, True, False]]
    assert plan.targets.tolist() == [21, 22, 23, 24]
    assert plan.rows.tolist() == [0, 0, 0, 1] and plan.cols.tolist() == [0, 1, 2, 0]
    assert plan.shape == (3, 3) and plan.num_tokens == 8
    # 7 of the 18 padded tokens are needed (no prompt repeats: sharing changes nothing)
    assert padding_share(ids, mask, 3) == pytest.approx(1 - 7 / 18)
    assert padding_share(ids, mask, 3, share_prompts=False) == pytest.approx(1 - 7 / 18)
    assert not plan.shared
    # a capacity of 8 takes both sequences in one row
    one = plan_packing(ids, mask, prompt_len=3, pad_id=9, capacity=8)
    assert one.input_ids.tolist() == [[11, 12, 21, 22, 13, 14, 15, 9]]
    assert one.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert one.targets.tolist() == [21, 22, 23, 24]
    got = scatter_completions(torch.tensor([1.0, 2.0, 3.0, 4.0]), plan)
    assert got.tolist() == [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_shared_prompt_plan_and_mask_by_hand():
    # P = 3, T = 3; rows 0, 1 and 3 share the prompt [11 12]: row 0 completes [21 22 23], row 1
    # [24 27], row 3 nothing; row 2: prompt [16], completion [25 26]
    ids = np.array([[0, 11, 12, 21, 22, 23], [0, 11, 12, 24, 27, 0], [0, 0, 16, 25, 26, 0], [0, 11, 12, 0, 0, 0]])
    mask = np.array([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]])
    plan = plan_packing(ids, mask, prompt_len=3, pad_id=9)
    # trees: [11 12 | 21 22 | 24] (5 tokens) and [16 | 25] (2); capacity 5 -> two rows
    assert plan.input_ids.tolist() == [[11, 12, 21, 22, 24], [16, 25, 9, 9, 9]]
    assert plan.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 1, 2]]
    assert plan.segment.tolist() == [[0, 0, 0, 0, 0], [1, 1, -1, -1, -1]]
    assert plan.branch.tolist() == [[0, 0, 1, 1, 2], [0, 1, 0, 0, 0]]
    assert plan.keep.tolist() == [[False, True, True, True, True], [True, True, False, False, False]]
    # 12 (the prompt's last token) predicts 21 and 24: one kept logit, index 0, for both
    assert plan.targets.tolist() == [21, 22, 23, 24, 27, 25, 26]
    assert plan.source.tolist() == [0, 1, 2, 0, 3, 4, 5]
    assert plan.rows.tolist() == [0, 0, 0, 1, 1, 2, 2] and plan.cols.tolist() == [0, 1, 2, 0, 1, 0, 1]
    assert plan.shared
    # 7 of 24 padded tokens shared, 9 unshared (4 + 3 + 2)
    assert padding_share(ids, mask, 3) == pytest.approx(1 - 7 / 24)
    assert padding_share(ids, mask, 3, share_prompts=False) == pytest.approx(1 - 9 / 24)
    sdpa = tree_attention_mask(plan, "sdpa", torch.float32, "cpu")
    assert sdpa.shape == (2, 1, 5, 5) and sdpa.dtype == torch.bool
    assert sdpa[0, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0],
                                         [1, 1, 0, 0, 1]]  # 24 sees its prompt and itself, not 21 22
    assert sdpa[1, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                                         [0, 0, 1, 1, 1]]  # the tail only sees the tail
    # a window of 2: 2 positions back at most, counted in each row's own sequence (24 is at 2)
    window = tree_attention_mask(plan, "sdpa", torch.float32, "cpu", sliding_window=2)
    assert window[0, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0],
                                           [0, 1, 0, 0, 1]]
    eager = tree_attention_mask(plan, "eager", torch.float32, "cpu")
    assert eager.dtype == torch.float32
    assert (eager == 0).equal(sdpa) and (eager[~sdpa] == torch.finfo(torch.float32).min).all()
    with pytest.raises(ValueError, match="no tree mask for attention implementation 'flex_attention'"):
        tree_attention_mask(plan, "flex_attention", torch.float32, "cpu")
    # without sharing each row is its own sequence, as before
    apart = plan_packing(ids, mask, prompt_len=3, pad_id=9, share_prompts=False)
    assert not apart.shared and apart.source.tolist() == list(range(7))
    assert sorted(apart.targets.tolist()) == sorted(plan.targets.tolist())
    got = scatter_completions(torch.arange(1.0, 8.0), plan)
    assert got.tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [6.0, 7.0, 0.0], [0.0, 0.0, 0.0]]


def test_prompts_are_shared_only_where_that_is_cheaper(tiny_model):
    # the tiny Qwen2: attention costs 1/768 of a layer's weights per token per key
    def batch(c: int):
        rows = [(np.array([5, 6]), np.arange(10, 10 + c) % 90 + 4) for _ in range(8)]
        ids, mask, P, _ = pack_completions([p for p, _ in rows], [c for _, c in rows], 0)
        return ids, mask, P

    # 8 completions of 4 tokens: one tree of 2 + 8 * 3 = 26 tokens costs 26 * (1 + 26/768) = 26.9,
    # 8 sequences of 5 at least 40: shared
    assert packing.plan_for(tiny_model, *batch(4)).shared
    # 8 completions of 200: a tree of 1594 costs 1594 * (1 + 1594/768) = 4902, 8 rows of 201 about
    # 8 * 201 * 1.26 = 2028: apart
    long_plan = packing.plan_for(tiny_model, *batch(200))
    assert not long_plan.shared and long_plan.input_ids.shape[1] < 1594
    assert packing.packing_cost(np.array([1594]), 1 / 768)[1] == pytest.approx(1594 * (1 + 1594 / 768))


def test_row_capacity_by_hand(tokenizer):
    lengths = np.array([10, 10, 6, 6, 6, 6])  # 44 tokens
    # attention dear (0.01 per key): rows of 10 cost 6 * 10 * 1.1 = 66, of 20: 3 * 20 * 1.2 = 72
    assert row_capacity(lengths, 0.01) == 10
    # attention cheap (0.001): one row of 50 costs 50 * 1.05 = 52.5, less than 6 * 10 * 1.01 = 60.6
    assert row_capacity(lengths, 0.001) == 50
    assert row_capacity(np.array([0, 0]), 0.01) == 1
    # the embedded tiny Qwen2: 2 * 4 heads * 32 / (2*128*128 + 2*128*64 + 3*128*384) = 256 / 196608
    from primitives.fixtures.tiny import build_tiny_model

    assert key_cost(build_tiny_model(tokenizer).config) == pytest.approx(1 / 768)


def test_plan_rejects_a_mask_of_another_layout():
    ids = np.zeros((2, 4), np.int64)
    with pytest.raises(ValueError, match="attention_mask row 1 is not a left-padded prompt"):
        plan_packing(ids, np.array([[1, 1, 1, 0], [1, 0, 1, 1]]), prompt_len=2)


def test_supports_packing(model):
    from transformers import GPT2Config, GPT2LMHeadModel

    assert supports_packing(model)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10))
    assert not supports_packing(gpt2)  # a family not checked here: scored padded
    flash = _small("llama")
    flash.config._attn_implementation = "flash_attention_2"  # packs only one row: scored padded
    assert not supports_packing(flash)


# ----------------------------------------------------------------------------- packed == padded

def _both(model, ids, mask, P, **kw):
    packed = completion_logprobs(model, ids, mask, P, with_entropy=True, packing=True, **kw)
    padded = completion_logprobs(model, ids, mask, P, with_entropy=True, packing=False, **kw)
    return packed, padded


def _prefer_sharing(monkeypatch):
    """Share prompts wherever one repeats: the cost model may find a small micro-batch cheaper
    apart, and the micro-batched tests are there to run the tree mask."""
    real = packing.packing_cost
    monkeypatch.setattr(packing, "packing_cost",
                        lambda lengths, per_key, *a: (real(lengths, per_key, *a)[0], float(lengths.sum())))


def _max_diff(a, b, real):
    return float((a - b)[real].abs().max())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rows", ["chosen", "one"])
@pytest.mark.parametrize("prompts", ["distinct", "shared"])
def test_packed_logprobs_and_entropy_equal_padded(model, temperature, rows, prompts, monkeypatch):
    if rows == "one":  # every sequence in one long row
        monkeypatch.setattr(packing, "packing_cost", lambda lengths, cost: (int(lengths.sum()), float(len(lengths))))
    ids, mask, P, T = _inputs(_rollouts(_vocab(model), prompts=prompts))
    plan = packing.plan_for(model, ids.numpy(), mask.numpy(), P)
    assert plan.shared == (prompts == "shared")  # the plan scoring runs: shared under the tree mask
    if rows == "one":
        assert plan.input_ids.shape[0] == 1
    real = mask[:, P:] > 0
    with torch.no_grad():
        (logp, ent), (logp_ref, ent_ref) = _both(model, ids, mask, P, temperature=temperature)
    assert logp.shape == logp_ref.shape == (len(PROMPT_LENS), T)
    assert _max_diff(logp, logp_ref, real) <= ATOL and _max_diff(ent, ent_ref, real) <= ATOL
    assert (logp[~real] == 0).all() and (ent[~real] == 0).all()  # padding scores 0 when packed
    # micro-batched (each micro-batch packed on its own) gives the same values
    if prompts == "shared":  # rows 0 and 2 share a prompt in the first micro-batch of 3
        _prefer_sharing(monkeypatch)
        assert packing.plan_for(model, ids[:3].numpy(), mask[:3].numpy(), P).shared
    with torch.no_grad():
        micro, _ = completion_logprobs(model, ids, mask, P, temperature=temperature, micro_batch_size=3, packing=True)
    assert _max_diff(micro, logp_ref, real) <= ATOL


@pytest.mark.parametrize("prompts", ["distinct", "shared"])
def test_packed_gradients_equal_padded(model, prompts):
    ids, mask, P, T = _inputs(_rollouts(_vocab(model), seed=1, prompts=prompts))
    real = (mask[:, P:] > 0).float()
    weights = torch.linspace(-1.0, 1.0, real.numel()).reshape(real.shape)

    def grads(packing):
        model.zero_grad(set_to_none=True)
        logp, ent = completion_logprobs(model, ids, mask, P, temperature=0.8, with_entropy=True, packing=packing)
        ((logp * weights + 0.1 * ent) * real).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    packed, padded = grads(True), grads(False)
    model.zero_grad(set_to_none=True)
    assert packed.keys() == padded.keys() and len(packed) > 0
    for name in padded:
        torch.testing.assert_close(packed[name], padded[name], atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("prompts", ["distinct", "shared"])
def test_rollout_logprobs_packed_equal_padded(model, prompts, monkeypatch):
    rollouts = _rollouts(_vocab(model), seed=2, prompts=prompts)
    if prompts == "shared":
        _prefer_sharing(monkeypatch)
    monkeypatch.setattr(lp, "PACK_MIN_SHARE", 0.0)
    packed = rollout_logprobs(model, rollouts, pad_id=0, temperature=0.7, micro_batch_size=3)
    monkeypatch.setattr(lp, "PACK_MIN_SHARE", float("inf"))
    padded = rollout_logprobs(model, rollouts, pad_id=0, temperature=0.7)
    for a, b in zip(packed, padded):
        assert a.shape == b.shape and (len(a) == 0 or np.abs(a - b).max() <= ATOL)


@pytest.mark.parametrize("prompts", ["distinct", "shared"])
def test_forward_backward_packed_equals_padded(model, prompts, monkeypatch):
    batch = make_batch(_rollouts(_vocab(model), seed=3, prompts=prompts), algos.grpo(kl_coef=0.05), pad_id=0)
    algo = algos.grpo(kl_coef=0.05)._replace(entropy_coef=0.01)

    def run(min_share):
        monkeypatch.setattr(lp, "PACK_MIN_SHARE", min_share)
        model.zero_grad(set_to_none=True)
        old = with_old_logprobs(model, batch, temperature=0.7, micro_batch_size=3)
        m = forward_backward(model, old, algo, step_counts(batch), micro_batch_size=3, temperature=0.7)
        return old.old_logprobs, m, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    if prompts == "shared":  # the first micro-batch of 3 shares a prompt under the tree mask
        _prefer_sharing(monkeypatch)
        assert packing.plan_for(model, batch.input_ids[:3], batch.attention_mask[:3], batch.prompt_len).shared
    old_packed, m_packed, g_packed = run(0.0)
    old_padded, m_padded, g_padded = run(float("inf"))
    model.zero_grad(set_to_none=True)
    assert np.abs(old_packed - old_padded).max() <= ATOL
    assert m_packed.keys() == m_padded.keys()
    for k in m_padded:
        assert m_packed[k] == pytest.approx(m_padded[k], abs=ATOL), k
    for name in g_padded:
        torch.testing.assert_close(g_packed[name], g_padded[name], atol=ATOL, rtol=0, msg=name)


def test_nothing_to_score_falls_back_to_padded(tiny_model):
    # every completion empty: no packed row to run; the padded forward still gives a graph
    ids, mask, P, T = _inputs([r._replace(completion_ids=np.zeros(0, np.int64)) for r in _rollouts(50)[:3]])
    logp, _ = completion_logprobs(tiny_model, ids, mask, P, packing=True)
    assert logp.shape == (3, 1) and logp.requires_grad
    assert torch.equal(logp, completion_logprobs(tiny_model, ids, mask, P, packing=False)[0])


def test_auto_choice_follows_the_padding_share(tiny_model, monkeypatch):
    ids, mask, P, _ = _inputs(_rollouts(50, prompts="shared"))
    share, apart = padding_share(ids.numpy(), mask.numpy(), P), padding_share(ids.numpy(), mask.numpy(), P, False)
    assert share > apart  # the shared prompts run once
    monkeypatch.setattr(lp, "PACK_MIN_SHARE", share)
    assert lp.use_packing(tiny_model, ids, mask, P)
    assert not lp.use_packing(tiny_model, ids, mask, P, share_prompts=False)
    monkeypatch.setattr(lp, "PACK_MIN_SHARE", share + 1e-3)
    assert not lp.use_packing(tiny_model, ids, mask, P)


@pytest.mark.parametrize("prompts", ["distinct", "shared"])
def test_the_head_sees_only_the_kept_positions(model, prompts):
    """The packed forward's output head multiplies the K hidden states that predict a scored token,
    not every position of the packed rows, and gives up its hook afterwards, also when the forward
    fails (the values and gradients are the padded forward's: the tests above)."""
    ids, mask, P, T = _inputs(_rollouts(_vocab(model), seed=2, prompts=prompts))
    plan = packing.plan_for(model, ids.numpy(), mask.numpy(), P)
    head, seen = model.get_output_embeddings(), []
    handle = head.register_forward_hook(lambda _, args, out: seen.append((tuple(args[0].shape), tuple(out.shape))))
    try:
        with torch.no_grad():
            completion_logprobs(model, ids, mask, P, packing=True)
    finally:
        handle.remove()
    kept, width, vocab = int(plan.keep.sum()), model.config.hidden_size, head.weight.shape[0]
    assert kept < plan.keep.shape[0] * int(plan.keep.any(0).sum())  # fewer than the kept columns of every row
    assert seen == [((kept, width), (kept, vocab))]
    assert not head._forward_pre_hooks
    with pytest.raises(ValueError), lp.head_on_rows(model, torch.from_numpy(plan.keep)):
        raise ValueError("a failed forward")
    assert not head._forward_pre_hooks
