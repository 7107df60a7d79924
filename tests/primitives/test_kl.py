"""KL estimators against hand-worked values; reference-update policies."""
import math

import pytest
import torch

from primitives.maths import kl as K

LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])  # l = logp - ref = [0.5, -1.0]


def test_k1_k2_k3_hand_values():
    torch.testing.assert_close(K.kl_k1(LOGP, REF), torch.tensor([[0.5, -1.0]]))
    torch.testing.assert_close(K.kl_k2(LOGP, REF), torch.tensor([[0.125, 0.5]]))
    # k3 = exp(-l) - 1 + l
    expected = torch.tensor([[math.exp(-0.5) - 0.5, math.e - 2.0]])  # [0.10653066, 0.71828183]
    torch.testing.assert_close(K.kl_k3(LOGP, REF), expected, atol=1e-7, rtol=0)


def test_mask_zeroes_positions():
    out = K.per_token_kl(LOGP, REF, torch.tensor([[1.0, 0.0]]), "k3")
    torch.testing.assert_close(out, torch.tensor([[math.exp(-0.5) - 0.5, 0.0]]), atol=1e-7, rtol=0)


def test_k3_nonnegative_everywhere():
    g = torch.Generator().manual_seed(0)
    log_ratio = torch.randn(10000, generator=g) * 5
    assert (K.kl_k3(log_ratio, torch.zeros_like(log_ratio)) >= 0).all()
    assert (K.kl_k2(log_ratio, torch.zeros_like(log_ratio)) >= 0).all()


def test_k1_k3_unbiased_for_reverse_kl():
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    exact = float((p * (p / q).log()).sum())
    g = torch.Generator().manual_seed(0)
    idx = torch.multinomial(p, 400_000, replacement=True, generator=g)
    lp, lq = p.log()[idx], q.log()[idx]
    assert abs(float(K.kl_k1(lp, lq).mean()) - exact) < 0.01
    assert abs(float(K.kl_k3(lp, lq).mean()) - exact) < 0.01
    # forward KL(q || p) from samples of p by importance weighting
    exact_fwd = float((q * (q / p).log()).sum())
    fwd = K.sequence_forward_kl(lp[:, None], lq[:, None], torch.ones(len(idx), 1)).mean()
    assert abs(float(fwd) - exact_fwd) < 0.02


def test_sequence_kls_hand_values():
    mask = torch.ones(1, 2)
    torch.testing.assert_close(K.sequence_reverse_kl(LOGP, REF, mask), torch.tensor([0.82481249]), atol=1e-6, rtol=0)
    # rho = exp(ref - logp) = [e^-0.5, e]; rho*log(rho) - rho + 1 = [0.09020401, 1.0]
    torch.testing.assert_close(K.sequence_forward_kl(LOGP, REF, mask), torch.tensor([1.09020401]), atol=1e-6, rtol=0)


def test_exact_token_kl_both_directions():
    logits = torch.zeros(1, 1, 2)  # p = [0.5, 0.5]
    ref = torch.tensor([[[math.log(3.0), 0.0]]])  # q = [0.75, 0.25]
    torch.testing.assert_close(K.exact_token_kl(logits, ref), torch.tensor([[0.14384104]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(K.exact_token_kl(logits, ref, reverse=False), torch.tensor([[0.13081204]]),
                               atol=1e-6, rtol=0)


def test_truncated_and_confidence_masked():
    trunc = K.create_truncated_kl(0.5, "k3")
    torch.testing.assert_close(trunc(LOGP, REF), torch.tensor([[math.exp(-0.5) - 0.5, 0.5]]), atol=1e-7, rtol=0)
    trunc_k1 = K.create_truncated_kl(0.75, "k1")
    torch.testing.assert_close(trunc_k1(LOGP, REF), torch.tensor([[0.5, -0.75]]))
    conf = K.create_confidence_masked_kl(0.3, "k3")  # p(tok) = [0.368, 0.135]: second dropped
    torch.testing.assert_close(conf(LOGP, REF), torch.tensor([[math.exp(-0.5) - 0.5, 0.0]]), atol=1e-7, rtol=0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        K.per_token_kl(LOGP, REF, None, "k4")
    with pytest.raises(ValueError, match="differ in shape"):
        K.kl_k3(LOGP, REF[:, :1])
    with pytest.raises(ValueError, match="positive"):
        K.create_truncated_kl(0.0)


def test_reference_updates():
    ref = K.RefState({"w": torch.tensor([1.0])}, 0)
    policy = {"w": torch.tensor([3.0])}
    assert K.fixed_reference(ref, policy, 5) is ref
    ema = K.create_ema_updater(0.9)(ref, policy, 1)
    torch.testing.assert_close(ema.weights["w"], torch.tensor([1.2]))
    periodic = K.create_periodic_updater(3)
    assert periodic(ref, policy, 2) is ref
    reset = periodic(ref, policy, 3)
    torch.testing.assert_close(reset.weights["w"], torch.tensor([3.0]))
    assert reset.last_reset_step == 3
    bound = K.create_kl_bound_updater(0.1)
    assert bound(ref, policy, 4, kl=0.05) is ref
    torch.testing.assert_close(bound(ref, policy, 4, kl=0.2).weights["w"], torch.tensor([3.0]))


def test_a_bf16_reference_follows_its_ema_in_float32():
    """A bf16 weight of 1 next to a policy at 1 + 2^-7 (the next bf16 number): an EMA of decay 0.99
    moves it by 0.01 x 2^-7 = 7.8e-5 a step, under half of bf16's 2^-7 step there, so rounded to
    bf16 at each step it never moves. Kept in float32 (``ref_state_from_model``), after 100 steps it
    is 1 + 2^-7 (1 - 0.99^100) = 1.0049529 by hand, and the model holds that rounded to bf16:
    1 + 2^-7 (the nearer of 1 and 1.0078125). The same through the reference actor's ``move``."""
    from rl_actors.reference import Reference

    gap = 2.0 ** -7
    expected = 1.0 + gap * (1.0 - 0.99 ** 100)
    assert expected == pytest.approx(1.0049529, abs=1e-7)
    model = torch.nn.Linear(3, 2, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    policy = {"weight": torch.full((2, 3), 1.0 + gap, dtype=torch.bfloat16)}
    update = K.create_ema_updater(0.99)
    state = K.ref_state_from_model(model)
    assert state.weights["weight"].dtype == torch.float32
    reference = Reference(model, update)
    for step in range(100):
        state = update(state, policy, step)
        reference.move(policy, step)
    torch.testing.assert_close(state.weights["weight"], torch.full((2, 3), expected), rtol=0, atol=1e-6)
    torch.testing.assert_close(reference.state.weights["weight"], torch.full((2, 3), expected), rtol=0, atol=1e-6)
    assert model.weight.dtype == torch.bfloat16 and torch.equal(model.weight, policy["weight"])
    narrow = K.RefState({"weight": torch.ones(2, 3, dtype=torch.bfloat16)})  # the state kept in bf16: stuck
    for step in range(100):
        narrow = update(narrow, policy, step)
    assert torch.equal(narrow.weights["weight"], torch.ones(2, 3, dtype=torch.bfloat16))
    full = torch.nn.Linear(2, 2)  # a float32 model's state: copies in float32, not its own tensors
    kept = K.ref_state_from_model(full).weights["weight"]
    assert kept.dtype == torch.float32 and torch.equal(kept, full.weight)
    assert kept.data_ptr() != full.weight.data_ptr()


def test_a_saved_tracking_reference_resumes_its_update_state(tiny_model, tmp_path):
    """A periodic reference (every 3 steps) over steps 1-8 resets at 3 and 6. Saved after step 4 and
    loaded by a new one (a resumed job's reference), it must reset at 6, not at 5 and 8 as one that
    forgot its last reset (step 3) would. A bf16 EMA reference gets its float32 state back exactly,
    not the bf16 weights it scores with; a fixed reference writes no update state."""
    import copy
    import os

    from primitives.io.checkpoint import TRACKING_STATE
    from rl_actors.reference import Reference

    def policy_at(step):
        return {k: v.detach() + 0.01 * step for k, v in tiny_model.named_parameters()}

    def resets(ref, steps):
        out = []
        for step in steps:
            before = ref.state.last_reset_step
            ref.move(policy_at(step), step)
            out += [step] if ref.state.last_reset_step != before else []
        return out

    periodic = K.create_periodic_updater(3)
    assert resets(Reference(copy.deepcopy(tiny_model), periodic), range(1, 9)) == [3, 6]
    first = Reference(copy.deepcopy(tiny_model), periodic)
    assert resets(first, range(1, 5)) == [3]
    first.save(str(tmp_path / "periodic"))
    resumed = Reference(copy.deepcopy(tiny_model), periodic)
    resumed.load_from(str(tmp_path / "periodic"))
    assert resumed.state.last_reset_step == 3 and resets(resumed, range(5, 9)) == [6]

    ema = Reference(copy.deepcopy(tiny_model).to(torch.bfloat16), K.create_ema_updater(0.99))
    for step in range(1, 4):
        ema.move({k: v + 0.001 for k, v in policy_at(0).items()}, step)
    ema.save(str(tmp_path / "ema"))
    again = Reference(copy.deepcopy(tiny_model).to(torch.bfloat16), K.create_ema_updater(0.99))
    again.load_from(str(tmp_path / "ema"))
    assert again.state.weights.keys() == ema.state.weights.keys()
    for name, kept in ema.state.weights.items():
        assert kept.dtype == torch.float32 and torch.equal(again.state.weights[name], kept), name
    assert any(not torch.equal(kept.to(torch.bfloat16).float(), kept) for kept in ema.state.weights.values())
    Reference(copy.deepcopy(tiny_model)).save(str(tmp_path / "fixed"))
    assert not os.path.exists(tmp_path / "fixed" / TRACKING_STATE)


def test_create_reference_model_is_frozen_copy(tiny_model):
    ref = K.create_reference_model(tiny_model)
    assert ref is not tiny_model
    assert all(not p.requires_grad for p in ref.parameters())
    for (n, a), (_, b) in zip(tiny_model.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), n
    state = K.ref_state_from_model(ref)
    K.apply_ref_state(ref, K.create_ema_updater(0.0)(state, {k: v * 0 for k, v in state.weights.items()}, 1))
    assert all(float(p.abs().sum()) == 0 for p in ref.parameters())


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_what_each_estimator_pulls_towards_in_the_loss(name):
    """A KL estimator in the loss is differentiated through log pi at the sampled tokens, so its expected
    gradient over pi is sum_a pi(a) grad k(a). Exactly, on a 3-token softmax (logits [0.5, -0.3, 1.2],
    reference softmax([0, 0.4, -0.2])): k1's is 0 (E_pi[grad log pi] = 0: no pull at all), k2's is the
    gradient of KL(pi || ref), k3's that of KL(ref || pi) (GRPO's); by hand, k2 [-0.106, -0.203, 0.310]
    and k3 [-0.013, -0.321, 0.334]. So k1 belongs in the reward, never in the loss (refused there)."""
    from primitives.maths import algorithms as A

    theta = torch.tensor([0.5, -0.3, 1.2], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.4, -0.2], dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    expected = (logp.exp().detach() * K.get_kl_fn(name)(logp, ref)).sum()
    (grad,) = torch.autograd.grad(expected, theta, retain_graph=True)
    p = logp.exp()
    divergence = {"k1": torch.zeros((), dtype=torch.float64, requires_grad=True),
                  "k2": (p * (logp - ref)).sum(), "k3": (ref.exp() * (ref - logp)).sum()}[name]
    (truth,) = torch.autograd.grad(divergence, theta, allow_unused=True)
    torch.testing.assert_close(grad, torch.zeros(3, dtype=torch.float64) if truth is None else truth,
                               atol=1e-12, rtol=0)
    by_hand = {"k1": [0.0, 0.0, 0.0], "k2": [-0.106, -0.203, 0.310], "k3": [-0.013, -0.321, 0.334]}[name]
    assert grad.tolist() == pytest.approx(by_hand, abs=1e-3)
    if name == "k1":
        with pytest.raises(ValueError, match="kl_fn k1 in the loss .* has a zero gradient in expectation"):
            A.get_algorithm("grpo", kl_fn="k1")
        assert A.get_algorithm("grpo", kl_fn="k1", kl_in_reward=True).kl_fn is K.kl_k1  # in the reward
        assert A.get_algorithm("grpo", kl_fn="k1", kl_coef=0.0).kl_fn is K.kl_k1  # no KL at all
