"""Sampling, left padding, stop strings, logprob parity, chat templates, think parsing,
and the one-process ``create_rollout`` a notebook reader calls first."""
import copy
import math

import numpy as np
import pytest
import torch

from primitives.env.rewards import mean_aggregator
from primitives.env.rollouts import create_rollout, create_rollouts
from primitives.io.data import PromptItem
from primitives.model.generation import (
    GenerationOutput,
    draw,
    filter_logits,
    float64_device,
    generate_rollouts,
    generate_tokens,
    inverse_cdf,
    pack_rollout,
    sample_next,
)
from primitives.model.logprobs import completion_logprobs, rollout_logprobs, token_entropy
from primitives.model.prompts import encode_prompts, render_prompt
from primitives.padding import left_pad, pack_completions, position_ids_from_mask
from primitives.types import Conversation, GenerationConfig, Message

PROMPTS = ["1+2=", "12+34=", "a much longer prompt: 7+40=", "9"]


def test_left_pad_and_positions():
    ids, mask = left_pad([np.array([5, 6]), np.array([7, 8, 9])], pad_id=0)
    assert ids.tolist() == [[0, 5, 6], [7, 8, 9]]
    assert mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert position_ids_from_mask(torch.from_numpy(mask)).tolist() == [[0, 0, 1], [0, 1, 2]]


def test_filter_logits_top_k_top_p():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    out = filter_logits(logits, top_k=2)
    assert torch.isinf(out[0, :2]).all() and out[0, 2:].tolist() == [3.0, 4.0]
    probs = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert torch.isfinite(filter_logits(probs, top_p=0.6)).tolist() == [[True, True, False]]
    assert torch.isfinite(filter_logits(probs, top_p=0.5)).tolist() == [[True, False, False]]


def test_inverse_cdf_by_hand_and_never_a_token_without_mass():
    """Boundaries of [0.1, 0, 0.6, 0.3, 0, 0]: cumulative 0.1, 0.1, 0.7, 1.0; u = 1 (past every
    boundary) and unnormalised rows land on the last token with mass, never on a zero."""
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0, 0.0]]).expand(7, 6)
    u = torch.tensor([[0.0], [0.0999], [0.1001], [0.6999], [0.7001], [0.9999], [1.0]], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [0, 0, 2, 2, 3, 3, 3]
    assert inverse_cdf(torch.tensor([[0.0, 2.0, 6.0, 0.0]]), torch.tensor([[0.3]], dtype=torch.float64)).tolist() == [2]


@pytest.mark.parametrize("row", [[0.5, float("nan"), 0.5], [float("inf"), 0.1, 0.1], [0.0, 0.0, 0.0], [0.6, -0.1, 0.5]],
                         ids=["nan", "inf", "no mass", "negative"])
def test_a_row_that_is_not_a_distribution_is_refused(row):
    """Logits gone non-finite must not draw one fixed token with a NaN logprob, step after step."""
    probs = torch.tensor([[0.2, 0.3, 0.5], row])
    with pytest.raises(ValueError, match=r"sampling: the probabilities of row\(s\) \[1\] hold a NaN"):
        draw(probs, torch.Generator().manual_seed(0))
    logits = torch.tensor([[0.0, 1.0, float("nan")]])
    with pytest.raises(ValueError, match="logits gone non-finite"):
        sample_next(logits, GenerationConfig(temperature=0.7), torch.Generator().manual_seed(0))


def test_float64_sums_leave_a_device_without_float64():
    assert float64_device(torch.device("mps")) == torch.device("cpu")
    assert float64_device(torch.device("cpu")) == torch.device("cpu")
    assert float64_device(torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_draw_samples_each_token_at_its_probability():
    """200k draws from a skewed row (masses down to 1e-3, zeros between): every frequency within
    5 standard errors of its probability, no zero-mass token drawn; the same generator seed
    draws the same tokens."""
    p = torch.tensor([0.5, 0.0, 0.25, 0.125, 0.0, 0.1, 0.024, 0.001])
    n = 200_000
    tokens = draw(p.expand(n, -1), torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=len(p)).double() / n
    se = (p.double() * (1 - p.double()) / n).sqrt()
    assert ((freq - p.double()).abs() <= 5 * se + 1e-12).all(), (freq.tolist(), p.tolist())
    assert freq[p == 0].sum() == 0
    again = draw(p.expand(n, -1), torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)


def test_generation_logprobs_equal_recomputed_with_left_padding(tiny_model, tokenizer):
    """Invariant 1 (one process): behaviour logprobs == recomputed, variable-length prompts, fp32."""
    items = [PromptItem(i, p) for i, p in enumerate(PROMPTS)]
    rollouts = generate_rollouts(tiny_model, tokenizer, items, GenerationConfig(max_new_tokens=10, n=3, seed=0),
                                 generator=torch.Generator().manual_seed(0))
    assert len({len(r.prompt_ids) for r in rollouts}) == 4  # prompts of different lengths were padded together
    recomputed = rollout_logprobs(tiny_model, rollouts, tokenizer.pad_token_id)
    diff = max(float(np.abs(a - r.logprobs).max()) for a, r in zip(recomputed, rollouts))
    assert diff < 1e-4
    # each rollout scored alone (no padding at all) gives the same numbers
    alone = [rollout_logprobs(tiny_model, [r], tokenizer.pad_token_id)[0] for r in rollouts]
    assert max(float(np.abs(a - b).max()) for a, b in zip(alone, recomputed)) < 1e-4


def test_temperature_is_part_of_the_logprob(tiny_model, tokenizer):
    items = [PromptItem(0, "12+34=")]
    cfg = GenerationConfig(max_new_tokens=6, temperature=0.7)
    r = generate_rollouts(tiny_model, tokenizer, items, cfg, generator=torch.Generator().manual_seed(1))[0]
    same = rollout_logprobs(tiny_model, [r], tokenizer.pad_token_id, temperature=0.7)[0]
    other = rollout_logprobs(tiny_model, [r], tokenizer.pad_token_id, temperature=1.0)[0]
    assert np.abs(same - r.logprobs).max() < 1e-4
    assert np.abs(other - r.logprobs).max() > 1e-3


def test_seeded_sampling_is_reproducible_and_greedy_is_top_k_1(tiny_model, tokenizer):
    ids = encode_prompts(tokenizer, PROMPTS)
    cfg = GenerationConfig(max_new_tokens=8)
    a = generate_tokens(tiny_model, tokenizer, ids, cfg, torch.Generator().manual_seed(7))
    b = generate_tokens(tiny_model, tokenizer, ids, cfg, torch.Generator().manual_seed(7))
    assert [o.completion_ids.tolist() for o in a] == [o.completion_ids.tolist() for o in b]
    greedy = generate_tokens(tiny_model, tokenizer, ids, GenerationConfig(max_new_tokens=8, temperature=0.0))
    top1 = generate_tokens(tiny_model, tokenizer, ids, GenerationConfig(max_new_tokens=8, top_k=1),
                           torch.Generator().manual_seed(3))
    assert [o.completion_ids.tolist() for o in greedy] == [o.completion_ids.tolist() for o in top1]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_a_shared_prompt_prefills_once_with_the_same_samples(tiny_model, tokenizer, monkeypatch, temperature):
    from primitives.model import generation

    # groups of 4 and 3 samples, a lone prompt, and a prompt that differs from another only by a
    # leading pad-id token (equal ids once left-padded, different masks: not the same prompt)
    base = encode_prompts(tokenizer, ["12+34=", "7+40=", "9"])
    padded_twin = np.concatenate([[tokenizer.pad_token_id], base[2]])
    ids = [base[0]] * 4 + [base[1]] * 3 + [base[2], padded_twin]
    calls = []
    real_forward = type(tiny_model).forward

    def counting(self, *args, **kwargs):
        calls.append(kwargs["input_ids"].shape)
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(type(tiny_model), "forward", counting)
    cfg = GenerationConfig(max_new_tokens=6, temperature=temperature)
    shared = generate_tokens(tiny_model, tokenizer, ids, cfg, torch.Generator().manual_seed(5))
    assert calls[0][0] == 4  # the prefill: one row per distinct prompt (the twin counts as its own)
    monkeypatch.setattr(generation, "SHARE_PREFILL", False)
    calls.clear()
    apart = generate_tokens(tiny_model, tokenizer, ids, cfg, torch.Generator().manual_seed(5))
    assert calls[0][0] == len(ids)
    assert [o.completion_ids.tolist() for o in shared] == [o.completion_ids.tolist() for o in apart]
    assert max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in zip(shared, apart)) < 1e-5
    assert len({tuple(o.completion_ids.tolist()) for o in shared[:4]}) > 1  # the group's samples differ


def test_max_batch_rows_decodes_a_call_in_batches_of_that_many(tiny_model, tokenizer, monkeypatch):
    """4 prompts x 3 samples, ``max_batch_rows`` 7: no forward sees more than 7 rows, two batches of 6 (whole
    groups, equal sizes); the linear weights packed once for both (``decode: packed``); greedy, the rows' tokens
    and uids are every row at once's, logprobs within 1e-5 (another batch, another left padding). With
    ``batch_size`` too, the smaller cap holds."""
    from primitives.model import generation, packed_decode

    items = [PromptItem(i, p) for i, p in enumerate(PROMPTS)]
    gen = GenerationConfig(max_new_tokens=6, temperature=0.0, n=3, decode="packed")
    whole = generate_rollouts(tiny_model, tokenizer, items, gen)
    batches, rows, packed = [], [], []
    real_tokens, real_forward, real_pack = generation.generate_tokens, type(tiny_model).forward, packed_decode.pack

    def counting_forward(self, *args, **kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(generation, "generate_tokens", lambda m, t, ids, *a: batches.append(len(ids)) or
                        real_tokens(m, t, ids, *a))
    monkeypatch.setattr(type(tiny_model), "forward", counting_forward)
    monkeypatch.setattr(packed_decode, "pack", lambda *a: packed.append(1) or real_pack(*a))
    capped = generate_rollouts(tiny_model, tokenizer, items, gen._replace(max_batch_rows=7))
    assert batches == [6, 6] and max(rows) == 6 and len(packed) == 2 * 7 + 1  # every linear layer, once
    assert [r.uid for r in capped] == [r.uid for r in whole]
    assert [r.completion_ids.tolist() for r in capped] == [r.completion_ids.tolist() for r in whole]
    assert max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in zip(capped, whole)) < 1e-5
    batches.clear()
    generate_rollouts(tiny_model, tokenizer, items, gen._replace(max_batch_rows=5), batch_size=7)
    assert batches == [3, 3, 3, 3]
    # the decoded rows themselves, where sampled prompts differ: each batch's rows are its own prompts'
    assert [r.prompt for r in capped] == [r.prompt for r in whole] == [p for p in PROMPTS for _ in range(3)]
    with pytest.raises(ValueError, match="GenerationConfig.max_batch_rows must be >= 0"):
        generate_rollouts(tiny_model, tokenizer, items, gen._replace(max_batch_rows=-1))
    with pytest.raises(ValueError, match="batch_size must be >= 0"):
        generate_rollouts(tiny_model, tokenizer, items, gen, batch_size=-1)


@pytest.mark.parametrize("rows,cap,group,sizes", [
    (12, 0, 3, [12]), (12, 12, 3, [12]), (12, 40, 3, [12]),  # no cap, or one the call keeps to
    (12, 5, 1, [4, 4, 4]), (13, 5, 1, [5, 4, 4]), (10, 4, 1, [4, 3, 3]), (9, 4, 1, [3, 3, 3]),  # fewest, even
    (12, 7, 3, [6, 6]), (24, 10, 8, [8, 8, 8]), (40, 20, 8, [16, 16, 8]),
    (12, 2, 3, [2] * 6), (14, 7, 3, [7, 7]), (14, 6, 3, [5, 5, 4]),  # a cap under a group, or not whole groups
    (1, 5, 1, [1]),
])
def test_batch_rows_by_hand(rows, cap, group, sizes):
    from primitives.model.generation import batch_rows

    assert batch_rows(rows, cap, group=group) == sizes


def test_batch_rows_keep_to_the_cap_in_the_fewest_batches():
    """For every call of 1-40 rows, cap 1-45 and group 1-8: every row once, no batch over the cap, the fewest
    batches the cap allows, sizes a unit apart at most and larger first, whole groups wherever the cap holds
    one and the rows are whole groups; with ``batch_size`` and ``max_batch_rows`` both, the smaller holds."""
    import math

    from primitives.model.generation import batch_rows

    for rows in range(1, 41):
        for cap in range(1, 46):
            for group in range(1, 9):
                sizes = batch_rows(rows, cap, group=group)
                unit = group if 1 < group <= cap and rows % group == 0 else 1
                assert sum(sizes) == rows and max(sizes) <= cap and min(sizes) >= 1
                assert len(sizes) == math.ceil(rows / unit / (cap // unit))
                assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= unit
                assert all(s % unit == 0 for s in sizes)
                assert batch_rows(rows, cap, cap + 3, group) == sizes == batch_rows(rows, cap + 3, cap, group)


def _kept_set_logprobs(model, rollout, gen: GenerationConfig) -> np.ndarray:
    """The rollout's token logprobs renormalised over the top-k / top-p set (vLLM's processed
    logprobs): ``log_softmax(filter_logits(logits / T))``, one unpadded row. (T,)"""
    ids = torch.from_numpy(np.concatenate([rollout.prompt_ids, rollout.completion_ids]))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(rollout.prompt_ids) - 1: -1].float()  # (T, V)
    kept = filter_logits(logits / gen.temperature, gen.top_k, gen.top_p).log_softmax(-1)
    return kept.gather(-1, torch.from_numpy(rollout.completion_ids)[:, None]).squeeze(-1).numpy()


@pytest.mark.parametrize("truncation", [{"top_p": 0.5}, {"top_k": 3}], ids=["top_p", "top_k"])
def test_truncated_sampling_keeps_full_distribution_logprobs(tiny_model, tokenizer, truncation):
    """With top-p 0.5 or top-k 3 the HF path's behaviour logprobs are of the full tempered
    distribution, as the trainer recomputes them (``primitives.model.logprobs``): with the same weights
    the capped importance weight is 1 (to 1e-5), per token and per sequence. Renormalised over the
    kept set (vLLM's processed logprobs) they would be off by log(kept mass), here at least 0.1:
    the weight would be that mass."""
    from primitives.maths.losses import truncated_is_weights

    gen = GenerationConfig(max_new_tokens=8, n=4, temperature=0.7, **truncation)
    items = [PromptItem(i, p) for i, p in enumerate(PROMPTS[:2])]
    rollouts = generate_rollouts(tiny_model, tokenizer, items, gen, generator=torch.Generator().manual_seed(4))
    trainer = rollout_logprobs(tiny_model, rollouts, tokenizer.pad_token_id, temperature=0.7)
    T = max(len(r.completion_ids) for r in rollouts)
    pad = lambda rows: torch.tensor(np.stack([np.pad(x, (0, T - len(x))) for x in rows]))  # noqa: E731
    mask = pad([np.ones(len(r.completion_ids), dtype=np.float32) for r in rollouts])
    behaviour = pad([r.logprobs for r in rollouts])
    for level in ("token", "sequence"):
        w, capped = truncated_is_weights(pad(trainer), behaviour, mask, level, cap=2.0)
        torch.testing.assert_close(w, mask, atol=1e-5, rtol=0)
        assert not capped.any()
    kept = [_kept_set_logprobs(tiny_model, r, gen) for r in rollouts]
    assert all(np.isfinite(k).all() for k in kept)  # every sampled token is inside the kept set
    log_mass = np.concatenate([t - k for t, k in zip(trainer, kept)])  # full - renormalised = log(kept mass)
    assert (log_mass <= 1e-5).all() and log_mass.min() < -0.1


def test_a_sampler_on_another_device_than_the_model_is_refused(tiny_model, tokenizer):
    """A CPU generator never meets CUDA probabilities: ``generate_tokens`` refuses a sampler on
    another device than the model before any forward, naming both. (The meta device stands in
    for CUDA on a CPU-only machine.)"""
    model = copy.deepcopy(tiny_model).to("meta")
    ids = encode_prompts(tokenizer, PROMPTS[:1])
    with pytest.raises(ValueError, match=r"the sampling generator is on cpu but the model is on meta: .*"
                                         r"torch.Generator\(device='meta'\)"):
        generate_tokens(model, tokenizer, ids, GenerationConfig(max_new_tokens=2), torch.Generator().manual_seed(0))


class _Scripted(torch.nn.Module):
    """A 'model' that always predicts the next token of a fixed script (to test stopping)."""

    def __init__(self, script, vocab):
        super().__init__()
        self.script, self.vocab = script, vocab
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False):
        from types import SimpleNamespace
        step = 0 if past_key_values is None else past_key_values + 1
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], self.vocab), -1e4)
        logits[:, -1, self.script[min(step, len(self.script) - 1)]] = 0.0
        return SimpleNamespace(logits=logits, past_key_values=step)


def test_finish_reasons_and_stop_strings(tokenizer):
    script = tokenizer("ab. cd").input_ids + [tokenizer.eos_token_id]
    model = _Scripted(script, len(tokenizer))
    ids = encode_prompts(tokenizer, ["x"])
    out = generate_tokens(model, tokenizer, ids, GenerationConfig(max_new_tokens=3, temperature=0.0))[0]
    assert (out.text, out.finish_reason) == ("ab.", "length")
    out = generate_tokens(model, tokenizer, ids, GenerationConfig(max_new_tokens=20, temperature=0.0))[0]
    assert (out.text, out.finish_reason) == ("ab. cd", "stop")
    assert out.completion_ids[-1] == tokenizer.eos_token_id  # eos is a policy token, trained on
    out = generate_tokens(model, tokenizer, ids, GenerationConfig(max_new_tokens=20, temperature=0.0,
                                                                  stop=(". ",)))[0]
    assert (out.text, out.finish_reason) == ("ab. ", "stop")
    assert len(out.logprobs) == len(out.completion_ids) == 4
    assert np.allclose(out.logprobs, 0.0, atol=1e-3)  # the scripted token has probability ~1


def test_rollout_fields(tiny_model, tokenizer):
    items = [PromptItem(3, "1+1=", answer="2", epoch=1)]
    rs = generate_rollouts(tiny_model, tokenizer, items, GenerationConfig(max_new_tokens=4, n=2, seed=0))
    assert [r.uid for r in rs] == ["e1/i3/s0", "e1/i3/s1"]
    assert {r.group for r in rs} == {"e1/i3"}
    r = rs[0]
    assert r.answer == "2" and r.prompt_ids.dtype == np.int64 and r.logprobs.dtype == np.float32
    assert r.loss_mask.tolist() == [1.0] * len(r.completion_ids)


def test_bad_generation_inputs(tiny_model, tokenizer):
    with pytest.raises(ValueError, match="empty prompt"):
        encode_prompts(tokenizer, [""])
    with pytest.raises(ValueError, match="n must be >= 1"):
        generate_rollouts(tiny_model, tokenizer, [PromptItem(0, "1")], GenerationConfig(n=0))
    with pytest.raises(TypeError, match="str or Conversation"):
        render_prompt(tokenizer, 42)


def test_chat_template_with_tool_messages(tokenizer):
    conv = Conversation((Message("system", "be brief"), Message("user", "2+3?"),
                         Message("assistant", '<tool_call name="calc">{}</tool_call>'),
                         Message("tool", "5", tool_call_id="call_0", name="calc")))
    text = render_prompt(tokenizer, conv)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n"
                    '<|im_start|>assistant\n<tool_call name="calc">{}</tool_call><|im_end|>\n'
                    "<|im_start|>tool\n<tool_response>5</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_parse_thinking():
    from primitives.env.rewards import parse_thinking

    assert parse_thinking("<think>carry the one</think> 42") == ("carry the one", "42", True)
    assert parse_thinking("<think>still thinking") == ("still thinking", "", False)
    assert parse_thinking("just 7") == ("", "just 7", True)


def test_micro_batched_logprobs_and_entropy(tiny_model, tokenizer):
    p = encode_prompts(tokenizer, PROMPTS)
    c = [np.array([5, 6, 7]), np.array([8]), np.array([9, 10]), np.array([11, 12, 13])]
    ids, mask, P, T = pack_completions(p, c, tokenizer.pad_token_id)
    ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
    with torch.no_grad():
        full, ent = completion_logprobs(tiny_model, ids, mask, P, with_entropy=True)
        micro, _ = completion_logprobs(tiny_model, ids, mask, P, micro_batch_size=1)
    torch.testing.assert_close(full, micro, atol=1e-5, rtol=0)
    real = ent[mask[:, P:] > 0]  # right padding scores 0 when packed
    assert ent.shape == (4, T) and (real > 0).all() and (real <= math.log(len(tokenizer)) + 1e-4).all()
    # uniform logits have entropy log V
    torch.testing.assert_close(token_entropy(torch.zeros(1, 1, 8)), torch.tensor([[math.log(8)]]))


def test_pack_rollout_packs_one_generation_output(tokenizer):
    item = PromptItem(3, "1+1=", answer="2", epoch=1, metadata={"k": 1})
    out = GenerationOutput(np.array([7, 8], dtype=np.int64), np.array([-0.5, -1.5], dtype=np.float32), "stop", "ab")
    r = pack_rollout(item, [4, 5, 6], out, sample=2, policy_version=9)
    assert (r.uid, r.group, r.prompt, r.answer, r.metadata) == ("e1/i3/s2", "e1/i3", "1+1=", "2", {"k": 1})
    assert r.prompt_ids.tolist() == [4, 5, 6] and r.prompt_ids.dtype == np.int64
    assert r.completion_ids.tolist() == [7, 8] and r.logprobs.tolist() == [-0.5, -1.5]
    assert r.loss_mask.tolist() == [1.0, 1.0] and r.loss_mask.dtype == np.float32
    assert (r.policy_version, r.finish_reason, r.text) == (9, "stop", "ab")
    assert r.ref_logprobs is None and r.reward is None


def _text_reward(rollout):
    """A reward that depends on the completion text: its length in characters."""
    return float(len(rollout.text))


def test_create_rollout_the_seeds_first_call(tiny_model, tokenizer):
    gen_config = GenerationConfig(max_new_tokens=8, temperature=0.7, seed=5)
    rollout = create_rollout(tiny_model, tokenizer, "12+34=", gen_config, reward_fn=_text_reward)
    assert (rollout.uid, rollout.group, rollout.prompt) == ("e0/i0/s0", "e0/i0", "12+34=")
    assert len(rollout.text) > 0 and rollout.reward == float(len(rollout.text))
    assert rollout.ref_logprobs is None
    # the same tokens generate_rollouts samples with a generator seeded by gen_config.seed
    same = generate_rollouts(tiny_model, tokenizer, [PromptItem(0, "12+34=")], gen_config,
                             generator=torch.Generator().manual_seed(5))[0]
    assert rollout.completion_ids.tolist() == same.completion_ids.tolist()
    assert np.array_equal(rollout.logprobs, same.logprobs)
    # without a reward function the rollout is unscored
    assert create_rollout(tiny_model, tokenizer, "12+34=", gen_config).reward is None


def test_create_rollout_vector_reward_and_shaping(tiny_model, tokenizer):
    gen_config = GenerationConfig(max_new_tokens=6, temperature=0.7, seed=1)
    r = create_rollout(tiny_model, tokenizer, "1+2=", gen_config,
                       reward_fn=lambda ro: [float(len(ro.completion_ids)), 1.0], aggregate_fn=mean_aggregator,
                       shaping_fn=lambda ro, reward: reward - 0.25)
    T = len(r.completion_ids)
    assert r.reward_vector.tolist() == [float(T), 1.0]
    assert r.reward == pytest.approx((T + 1.0) / 2 - 0.25, abs=1e-6)


def test_create_rollout_ref_logprobs(tiny_model, tokenizer):
    from primitives.fixtures.tiny import TinyModelSpec, build_tiny_model

    gen_config = GenerationConfig(max_new_tokens=8, temperature=0.7, seed=2)
    r = create_rollout(tiny_model, tokenizer, "12+34=", gen_config, copy.deepcopy(tiny_model))
    assert r.ref_logprobs.shape == r.logprobs.shape and r.ref_logprobs.dtype == np.float32
    assert np.abs(r.ref_logprobs - r.logprobs).max() < 1e-5  # same weights, same temperature (0.7, not 1)
    other = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2),
                             seed=2)
    r2 = create_rollout(tiny_model, tokenizer, "12+34=", gen_config, ref_model=other)
    assert r2.completion_ids.tolist() == r.completion_ids.tolist()
    assert np.abs(r2.ref_logprobs - r2.logprobs).max() > 1e-2
    # greedy (temperature 0): behaviour and reference logprobs are both at temperature 1.0
    greedy = create_rollout(tiny_model, tokenizer, "12+34=", GenerationConfig(max_new_tokens=8, temperature=0.0),
                            ref_model=copy.deepcopy(tiny_model))
    assert np.abs(greedy.ref_logprobs - greedy.logprobs).max() < 1e-5
    at_one = rollout_logprobs(tiny_model, [greedy], tokenizer.pad_token_id, temperature=1.0)[0]
    assert np.abs(at_one - greedy.logprobs).max() < 1e-5


def test_create_rollout_n_above_one_names_create_rollouts(tiny_model, tokenizer):
    with pytest.raises(ValueError, match="create_rollouts"):
        create_rollout(tiny_model, tokenizer, "12+34=", GenerationConfig(max_new_tokens=4, n=2))


def test_create_rollouts_is_one_group(tiny_model, tokenizer):
    item = PromptItem(3, "1+1=", answer="2", epoch=1)
    rs = create_rollouts(tiny_model, tokenizer, item, GenerationConfig(max_new_tokens=4, n=3, seed=0),
                         reward_fn=lambda r: float(r.answer == "2"))
    assert [r.uid for r in rs] == ["e1/i3/s0", "e1/i3/s1", "e1/i3/s2"]
    assert {r.group for r in rs} == {"e1/i3"} and [r.reward for r in rs] == [1.0, 1.0, 1.0]
    bare = create_rollouts(tiny_model, tokenizer, "1+1=", GenerationConfig(max_new_tokens=4, n=2, seed=0))
    assert [r.uid for r in bare] == ["e0/i0/s0", "e0/i0/s1"] and {r.group for r in bare} == {"e0/i0"}


def test_create_rollout_conversation_prompt(tiny_model, tokenizer):
    if tokenizer.chat_template is None:
        pytest.skip("the tiny tokenizer has no chat template")
    conv = Conversation((Message("user", "2+3?"),))
    r = create_rollout(tiny_model, tokenizer, conv, GenerationConfig(max_new_tokens=4, seed=0),
                       reward_fn=_text_reward)
    assert r.prompt == conv and r.reward == float(len(r.text))
    assert r.prompt_ids.tolist() == encode_prompts(tokenizer, [conv])[0].tolist()
    assert tokenizer.decode(r.prompt_ids.tolist()).endswith("<|im_start|>assistant\n")


def test_create_rollout_with_a_generation_function_of_the_users(tiny_model, tokenizer):
    """The seeds' custom generation backend, ``create_rollout(..., generator=fn)`` (or ``generate_fn=``):
    the function's tokens, text and finish reason make the rollout; its logprobs are taken as given
    (vLLM's ``Logprob`` records too), and where it returns none they are the policy's own of those
    tokens at the temperature - here equal to what the model's sampler recorded for the same tokens."""
    from types import SimpleNamespace

    from primitives.types import Generation

    gen = GenerationConfig(max_new_tokens=6, temperature=0.7, seed=3)
    own = create_rollout(tiny_model, tokenizer, "12+34=", gen)
    calls = []

    def backend(with_logprobs, as_records=False):
        def generate(model, tok, prompt, config):
            calls.append((prompt, config.max_new_tokens))
            lps = [SimpleNamespace(logprob=float(x)) for x in own.logprobs] if as_records else own.logprobs.tolist()
            return Generation(own.text, lps if with_logprobs else None, own.completion_ids.tolist(),
                              own.finish_reason)
        return generate

    for fn in (backend(True), backend(True, as_records=True), backend(False)):
        for rollout in (create_rollout(tiny_model, tokenizer, "12+34=", gen, generator=fn),
                        create_rollout(tiny_model, tokenizer, "12+34=", gen, generate_fn=fn)):
            assert rollout.completion_ids.tolist() == own.completion_ids.tolist() and rollout.text == own.text
            assert rollout.prompt_ids.tolist() == own.prompt_ids.tolist()
            assert (rollout.uid, rollout.group, rollout.finish_reason) == (own.uid, own.group, own.finish_reason)
            np.testing.assert_allclose(rollout.logprobs, own.logprobs, atol=1e-5)
    assert calls[0] == ("12+34=", 6) and len(calls) == 6
    group = create_rollouts(tiny_model, tokenizer, "12+34=", gen._replace(n=3), generate_fn=backend(False),
                            reward_fn=lambda r: float(len(r.completion_ids)))
    assert [r.uid for r in group] == ["e0/i0/s0", "e0/i0/s1", "e0/i0/s2"] and group[0].reward == len(own.completion_ids)

    def empty(model, tok, prompt, config):
        return Generation("", None, [], "stop")

    with pytest.raises(ValueError, match="generate_fn empty returned no token_ids"):
        create_rollout(tiny_model, tokenizer, "12+34=", gen, generator=empty)
