"""KL estimators and reference-model policies.

Per-token estimators on sampled tokens (J. Schulman, "Approximating KL divergence",
http://joschu.net/blog/kl-approx.html), with ``l = logp - ref_logp`` for tokens drawn
from the policy:

* k1 = l                        unbiased for KL(pi || ref), high variance, can be negative
* k2 = l^2 / 2                  biased, low variance, >= 0
* k3 = exp(-l) - 1 + l          unbiased, low variance, >= 0

In the loss (differentiated through ``logp`` at the sampled tokens) their expected gradients
differ from what they estimate: k1's is 0 (E_pi[grad log pi] = 0; ``validate_algorithm`` refuses it
there), k2's is the gradient of KL(pi || ref), k3's that of KL(ref || pi). In the reward (no
gradient) k1 and k3 estimate KL(pi || ref) without bias.

All take tensors of equal shape (B, T) and return (B, T); masked positions are 0.
A ``kl_fn(logp, ref_logp, mask) -> (B, T)`` is the extension point the loss and the reward
shaping call.
"""
from __future__ import annotations

import copy
from typing import Callable, NamedTuple, Optional

import torch


def _check(logp, ref_logp, mask):
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ in shape")
    if mask is not None and mask.shape != logp.shape:
        raise ValueError(f"mask {tuple(mask.shape)} and logp {tuple(logp.shape)} differ in shape")


def _masked(x, mask):
    return x if mask is None else x * mask


def kl_k1(logp, ref_logp, mask=None):
    _check(logp, ref_logp, mask)
    return _masked(logp - ref_logp, mask)


def kl_k2(logp, ref_logp, mask=None):
    _check(logp, ref_logp, mask)
    return _masked(0.5 * (logp - ref_logp) ** 2, mask)


def kl_k3(logp, ref_logp, mask=None):
    _check(logp, ref_logp, mask)
    neg = ref_logp - logp  # -l; clamp keeps exp finite when the policy drifts far from ref
    return _masked(torch.exp(neg.clamp(max=20.0)) - 1.0 - neg, mask)


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def get_kl_fn(name: str) -> Callable:
    if name not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator '{name}' (choose from {sorted(KL_ESTIMATORS)})")
    return KL_ESTIMATORS[name]


def per_token_kl(logp, ref_logp, mask=None, estimator: str = "k3"):
    """Per-token KL(pi || ref) estimate by name. (B, T) -> (B, T)"""
    return get_kl_fn(estimator)(logp, ref_logp, mask)


def sequence_reverse_kl(logp, ref_logp, mask):
    """KL(pi || ref) of each whole sequence, sampled from pi: sum of k3 over tokens. -> (B,)"""
    return kl_k3(logp, ref_logp, mask).sum(-1)


def sequence_forward_kl(logp, ref_logp, mask):
    """KL(ref || pi) of each sequence from samples of pi, by importance weighting.

    With rho = ref/pi per token, E_pi[rho log rho - rho + 1] = KL(ref || pi) (the k3 form
    of the reversed direction, >= 0). Sum over tokens -> (B,)
    """
    _check(logp, ref_logp, mask)
    log_rho = (ref_logp - logp).clamp(max=20.0)
    return _masked(torch.exp(log_rho) * log_rho - torch.exp(log_rho) + 1.0, mask).sum(-1)


def exact_token_kl(logits, ref_logits, mask=None, reverse: bool = True):
    """Exact KL over the vocabulary at each position (needs both full distributions).

    ``reverse=True``: KL(pi || ref); False: KL(ref || pi). (B, T, V) -> (B, T)
    """
    lp, lq = torch.log_softmax(logits.float(), -1), torch.log_softmax(ref_logits.float(), -1)
    if not reverse:
        lp, lq = lq, lp
    return _masked((lp.exp() * (lp - lq)).sum(-1), mask)


def create_truncated_kl(threshold: float = 1.0, estimator: str = "k3") -> Callable:
    """``kl_fn`` that caps each token's KL estimate at ``threshold`` (and below at -threshold
    for the signed k1), so one surprising token cannot dominate the penalty."""
    if threshold <= 0:
        raise ValueError(f"truncation threshold must be positive, got {threshold}")
    base = get_kl_fn(estimator)

    def kl_fn(logp, ref_logp, mask=None):
        return _masked(base(logp, ref_logp, None).clamp(min=-threshold, max=threshold), mask)

    return kl_fn


def create_confidence_masked_kl(confidence_threshold: float = 0.1, estimator: str = "k3") -> Callable:
    """``kl_fn`` that counts only tokens the policy chose with probability above the threshold."""
    if not 0.0 <= confidence_threshold < 1.0:
        raise ValueError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
    base = get_kl_fn(estimator)

    def kl_fn(logp, ref_logp, mask=None):
        confident = (logp.detach().exp() > confidence_threshold).to(logp.dtype)
        return _masked(base(logp, ref_logp, None) * confident, mask)

    return kl_fn


# ----------------------------------------------------------------------------- reference model

class RefState(NamedTuple):
    """What a reference update function sees and returns (tensors by parameter name)."""

    weights: dict  # name -> tensor (the reference weights)
    last_reset_step: int = 0


def create_reference_model(policy_model, ref_model_fn: Optional[Callable] = None):
    """A frozen copy of the policy (or ``ref_model_fn(policy_model)``), in eval mode. A reference
    that shares any parameter with the policy (the seeds' "shared parameters", ``lambda m: m``, or
    a wrapper or submodule of it) is returned untouched: freezing it, or switching its dropout off,
    would do it to the policy, which then never trains."""
    ref = ref_model_fn(policy_model) if ref_model_fn is not None else copy.deepcopy(policy_model)
    policy_params = {id(p) for p in policy_model.parameters()}
    if ref is policy_model or any(id(p) in policy_params for p in ref.parameters()):
        return ref
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def ref_state_from_model(model, step: int = 0) -> RefState:
    """The model's parameters by name (tied weights once, as ``named_parameters`` lists them), copies
    in float32 where the model holds them narrower (bf16, fp16): an update function's small moves
    round away there. An EMA of decay 0.99 moves the reference by 1 % of its gap to the policy, and
    a bf16 weight in [1, 2) moves in steps of 2^-7: rounded to bf16 at every step, it stayed put until
    the policy was 0.39 away. The model gets the float32 state rounded (``apply_ref_state``). The price: 4 bytes a
    parameter beside a bf16 reference's 2."""
    return RefState({k: wide_copy(v) for k, v in model.named_parameters()}, step)


def wide_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t``, in float32 where ``t`` is a narrower float."""
    t = t.detach()
    narrow = t.is_floating_point() and t.element_size() < 4
    return t.to(torch.float32 if narrow else t.dtype, copy=True)


def fixed_reference(ref: RefState, policy_weights: dict, step: int, kl: Optional[float] = None) -> RefState:
    """The reference never moves (classic RLHF)."""
    return ref


def create_ema_updater(decay: float = 0.99) -> Callable:
    """``ref <- decay * ref + (1 - decay) * policy`` every call."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"EMA decay must be in [0, 1], got {decay}")

    def update_fn(ref: RefState, policy_weights: dict, step: int, kl: Optional[float] = None) -> RefState:
        new = {}
        for name, r in ref.weights.items():
            p = policy_weights[name].to(r.dtype)
            new[name] = r * decay + p * (1.0 - decay) if r.is_floating_point() else p.clone()
        return RefState(new, ref.last_reset_step)

    return update_fn


def create_periodic_updater(every: int) -> Callable:
    """Hard reset to the policy every ``every`` steps (as in TR-DPO / "reference resetting")."""
    if every <= 0:
        raise ValueError(f"reset period must be positive, got {every}")

    def update_fn(ref: RefState, policy_weights: dict, step: int, kl: Optional[float] = None) -> RefState:
        if step - ref.last_reset_step >= every:
            return RefState({k: v.detach().clone() for k, v in policy_weights.items()}, step)
        return ref

    return update_fn


def create_kl_bound_updater(max_kl: float) -> Callable:
    """Hard reset to the policy when the measured mean KL exceeds ``max_kl``."""
    if max_kl <= 0:
        raise ValueError(f"max_kl must be positive, got {max_kl}")

    def update_fn(ref: RefState, policy_weights: dict, step: int, kl: Optional[float] = None) -> RefState:
        if kl is not None and kl > max_kl:
            return RefState({k: v.detach().clone() for k, v in policy_weights.items()}, step)
        return ref

    return update_fn


def apply_ref_state(model, ref: RefState) -> None:
    """Copy reference weights into a model's parameters (in place; the model is the actor's state)."""
    params = dict(model.named_parameters())
    missing = set(params) - set(ref.weights)
    if missing:
        raise KeyError(f"reference state lacks parameters {sorted(missing)[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(ref.weights[name])
