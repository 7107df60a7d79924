"""Batching and the training step: layout, advantages per group, micro-batch and shard equivalence."""
import copy

import pytest
import torch

from primitives.env.rewards import score_rollouts
from primitives.fixtures.tiny import TinyModelSpec, build_tiny_model
from primitives.io.data import PromptItem
from primitives.maths import algorithms as algos
from primitives.maths.batching import make_batch
from primitives.model.generation import generate_rollouts
from primitives.model.logprobs import completion_logprobs
from primitives.model.training import forward_backward, minibatches, step_counts, train_on_batch
from primitives.types import GenerationConfig


def _reward_by_length(r):
    return float(len(r.completion_ids) % 3)


@pytest.fixture(scope="module")
def scored(tiny_model, tokenizer):
    items = [PromptItem(i, p) for i, p in enumerate(["1+2=", "12+34=", "7+40=", "3+3="])]
    rs = generate_rollouts(tiny_model, tokenizer, items, GenerationConfig(max_new_tokens=6, n=4),
                           generator=torch.Generator().manual_seed(0))
    return score_rollouts(rs, _reward_by_length)


def test_batch_layout(scored, tokenizer):
    b = make_batch(scored, algos.grpo(kl_coef=0.0), tokenizer.pad_token_id)
    T = max(len(r.completion_ids) for r in scored)
    assert b.input_ids.shape == (16, b.prompt_len + T) and b.loss_mask.shape == (16, T)
    for i, r in enumerate(scored):
        n = len(r.completion_ids)
        assert b.input_ids[i, b.prompt_len: b.prompt_len + n].tolist() == r.completion_ids.tolist()
        assert b.input_ids[i, b.prompt_len - len(r.prompt_ids): b.prompt_len].tolist() == r.prompt_ids.tolist()
        assert b.loss_mask[i].sum() == n and (b.advantages[i, n:] == 0).all()
    # group advantages (per sequence) sum to zero within each prompt
    per_seq = b.advantages[:, 0]
    for g in range(4):
        assert abs(per_seq[g * 4:(g + 1) * 4].sum()) < 1e-5


def test_make_batch_bad_rollout_named(scored, tokenizer):
    bad = list(scored)
    bad[2] = bad[2]._replace(reward=float("inf"))
    with pytest.raises(ValueError, match=f"rollout {bad[2].uid}: reward is inf"):
        make_batch(bad, algos.grpo(), tokenizer.pad_token_id)
    bad[2] = scored[2]._replace(logprobs=scored[2].logprobs[:-1])
    with pytest.raises(ValueError, match="logprobs has length"):
        make_batch(bad, algos.grpo(), tokenizer.pad_token_id)


def test_online_dpo_batch_pairs(scored, tokenizer):
    b = make_batch(scored, algos.online_dpo(), tokenizer.pad_token_id)
    assert b.size % 2 == 0
    for k in range(0, b.size, 2):
        chosen, rejected = b.rollouts[k], b.rollouts[k + 1]
        assert chosen.group == rejected.group and chosen.reward > rejected.reward
        assert b.advantages[k, 0] == 1.0 and b.advantages[k + 1, 0] == -1.0
    shards = [b.shard(r, 3, unit=2) for r in range(3)]
    assert sum(s.size for s in shards) == b.size and all(s.size % 2 == 0 for s in shards)


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_micro_batches_and_shards_give_the_global_gradient(name, scored, tiny_model, tokenizer):
    """Invariant 2: the data-parallel (sharded) loss and gradient equal the single-process ones."""
    algo = algos.get_algorithm(name, kl_coef=0.0)
    model = tiny_model
    b = make_batch(scored, algo, tokenizer.pad_token_id, budget=6)
    # make the ratio differ from 1 so clipping paths are exercised
    b = b._replace(old_logprobs=b.behaviour_logprobs - 0.1 * b.loss_mask)
    counts = step_counts(b)
    model.zero_grad()
    m_full = forward_backward(model, b, algo, counts)
    g_full = _grads(model)
    model.zero_grad()
    m_micro = forward_backward(model, b, algo, counts, micro_batch_size=3)
    torch.testing.assert_close(_grads(model), g_full, atol=1e-6, rtol=1e-4)
    model.zero_grad()
    total = 0.0
    for rank in range(3):
        total += forward_backward(model, b.shard(rank, 3), algo, counts)["loss/policy"]
    torch.testing.assert_close(_grads(model), g_full, atol=1e-6, rtol=1e-4)
    assert total == pytest.approx(m_full["loss/policy"], abs=1e-6)
    assert m_micro["loss/policy"] == pytest.approx(m_full["loss/policy"], abs=1e-6)
    model.zero_grad()
    model.eval()


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_the_entropy_is_differentiated_only_where_the_loss_may_use_it(scored, tiny_model, tokenizer, monkeypatch,
                                                                      packing):
    """The default objective without an entropy bonus gets the entropy without autograd, a metric;
    with a bonus, or under a loss_fn of the user's, with it. The metric and the gradient are the same
    either way without a bonus, the graph then saves at least one fp32 (tokens, V) tensor less, and
    the bonus moves the gradient."""
    from primitives.maths.objectives import policy_objective
    from primitives.model import training

    seen = []
    real = training.completion_logprobs

    def spied(*args, **kwargs):
        logp, ent = real(*args, **{**kwargs, "packing": packing})
        seen.append(ent.requires_grad)
        return logp, ent

    monkeypatch.setattr(training, "completion_logprobs", spied)
    vocab = tiny_model.get_output_embeddings().weight.shape[0]
    results = {}
    for name, algo in (("default", algos.grpo(kl_coef=0.0)),
                       ("user's", algos.grpo(kl_coef=0.0, loss_fn=lambda x, a: policy_objective(x, a))),
                       ("bonus", algos.grpo(kl_coef=0.0, entropy_coef=0.1))):
        b = make_batch(scored, algo, tokenizer.pad_token_id, budget=6)
        seen.clear()
        tiny_model.zero_grad()
        saved = [0]  # bytes autograd saved in (..., V) tensors for the backward

        def pack(t, saved=saved):
            saved[0] += t.numel() * t.element_size() if t.dim() and t.shape[-1] == vocab else 0
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            metrics = forward_backward(tiny_model, b, algo, step_counts(b), micro_batch_size=8)
        results[name] = (metrics["policy/entropy"], _grads(tiny_model), list(seen), saved[0])
    tiny_model.zero_grad()
    tiny_model.eval()
    assert results["default"][2] == [False, False] and results["user's"][2] == results["bonus"][2] == [True, True]
    scored_tokens = int(b.loss_mask.sum())
    assert results["user's"][3] - results["default"][3] >= scored_tokens * vocab * 4  # an fp32 (tokens, V) at least
    assert results["default"][0] == pytest.approx(results["user's"][0], abs=1e-6) and results["default"][0] > 0
    torch.testing.assert_close(results["default"][1], results["user's"][1], atol=1e-7, rtol=1e-6)
    assert float((results["bonus"][1] - results["default"][1]).abs().max()) > 1e-4


def test_grpo_kl_in_loss_needs_reference(scored, tiny_model, tokenizer):
    algo = algos.grpo(kl_coef=0.1)
    b = make_batch(scored, algo, tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="no ref_logprobs"):
        forward_backward(tiny_model, b, algo, step_counts(b))
    tiny_model.zero_grad()
    # with ref == behaviour logprobs the KL term is ~0 at the first step
    b = b._replace(ref_logprobs=b.behaviour_logprobs.copy())
    m = forward_backward(tiny_model, b, algo, step_counts(b))
    assert abs(m["loss/kl"]) < 1e-4
    tiny_model.zero_grad()
    tiny_model.eval()


def test_reinforce_pp_kl_in_reward(scored, tokenizer):
    algo = algos.reinforce_pp()
    rs = [r._replace(ref_logprobs=r.logprobs - 0.5) for r in scored]
    b = make_batch(rs, algo, tokenizer.pad_token_id)
    m = b.loss_mask > 0
    assert abs(b.advantages[m].mean()) < 1e-4 and abs(b.advantages[m].std() - 1) < 1e-2
    with pytest.raises(ValueError, match="lacks? ref_logprobs"):
        make_batch(scored, algo, tokenizer.pad_token_id)


def test_dapo_overlong_penalty_applied_in_batch(scored, tokenizer):
    algo = algos.dapo(max_completion_len=6, overlong_buffer_frac=4 / 6)
    b = make_batch(scored, algo, tokenizer.pad_token_id, budget=99)  # max_completion_len wins over the budget
    for r, got in zip(scored, b.rewards):
        n = len(r.completion_ids)
        expected = r.reward + (0.0 if n <= 2 else -(n - 2) / 4)
        assert got == pytest.approx(expected, abs=1e-6)


def test_one_epoch_of_two_mini_batches_fixes_the_old_logprobs_first(scored, tokenizer):
    """One PPO epoch of two mini-batches is two updates, so the second mini-batch's clip ratio
    is against the policy before the first update, not against itself: its ratio mean is the
    mean of exp(logp after update 1 - logp before any), computed here on its own."""
    algo = algos.grpo(kl_coef=0.0, ppo_epochs=1, mini_batches=2, clip_eps_low=0.01, clip_eps_high=0.01)
    batch = make_batch(scored, algo, tokenizer.pad_token_id)
    second = minibatches(batch, algo)[1]

    def logp(model):
        with torch.no_grad():
            return completion_logprobs(model, torch.from_numpy(second.input_ids),
                                       torch.from_numpy(second.attention_mask), second.prompt_len)[0]

    model = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2),
                             seed=1)
    before = logp(model)
    replay = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    updates = train_on_batch(model, opt, batch, algo)
    assert len(updates) == 2 and updates[0]["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    # the policy the second update sees: the first update alone, replayed on a copy
    replay_opt = torch.optim.AdamW(replay.parameters(), lr=1e-2, weight_decay=0.0)
    train_on_batch(replay, replay_opt, minibatches(batch, algo)[0], algo._replace(mini_batches=1))
    mask = torch.from_numpy(second.loss_mask)
    expected = float((torch.exp(logp(replay) - before) * mask).sum() / mask.sum())
    assert abs(expected - 1.0) > 1e-3  # the first update moved the second mini-batch's logprobs
    assert updates[1]["policy/ratio_mean"] == pytest.approx(expected, abs=1e-5)
    assert updates[1]["policy/approx_kl_old"] > 1e-3


def test_a_batch_with_fewer_units_than_mini_batches_makes_one_update_per_unit(scored, tiny_model, tokenizer):
    """Dynamic sampling or a pair selector can leave a step fewer rows (pairs) than
    ``algo.mini_batches``: each unit is then a mini-batch of its own, not an error after the
    step's generation and scoring. Bounds by hand: 10 rows in 4 parts are [0, 2, 5, 7, 10]; 3 rows
    in 8 parts are 3 parts of a row; 1 pair in 4 parts is one part of 2 rows, one update, on-policy
    (no old-logprob pass, ``fix_old`` false), as with ``mini_batches`` 1."""
    from primitives.model.training import updates_of

    grpo = algos.grpo(kl_coef=0.0, mini_batches=4)
    batch = make_batch(scored[:10], grpo, tokenizer.pad_token_id)
    assert [p.size for p in minibatches(batch, grpo)] == [2, 3, 2, 3]
    assert [p.input_ids.tolist() for p in minibatches(batch, grpo)][1] == batch.input_ids[2:5].tolist()
    three = make_batch(scored[:3], grpo._replace(mini_batches=8), tokenizer.pad_token_id)
    assert [p.size for p in minibatches(three, grpo._replace(mini_batches=8))] == [1, 1, 1]
    dpo = algos.online_dpo(mini_batches=4)
    pair = make_batch([r._replace(ref_logprobs=r.logprobs) for r in scored[:4]], dpo, tokenizer.pad_token_id)
    pair = pair.select(range(2))  # one (chosen, rejected) pair
    fixes = []
    updates = updates_of(pair, dpo, lambda part, fix_old: fixes.append(fix_old) or part)
    assert [u.size for u, _ in updates] == [2] and fixes == [False]
    assert len(updates_of(pair, dpo._replace(ppo_epochs=2), lambda part, fix_old: fixes.append(fix_old) or part)) == 2
    assert fixes == [False, True]  # two updates on one pair: the second's ratio needs the old logprobs
    with pytest.raises(ValueError, match="an empty batch has no mini-batches"):
        minibatches(pair.select([]), dpo)


@pytest.mark.parametrize("name", ["grpo", "online_dpo"])
def test_a_rank_counts_the_backward_passes_forward_backward_makes(name, scored, tiny_model, tokenizer):
    """A DeepSpeed rank pads its backward passes up to the largest shard's count, which it computes
    (``micro_batch_count``) without running them: that count must be the passes ``forward_backward``
    makes, for every micro-batch size and shard size, pairs kept whole (an odd size rounds up: a
    micro-batch size of 3 over 4 rows of pairs is one pass of 4, not passes of 3 and 1)."""
    from rl_actors.deepspeed_rank import micro_batch_count

    algo = algos.get_algorithm(name, kl_coef=0.0)  # online DPO scores against a reference: the sampler here
    batch = make_batch([r._replace(ref_logprobs=r.logprobs) for r in scored], algo, tokenizer.pad_token_id)
    unit = 2 if name == "online_dpo" else 1
    forwards = []
    hook = tiny_model.register_forward_hook(
        lambda module, args, out: forwards.append(1))  # one forward per pass (packed rows make one sequence)
    try:
        for rows in range(unit, min(batch.size, 7) + 1, unit):
            part = batch.select(range(rows))
            for mbs in range(0, 6):
                forwards.clear()
                forward_backward(tiny_model, part, algo, step_counts(part), micro_batch_size=mbs)
                assert len(forwards) == micro_batch_count(rows, mbs, unit), (rows, mbs)
    finally:
        hook.remove()
        tiny_model.zero_grad()
        tiny_model.eval()


def test_fused_adamw_takes_two_hand_worked_steps():
    """AdamW's update by hand for one weight (decoupled decay, bias-corrected moments) against the
    fused optimizer on CPU: w = 1, gradients 0.5 then -0.25, lr 0.1, betas (0.8, 0.99), eps 0.01,
    decay 0.1 (none torch's default, so a setting dropped on the way fails).
    Step 1: w = 1 x 0.99 = 0.99; m = 0.1, v = 0.0025; m^ = 0.5, v^ = 0.25;
    w -= 0.1 x 0.5 / (0.5 + 0.01) = 0.0980392 -> 0.8919608.
    Step 2: w x 0.99 = 0.8830412; m = 0.08 - 0.05 = 0.03, v = 0.002475 + 0.000625 = 0.0031;
    m^ = 0.03 / 0.36 = 0.0833333, v^ = 0.0031 / 0.0199 = 0.1557789 (sqrt 0.3946883);
    w -= 0.1 x 0.0833333 / 0.4046883 = 0.0205920 -> 0.8624492."""
    from primitives.model.training import fused_adamw

    w = torch.nn.Parameter(torch.tensor([1.0]))
    opt = fused_adamw([w], lr=0.1, betas=(0.8, 0.99), eps=0.01, weight_decay=0.1)
    assert opt.defaults["fused"] is True
    for g, expect in [(0.5, 0.8919608), (-0.25, 0.8624492)]:
        w.grad = torch.tensor([g])
        opt.step()
        assert abs(w.item() - expect) < 1e-6, (w.item(), expect)


def test_fused_adamw_only_where_every_parameter_allows_it():
    from primitives.model.training import fused_adamw

    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": iter([torch.nn.Parameter(torch.zeros(3))])}]
    opt = fused_adamw(groups, lr=0.1)
    assert opt.defaults["fused"] is True and [len(g["params"]) for g in opt.param_groups] == [1, 1]  # an iterator too
    named = fused_adamw(torch.nn.Linear(2, 2).named_parameters(), lr=0.1)
    assert named.defaults["fused"] is True and named.param_groups[0]["param_names"] == ["weight", "bias"]
    meta = torch.nn.Parameter(torch.zeros(2, device="meta"))
    assert fused_adamw([torch.nn.Parameter(torch.zeros(2)), meta], lr=0.1).defaults["fused"] is None


def _layer_calls(model) -> list:
    """A count, appended to at every forward call of one of ``model``'s decoder layers."""
    calls: list = []
    for module in model.modules():
        if type(module).__name__.endswith("DecoderLayer"):
            module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("kind", ["policy", "lora", "critic"])
def test_gradient_checkpointing_recomputes_each_layer_for_the_same_gradient(kind, scored, tiny_model, tokenizer):
    """With ``enable_gradient_checkpointing`` each decoder layer runs twice a micro-batch (the forward, and
    again in the backward) where it ran once, and the loss and every gradient are the same (fp32, 1e-6):
    the policy's packed GRPO step in micro-batches, a LoRA policy's (PEFT; its embedding frozen, no input
    needing grad) and a value model's (``ValueModel``: its backbone's layers). In eval mode (generating)
    nothing is recomputed and the samples are the same."""
    from primitives.model.lora import with_lora
    from primitives.model.training import enable_gradient_checkpointing
    from primitives.model.value import value_model_from_policy
    from primitives.types import LoraConfig

    base = copy.deepcopy(tiny_model)
    if kind == "lora":
        base = with_lora(base, LoraConfig(rank=4))
        with torch.no_grad():  # B away from 0, so that A gets a gradient too
            for name, p in base.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    elif kind == "critic":
        base = value_model_from_policy(base, head_init_std=0.1)
    plain, checkpointed = base, copy.deepcopy(base)
    enable_gradient_checkpointing(checkpointed, "trainer 0")
    algo = algos.get_algorithm("grpo", kl_coef=0.0)
    b = make_batch(scored, algo, tokenizer.pad_token_id, budget=6)
    b = b._replace(old_logprobs=b.behaviour_logprobs - 0.1 * b.loss_mask)
    results = []
    for model in (plain, checkpointed):
        calls = _layer_calls(model)
        model.zero_grad()
        if kind == "critic":
            model.train()
            ids, mask = torch.from_numpy(b.input_ids), torch.from_numpy(b.attention_mask)
            loss = (model(ids, mask) * mask).sum() / mask.sum()
            loss.backward()
            loss = float(loss.detach())
        else:
            loss = forward_backward(model, b, algo, step_counts(b), micro_batch_size=6)["loss/policy"]
        results.append((loss, _grads(model), len(calls)))
    (loss, grads, calls), (ck_loss, ck_grads, ck_calls) = results
    layers = 2  # the tiny model's
    passes = 1 if kind == "critic" else -(-len(b.input_ids) // 6)
    assert (calls, ck_calls) == (layers * passes, 2 * layers * passes)
    assert ck_loss == pytest.approx(loss, abs=1e-6)
    assert grads.abs().max() > 0 and (grads != 0).sum() > 0.5 * len(grads)
    torch.testing.assert_close(ck_grads, grads, atol=1e-6, rtol=1e-5)
    if kind == "policy":
        calls = _layer_calls(checkpointed)
        gen = GenerationConfig(max_new_tokens=4, n=2)
        items = [PromptItem(0, "1+2=")]
        got = generate_rollouts(checkpointed, tokenizer, items, gen, generator=torch.Generator().manual_seed(1))
        want = generate_rollouts(plain, tokenizer, items, gen, generator=torch.Generator().manual_seed(1))
        assert [r.completion_ids.tolist() for r in got] == [r.completion_ids.tolist() for r in want]
        assert len(calls) == layers * max(r.num_tokens for r in got)  # once a forward: the prefill, then each step


def test_gradient_checkpointing_on_a_model_without_it_is_refused_by_role():
    from primitives.model.training import enable_gradient_checkpointing

    with pytest.raises(ValueError, match="critic 1: cluster.gradient_checkpointing, but Linear does not support"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2), "critic 1")
