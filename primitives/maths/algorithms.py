"""Algorithms as records of functions: ``AlgorithmConfig``, its presets, and schedules.

An algorithm is the functions one RL step calls - advantage, policy loss, whole loss, KL
estimator (and whether KL goes in the reward or the loss), pair selector, rollout filters,
loss aggregation - plus its numbers. The presets (``grpo()``, ``dapo()`` ...) build such
records; nothing else looks at an algorithm's name. A new algorithm is a preset with one
function replaced::

    my_algo = grpo()._replace(name="grpo_trunc_kl", kl_fn=create_truncated_kl(1.0))

A schedule ``(iteration, last_metrics) -> AlgorithmConfig`` is evaluated every step, so
switching algorithm (at an iteration, or when a metric passes a threshold) is a function.

"dapo" is the algorithm of Yu et al. 2025 (arXiv 2503.14476): clip-higher, dynamic
sampling, token-mean loss, soft overlong penalty. The pairwise preference loss that
older notes called "DAPO" is ``online_dpo`` here.
"""
from __future__ import annotations

import bisect
from typing import Callable, NamedTuple, Optional, Sequence

from primitives.hooks import check_arity, did_you_mean, fn_name, load_function, trait
from primitives.maths import advantages as adv
from primitives.maths.filters import PAIR_SELECTORS, dynamic_sampling_filter, top_bottom_pairs
from primitives.maths.kl import KL_ESTIMATORS, kl_k1, kl_k3
from primitives.maths.losses import AGGREGATIONS, IS_LEVELS, seq_mean_token_mean, seq_mean_token_sum_norm, token_mean
from primitives.maths.objectives import (
    LOSS_FNS,
    POLICY_LOSS_FNS,
    gspo_policy_loss,
    online_dpo_objective,
    policy_objective,
    ppo_clip_policy_loss,
)


class AlgorithmConfig(NamedTuple):
    """The functions and numbers of one RL step. Build one with a preset and ``_replace``.

    Signatures of the function fields:

    * ``advantage_fn(AdvantageInputs, algo) -> (advantages (B, T), returns (B, T) or None)``
      (``primitives.maths.advantages``; mark one that reads critic values ``needs_values``).
    * ``policy_loss_fn(logp, old_logp, advantages, mask, algo) -> (loss (B, T), clipped (B, T))``,
      the surrogate that ``policy_objective`` weights, aggregates and adds KL and entropy to.
    * ``loss_fn(LossInputs, algo) -> (loss, metrics)``: the whole loss of a micro-batch
      (``primitives.maths.objectives``); a pairwise loss is marked ``pairwise`` and needs a
      ``pair_selector``.
    * ``kl_fn(logp, ref_logp, mask) -> (B, T)``: the KL estimate, in the loss
      (``kl_in_reward=False``) or in the reward.
    * ``aggregation(loss (B, T), mask, counts) -> scalar`` (``primitives.maths.losses``).
    * ``pair_selector(members, rng) -> [(chosen, rejected), ...]`` per group, or None.
    * ``filters``: ``rollouts -> rollouts`` applied to each generation round; when they drop
      groups the driver draws more prompts (DAPO's dynamic sampling).
    """

    name: str = "grpo"
    advantage_fn: Callable = adv.grpo_advantage
    policy_loss_fn: Callable = ppo_clip_policy_loss
    loss_fn: Callable = policy_objective
    aggregation: Callable = seq_mean_token_mean
    kl_fn: Callable = kl_k3
    kl_in_reward: bool = False  # True: KL per token in the reward (PPO, REINFORCE++); False: in the loss
    kl_coef: float = 0.0
    pair_selector: Optional[Callable] = None
    filters: tuple = ()
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: Optional[float] = None  # c > 1 enables dual clip (Ye et al. 2020)
    entropy_coef: float = 0.0
    # DAPO soft overlong penalty: the buffer as a share of max_completion_len (0 = off; the
    # paper's 4096 of 20480 tokens is 0.2)
    overlong_buffer_frac: float = 0.0
    overlong_penalty: float = 1.0  # DAPO: penalty at the hard limit
    max_completion_len: int = 0  # the overlong penalty's hard limit; 0 = the generation budget
    filter_overlong: bool = False  # DAPO overlong filtering: truncated completions get no loss (masked)
    dpo_beta: float = 0.1  # online DPO
    gamma: float = 1.0  # discount (GAE / REINFORCE++)
    lam: float = 1.0  # GAE lambda
    value_clip: float = 0.2  # PPO value loss clip (the critic's)
    whiten_advantages: bool = False  # batch whitening after the advantage function
    adv_eps: float = 1e-6
    needs_reference: bool = True  # False: never fetch reference logprobs (then kl_coef must be 0)
    # Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
    # brings you off-policy RL training"): the loss of each token is weighted by
    # min(pi_old / pi_behaviour, is_cap), per token or per sequence, so a generator that
    # differs from the trainer (vLLM, bf16, stale weights) is corrected explicitly. Behaviour
    # logprobs are of the full softmax(logits / T) under top-k / top-p too (primitives.model.generation).
    is_level: str = "token"  # off | token | sequence
    is_cap: float = 2.0  # the truncation C of the importance weight
    ppo_epochs: int = 1  # passes over each rollout batch
    mini_batches: int = 1  # optimizer updates per pass (the batch split into this many parts)


FUNCTION_FIELDS = ("advantage_fn", "policy_loss_fn", "loss_fn", "aggregation", "kl_fn", "pair_selector")
# the names a job config may give a function field, besides module:function
NAMED_FUNCTIONS = {"advantage_fn": adv.ADVANTAGE_FNS, "policy_loss_fn": POLICY_LOSS_FNS, "loss_fn": LOSS_FNS,
                   "aggregation": AGGREGATIONS, "kl_fn": KL_ESTIMATORS, "pair_selector": PAIR_SELECTORS,
                   "filters": {"dynamic_sampling": dynamic_sampling_filter}}


def grpo(**overrides) -> AlgorithmConfig:
    """DeepSeekMath GRPO: group-normalised advantages, k3 KL in the loss, seq-mean-token-mean."""
    return make_algorithm("grpo", overrides, kl_coef=0.04)


def dapo(**overrides) -> AlgorithmConfig:
    """DAPO: eps_low 0.2 / eps_high 0.28, dynamic sampling, token-mean, overlong shaping, no KL.

    The overlong penalty's hard limit is the generation budget unless ``max_completion_len``
    is given; its buffer is ``overlong_buffer_frac`` of that limit (the paper: 4096 of 20480)."""
    return make_algorithm("dapo", overrides, aggregation=token_mean, clip_eps_low=0.2, clip_eps_high=0.28,
                          filters=(dynamic_sampling_filter,), overlong_buffer_frac=0.2)


def dr_grpo(**overrides) -> AlgorithmConfig:
    """Dr.GRPO: no std normalisation, constant-length normaliser, no KL."""
    return make_algorithm("dr_grpo", overrides, advantage_fn=adv.dr_grpo_advantage,
                          aggregation=seq_mean_token_sum_norm)


def rloo(**overrides) -> AlgorithmConfig:
    return make_algorithm("rloo", overrides, advantage_fn=adv.rloo_advantage, aggregation=token_mean)


def reinforce_pp(baseline: bool = False, **overrides) -> AlgorithmConfig:
    """REINFORCE++ (k1 KL in the token reward, global whitening); ``baseline`` subtracts the group mean."""
    return make_algorithm("reinforce_pp_baseline" if baseline else "reinforce_pp", overrides,
                          advantage_fn=adv.reinforce_pp_baseline_advantage if baseline else adv.reinforce_pp_advantage,
                          aggregation=token_mean, kl_coef=0.01, kl_fn=kl_k1, kl_in_reward=True)


def reinforce(baseline: float = 0.0, **overrides) -> AlgorithmConfig:
    """REINFORCE with a constant baseline (the seeds' plan: advantages ``R - baseline``; Williams
    1992): no group statistics, so one completion per prompt is enough. No KL by default."""
    return make_algorithm("reinforce", overrides, advantage_fn=adv.constant_baseline(baseline))


def gspo(**overrides) -> AlgorithmConfig:
    """GSPO: sequence-level ratio with the paper's small clip range."""
    return make_algorithm("gspo", overrides, policy_loss_fn=gspo_policy_loss, clip_eps_low=3e-4,
                          clip_eps_high=4e-4)


def ppo(**overrides) -> AlgorithmConfig:
    """PPO with a critic: GAE over k1 KL token rewards, whitened advantages. The value model,
    its clipped loss (``value_clip``) and optimizer live on the critic."""
    return make_algorithm("ppo", overrides, advantage_fn=adv.gae_advantage, aggregation=token_mean, kl_coef=0.05,
                          kl_fn=kl_k1, kl_in_reward=True, gamma=1.0, lam=0.95, whiten_advantages=True)


def online_dpo(beta: float = 0.1, **overrides) -> AlgorithmConfig:
    """Online DPO: pairs chosen within each group by reward (highest vs lowest), DPO loss
    against the reference."""
    return make_algorithm("online_dpo", overrides, advantage_fn=adv.no_advantage, loss_fn=online_dpo_objective,
                          pair_selector=top_bottom_pairs, dpo_beta=beta)


PRESETS = {"grpo": grpo, "dapo": dapo, "dr_grpo": dr_grpo, "rloo": rloo, "reinforce": reinforce,
           "reinforce_pp": reinforce_pp, "gspo": gspo, "ppo": ppo, "online_dpo": online_dpo}


def make_algorithm(name: str, overrides: Optional[dict] = None, **fields) -> AlgorithmConfig:
    """An ``AlgorithmConfig`` of ``fields`` updated by ``overrides``, checked (``validate_algorithm``)."""
    fields = {**fields, **(overrides or {})}
    fields = {k: resolve_function(k, v) if k in NAMED_FUNCTIONS else v for k, v in fields.items()}
    unknown = set(fields) - set(AlgorithmConfig._fields)
    if unknown:
        hints = "".join(did_you_mean(k, AlgorithmConfig._fields) for k in sorted(unknown))
        raise ValueError(f"unknown AlgorithmConfig field(s) {sorted(unknown)}{hints}")
    return validate_algorithm(AlgorithmConfig(**{"name": name, **fields}))


def pairwise(algo: AlgorithmConfig) -> bool:
    """Whether the loss takes (chosen, rejected) rows: then rows travel and split in pairs."""
    return bool(trait(algo.loss_fn, "pairwise"))


def min_group_size(algo: AlgorithmConfig) -> int:
    """The fewest completions per prompt a step of ``algo`` can learn from: 2 for a group estimator
    (its ``advantage_fn``'s ``min_group_size`` trait) or a pairwise loss, else 1 (a constant
    baseline, REINFORCE++, GAE; a function of the user's without the trait is checked on its batch)."""
    return max(int(trait(algo.advantage_fn, "min_group_size", 1)), 2 if pairwise(algo) else 1)


def group_size_error(algo: AlgorithmConfig, group_size: int) -> Optional[str]:
    """Why ``group_size`` completions per prompt are too few for ``algo`` (None when they are not):
    the one message of this refusal, for the loop's check before generating and for a batch made by
    hand."""
    need = min_group_size(algo)
    if group_size >= need:
        return None
    return (f"algorithm '{algo.name}' compares completions of the same prompt and needs at least {need} per prompt; "
            f"the run samples {group_size} (GenerationConfig.n, the seeds' num_return_sequences; "
            f"generation.group_size in a job file). Sample n >= {need}, or learn from single completions with "
            f"REINFORCE and a constant baseline: primitives.maths.algorithms.reinforce(baseline=0.5) "
            f"(rl_primitives.create_algorithm_config('reinforce', {{'baseline': 0.5}}))")


def needs_values(algo: AlgorithmConfig) -> bool:
    """Whether the advantage function reads critic values (PPO's GAE): the job needs a critic."""
    return bool(trait(algo.advantage_fn, "needs_values"))


def number_errors(kl_coef: Optional[float], ppo_epochs: int, mini_batches: int, is_level: str, is_cap: float,
                  prefix: str = "") -> list:
    """The problems of an algorithm's numbers, each naming its field after ``prefix``: the one
    check of these values, for a record (``validate_algorithm``) and for a job's ``algorithm``
    section (``prefix="algorithm."``; ``kl_coef`` None there means the preset's own)."""
    checks = [(kl_coef is None or kl_coef >= 0, f"{prefix}kl_coef must be >= 0, got {kl_coef}"),
              (ppo_epochs >= 1, f"{prefix}ppo_epochs must be at least 1, got {ppo_epochs}"),
              (mini_batches >= 1, f"{prefix}mini_batches must be at least 1, got {mini_batches}"),
              (is_level in IS_LEVELS, f"{prefix}is_level must be one of {', '.join(IS_LEVELS)}, got {is_level}"),
              (is_cap > 0, f"{prefix}is_cap must be positive, got {is_cap}")]
    return [message for ok, message in checks if not ok]


def validate_algorithm(algo: AlgorithmConfig) -> AlgorithmConfig:
    """Check that the record's functions are callables that fit together, and its numbers."""
    where = f"algorithm '{algo.name}'"
    for field in FUNCTION_FIELDS:
        fn = getattr(algo, field)
        if fn is None and field == "pair_selector":
            continue
        if not callable(fn):
            raise ValueError(f"{where}: {field} must be a function, got {fn!r}")
    for f in algo.filters:
        if not callable(f):
            raise ValueError(f"{where}: filters must be functions rollouts -> rollouts, got {f!r}")
    if pairwise(algo) and algo.pair_selector is None:
        raise ValueError(f"{where}: the loss {fn_name(algo.loss_fn)} is pairwise and needs a pair_selector "
                         "(e.g. primitives.maths.filters.top_bottom_pairs)")
    if algo.pair_selector is not None and not pairwise(algo):
        raise ValueError(f"{where}: a pair_selector makes (chosen, rejected) rows, but the loss "
                         f"{fn_name(algo.loss_fn)} is not pairwise (mark one with primitives.hooks.with_traits)")
    if algo.clip_eps_low < 0 or algo.clip_eps_high < 0:
        raise ValueError(f"{where}: clip ranges must be >= 0")
    if not isinstance(algo.value_clip, (int, float)) or not algo.value_clip > 0:
        raise ValueError(f"{where}: value_clip must be > 0, got {algo.value_clip} (the critic's clip around its "
                         f"rollout-time values: at 0 a value that moved towards its return is held there, and the "
                         f"critic stops learning; for no clip give a large value, such as 1e9)")
    if not 0.0 <= algo.overlong_buffer_frac <= 1.0:
        raise ValueError(f"{where}: overlong_buffer_frac must be in [0, 1], got {algo.overlong_buffer_frac}")
    sequence_level = trait(algo.policy_loss_fn, "sequence_level")
    if sequence_level and algo.aggregation is not seq_mean_token_mean:
        raise ValueError(f"{where}: the policy loss {fn_name(algo.policy_loss_fn)} is per sequence (GSPO) and needs "
                         f"aggregation 'seq-mean-token-mean', got {fn_name(algo.aggregation)}")
    if sequence_level and algo.dual_clip is not None:
        raise ValueError(f"{where}: {fn_name(algo.policy_loss_fn)} clips a sequence ratio (GSPO); dual_clip "
                         f"({algo.dual_clip}) applies to token ratios only - set dual_clip=None")
    numbers = number_errors(algo.kl_coef, algo.ppo_epochs, algo.mini_batches, algo.is_level, algo.is_cap)
    if numbers:
        raise ValueError(f"{where}: {'; '.join(numbers)}")
    if algo.kl_coef > 0 and not algo.needs_reference:
        raise ValueError(f"{where}: kl_coef={algo.kl_coef} needs reference logprobs, but needs_reference is False")
    if algo.kl_coef > 0 and not algo.kl_in_reward and algo.kl_fn is kl_k1:
        raise ValueError(f"{where}: kl_fn k1 in the loss (kl_coef {algo.kl_coef}, kl_in_reward False) has a zero "
                         "gradient in expectation: k1 = log pi - log ref, and E_pi[grad log pi] = 0, so it only adds "
                         "noise and never pulls the policy towards the reference; in the loss use k2 (its gradient "
                         "is that of KL(pi || ref)) or k3 (GRPO's), or put k1 in the reward (kl_in_reward True, as "
                         "ppo and reinforce_pp do)")
    return algo


def _on_sample(fn, what: str, *args):
    """``fn(*args)`` on a small sample; any failure is a ValueError naming ``what``."""
    try:
        return fn(*args)
    except Exception as e:
        raise ValueError(f"{what} {fn_name(fn)} fails on a small sample: {type(e).__name__}: {e}") from None


def _per_token(out, what: str, fn, shape: tuple) -> None:
    if not hasattr(out, "shape") or tuple(out.shape) != shape:
        raise ValueError(f"{what} {fn_name(fn)} must return a per-token (B, T) tensor; on a {shape} sample it "
                         f"returned {getattr(out, 'shape', type(out).__name__)}")


def check_algorithm_functions(algo: AlgorithmConfig) -> None:
    """Each function field takes its documented arguments (by signature) and gives the
    documented result on a small sample (2 groups of 2 rows, 3 tokens), before any work
    starts; errors name the field and the function."""
    import torch

    from primitives.maths.losses import LossCounts
    from primitives.maths.objectives import LossInputs

    where = f"algorithm '{algo.name}'"
    z = torch.zeros(1, 1)
    check_arity(algo.advantage_fn, f"{where}: advantage_fn", adv.AdvantageInputs(z[0], ("g",), z), algo)
    check_arity(algo.policy_loss_fn, f"{where}: policy_loss_fn", z, z, z, z, algo)
    check_arity(algo.loss_fn, f"{where}: loss_fn", None, algo)
    check_arity(algo.aggregation, f"{where}: aggregation", z, z, None)
    check_arity(algo.kl_fn, f"{where}: kl_fn", z, z, z)
    if algo.pair_selector is not None:
        check_arity(algo.pair_selector, f"{where}: pair_selector", [], None)
    for f in algo.filters:
        check_arity(f, f"{where}: filter", [])
    B, T = 4, 3
    mask, logp = torch.ones(B, T), torch.full((B, T), -1.0)
    kl = _on_sample(algo.kl_fn, f"{where}: kl_fn", logp, torch.full((B, T), -1.5), mask)
    _per_token(kl, f"{where}: kl_fn", algo.kl_fn, (B, T))
    sample = adv.AdvantageInputs(torch.tensor([1.0, 0.0, 0.5, 0.25]), ("a", "a", "b", "b"), mask,
                                 token_kl=kl if algo.kl_in_reward else None,
                                 values=torch.zeros(B, T) if needs_values(algo) else None)
    out = _on_sample(algo.advantage_fn, f"{where}: advantage_fn", sample, algo)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(f"{where}: advantage_fn {fn_name(algo.advantage_fn)} must return (advantages, returns or "
                         f"None); on a sample it returned {type(out).__name__}")
    _per_token(out[0], f"{where}: advantage_fn", algo.advantage_fn, (B, T))
    per_tok = _on_sample(algo.policy_loss_fn, f"{where}: policy_loss_fn", logp, logp, torch.ones(B, T), mask, algo)
    if not (isinstance(per_tok, tuple) and len(per_tok) == 2):
        raise ValueError(f"{where}: policy_loss_fn {fn_name(algo.policy_loss_fn)} must return (per-token loss, "
                         f"clipped); on a sample it returned {type(per_tok).__name__}")
    _per_token(per_tok[0], f"{where}: policy_loss_fn", algo.policy_loss_fn, (B, T))
    counts = LossCounts(num_tokens=B * T, num_sequences=B, max_len=T)
    total = _on_sample(algo.aggregation, f"{where}: aggregation", per_tok[0], mask, counts)
    if not hasattr(total, "shape") or tuple(total.shape) != ():
        raise ValueError(f"{where}: aggregation {fn_name(algo.aggregation)} must return a scalar tensor")
    inputs = LossInputs(logp=logp.clone().requires_grad_(True), old_logp=None,
                        advantages=torch.tensor([[1.0] * T, [-1.0] * T] * 2), mask=mask, counts=counts,
                        behaviour_logp=logp, ref_logp=torch.full((B, T), -1.5), entropy=torch.ones(B, T))
    result = _on_sample(algo.loss_fn, f"{where}: loss_fn", inputs, algo)
    if not (isinstance(result, tuple) and len(result) == 2 and hasattr(result[0], "backward")
            and isinstance(result[1], dict)):
        raise ValueError(f"{where}: loss_fn {fn_name(algo.loss_fn)} must return (loss tensor, metrics dict)")


def check_algorithm_picklable(algo: AlgorithmConfig) -> None:
    """Every function the record carries (filters included) can travel to Ray actors."""
    from primitives.hooks import check_picklable

    for field in FUNCTION_FIELDS:
        check_picklable(getattr(algo, field), f"algorithm '{algo.name}': {field}")
    for f in algo.filters:
        check_picklable(f, f"algorithm '{algo.name}': filter")


def uses_reference(algo: AlgorithmConfig) -> bool:
    """Whether a step of ``algo`` needs reference logprobs (KL anywhere, or a loss that reads them)."""
    return algo.needs_reference and (algo.kl_coef > 0 or bool(trait(algo.loss_fn, "needs_reference")))


def resolve_function(field: str, value):
    """A function field's value from a job config: a known name (``"rloo"``, ``"k1"``,
    ``"token-mean"`` ...) or ``module:function``; callables pass through. ``filters`` takes a
    comma-separated list."""
    if field == "filters":
        if isinstance(value, str):
            return tuple(resolve_function("filter", v.strip()) for v in value.split(",") if v.strip())
        return tuple(value)
    if not isinstance(value, str):
        return value
    names = NAMED_FUNCTIONS["filters" if field == "filter" else field]
    if value in names:
        return names[value]
    if ":" in value:
        return load_function(value)
    raise ValueError(f"{field}: unknown name '{value}' (known: {', '.join(names)}; or module:function)"
                     f"{did_you_mean(value, names)}")


def get_algorithm(name: str, **overrides) -> AlgorithmConfig:
    """A preset by name (grpo, dapo, dr_grpo, rloo, reinforce, reinforce_pp, gspo, ppo, online_dpo), or
    ``module:function`` returning an ``AlgorithmConfig``; ``overrides`` replace its fields
    (function fields may be given by name or as ``module:function``)."""
    if ":" in name:
        made = load_function(name)()
        if not isinstance(made, AlgorithmConfig):
            raise ValueError(f"algorithm '{name}' returned {type(made).__name__}, not an AlgorithmConfig")
        return make_algorithm(made.name, overrides, **{k: v for k, v in made._asdict().items() if k != "name"})
    if name not in PRESETS:
        raise ValueError(f"unknown algorithm '{name}' (choose from {', '.join(sorted(PRESETS))}, or "
                         f"module:function){did_you_mean(name, PRESETS)}")
    return PRESETS[name](**overrides)


# ----------------------------------------------------------------------------- schedules
# A schedule is ``(iteration, last_metrics) -> AlgorithmConfig``; ``last_metrics`` is the
# previous step's logged metrics ({} at the first step), including its ``"algorithm"`` name,
# so a switch can be made sticky without hidden state (and resumes exactly).

def constant_schedule(algo: AlgorithmConfig) -> Callable:
    return lambda iteration, last_metrics=None: algo


def piecewise_schedule(pieces: Sequence) -> Callable:
    """``[(start_iteration, AlgorithmConfig), ...]``: each config from its start until the next.
    The first piece must start at 0; e.g. ``[(0, grpo()), (100, dapo())]`` switches at 100."""
    pieces = sorted(pieces, key=lambda p: p[0])
    if not pieces or pieces[0][0] != 0:
        raise ValueError("piecewise_schedule: the first piece must start at iteration 0")
    starts = [p[0] for p in pieces]

    def schedule(iteration: int, last_metrics: Optional[dict] = None) -> AlgorithmConfig:
        return pieces[bisect.bisect_right(starts, iteration) - 1][1]

    return schedule


def metric_switch_schedule(first: AlgorithmConfig, then: AlgorithmConfig, metric: str = "reward/mean",
                           threshold: float = 0.5) -> Callable:
    """``first`` until a step logs ``metric >= threshold``, ``then`` from the next step on. The
    switch sticks: once the last step ran ``then`` (its logged ``algorithm`` name), it stays."""
    if first.name == then.name:
        raise ValueError(f"metric_switch_schedule: both algorithms are named '{first.name}'; the switch is "
                         "recognised by name, so give them different names (_replace(name=...))")

    def schedule(iteration: int, last_metrics: Optional[dict] = None) -> AlgorithmConfig:
        last = last_metrics or {}
        switched = last.get("algorithm") == then.name or float(last.get(metric, float("-inf"))) >= threshold
        return then if switched else first

    return schedule


def linear_kl_schedule(algo: AlgorithmConfig, start: float, end: float, steps: int) -> Callable:
    """``algo`` with ``kl_coef`` moving linearly from ``start`` to ``end`` over ``steps`` iterations."""

    def schedule(iteration: int, last_metrics: Optional[dict] = None) -> AlgorithmConfig:
        frac = min(max(iteration / max(steps, 1), 0.0), 1.0)
        return algo._replace(kl_coef=start + (end - start) * frac)

    return schedule


def check_schedule(schedule: Callable) -> AlgorithmConfig:
    """The schedule takes ``(iteration, last_metrics)`` and returns an ``AlgorithmConfig`` at
    iteration 0; returns that first algorithm (checked and validated)."""
    check_arity(schedule, "algorithm_schedule", 0, {})
    first = schedule(0, {})
    if not isinstance(first, AlgorithmConfig):
        raise ValueError(f"algorithm_schedule {fn_name(schedule)} returned {type(first).__name__} at iteration 0; "
                         "expected an AlgorithmConfig")
    check_algorithm_functions(validate_algorithm(first))
    return first
