"""Algorithm presets (each an ``AlgorithmConfig``) and schedules ``iteration -> AlgorithmConfig``.

"dapo" is the algorithm of Yu et al. 2025 (arXiv 2503.14476): clip-higher, dynamic
sampling, token-mean loss, soft overlong penalty. The pairwise preference loss that
older notes called "DAPO" is ``online_dpo`` here.
"""
from __future__ import annotations

import bisect
from typing import Callable, Sequence

from primitives.losses import AGGREGATIONS, IS_LEVELS
from primitives.types import AlgorithmConfig

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "none")
POLICY_LOSSES = ("ppo_clip", "gspo", "online_dpo")


def grpo(**overrides) -> AlgorithmConfig:
    """DeepSeekMath GRPO: group-normalised advantages, k3 KL in the loss, seq-mean-token-mean."""
    return _preset("grpo", overrides, advantage="grpo", aggregation="seq-mean-token-mean",
                   kl_coef=0.04, kl_estimator="k3")


def dapo(overlong_buffer_frac: float = 0.2, max_completion_len: int = 0, **overrides) -> AlgorithmConfig:
    """DAPO: eps_low 0.2 / eps_high 0.28, dynamic sampling, token-mean, overlong shaping, no KL.

    The overlong penalty's hard limit is the generation budget unless ``max_completion_len``
    is given; its buffer is ``overlong_buffer_frac`` of that limit (the paper: 4096 of 20480)."""
    return _preset("dapo", overrides, advantage="grpo", aggregation="token-mean", clip_eps_low=0.2,
                   clip_eps_high=0.28, kl_coef=0.0, dynamic_sampling=True,
                   max_completion_len=max_completion_len, overlong_buffer_frac=overlong_buffer_frac)


def dr_grpo(**overrides) -> AlgorithmConfig:
    """Dr.GRPO: no std normalisation, constant-length normaliser, no KL."""
    return _preset("dr_grpo", overrides, advantage="dr_grpo", aggregation="seq-mean-token-sum-norm",
                   kl_coef=0.0)


def rloo(**overrides) -> AlgorithmConfig:
    return _preset("rloo", overrides, advantage="rloo", aggregation="token-mean", kl_coef=0.0)


def reinforce_pp(baseline: bool = False, **overrides) -> AlgorithmConfig:
    """REINFORCE++ (k1 KL in the token reward, global whitening); ``baseline`` subtracts the group mean."""
    return _preset("reinforce_pp_baseline" if baseline else "reinforce_pp", overrides,
                   advantage="reinforce_pp_baseline" if baseline else "reinforce_pp",
                   aggregation="token-mean", kl_coef=0.01, kl_estimator="k1", kl_in_reward=True)


def gspo(**overrides) -> AlgorithmConfig:
    """GSPO: sequence-level ratio with the paper's small clip range."""
    return _preset("gspo", overrides, advantage="grpo", policy_loss="gspo", aggregation="seq-mean-token-mean",
                   clip_eps_low=3e-4, clip_eps_high=4e-4, kl_coef=0.0)


def ppo(**overrides) -> AlgorithmConfig:
    """PPO with a critic: GAE, k1 KL in the reward, value loss with clipping."""
    return _preset("ppo", overrides, advantage="gae", aggregation="token-mean", kl_coef=0.05, kl_estimator="k1",
                   kl_in_reward=True, gamma=1.0, lam=0.95, whiten_advantages=True)


def online_dpo(beta: float = 0.1, pair_selection: str = "top_bottom", **overrides) -> AlgorithmConfig:
    """Online DPO: pairs chosen within each group by reward, DPO loss against the reference."""
    return _preset("online_dpo", overrides, advantage="none", policy_loss="online_dpo", dpo_beta=beta,
                   pair_selection=pair_selection, kl_coef=0.0)


PRESETS = {"grpo": grpo, "dapo": dapo, "dr_grpo": dr_grpo, "rloo": rloo, "reinforce_pp": reinforce_pp,
           "gspo": gspo, "ppo": ppo, "online_dpo": online_dpo}


def _preset(name: str, overrides: dict, **defaults) -> AlgorithmConfig:
    return make_algorithm(overrides.pop("name", name), **{**defaults, **overrides})


def make_algorithm(name: str, **fields) -> AlgorithmConfig:
    """An ``AlgorithmConfig`` with its names checked (errors list the valid choices)."""
    unknown = set(fields) - set(AlgorithmConfig._fields)
    if unknown:
        raise ValueError(f"unknown AlgorithmConfig field(s) {sorted(unknown)}")
    algo = AlgorithmConfig(name=name, **fields)
    return validate_algorithm(algo)


def validate_algorithm(algo: AlgorithmConfig) -> AlgorithmConfig:
    if algo.advantage not in ADVANTAGES:
        raise ValueError(f"algorithm '{algo.name}': unknown advantage '{algo.advantage}' ({', '.join(ADVANTAGES)})")
    if algo.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"algorithm '{algo.name}': unknown policy loss '{algo.policy_loss}' "
                         f"({', '.join(POLICY_LOSSES)})")
    if algo.aggregation not in AGGREGATIONS:
        raise ValueError(f"algorithm '{algo.name}': unknown aggregation '{algo.aggregation}' "
                         f"({', '.join(AGGREGATIONS)})")
    if algo.kl_estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"algorithm '{algo.name}': unknown KL estimator '{algo.kl_estimator}' (k1, k2, k3)")
    if algo.clip_eps_low < 0 or algo.clip_eps_high < 0:
        raise ValueError(f"algorithm '{algo.name}': clip ranges must be >= 0")
    if not 0.0 <= algo.overlong_buffer_frac <= 1.0:
        raise ValueError(f"algorithm '{algo.name}': overlong_buffer_frac must be in [0, 1], "
                         f"got {algo.overlong_buffer_frac}")
    if algo.policy_loss == "gspo" and algo.aggregation != "seq-mean-token-mean":
        raise ValueError(f"algorithm '{algo.name}': GSPO's loss is per sequence and needs aggregation "
                         f"'seq-mean-token-mean', got '{algo.aggregation}'")
    if algo.policy_loss == "gspo" and algo.dual_clip is not None:
        raise ValueError(f"algorithm '{algo.name}': GSPO clips a sequence ratio; dual_clip "
                         f"({algo.dual_clip}) applies to token ratios only - set dual_clip=None")
    if algo.kl_coef > 0 and not algo.needs_reference:
        raise ValueError(f"algorithm '{algo.name}': kl_coef={algo.kl_coef} needs reference logprobs, but "
                         "needs_reference is False")
    if algo.is_level not in IS_LEVELS:
        raise ValueError(f"algorithm '{algo.name}': unknown is_level '{algo.is_level}' ({', '.join(IS_LEVELS)})")
    if algo.is_cap <= 0:
        raise ValueError(f"algorithm '{algo.name}': is_cap must be positive, got {algo.is_cap}")
    if algo.ppo_epochs < 1 or algo.mini_batches < 1:
        raise ValueError(f"algorithm '{algo.name}': ppo_epochs and mini_batches must be >= 1, "
                         f"got {algo.ppo_epochs} and {algo.mini_batches}")
    return algo


def uses_reference(algo: AlgorithmConfig) -> bool:
    """Whether a step of ``algo`` needs reference logprobs (KL anywhere, or online DPO)."""
    return algo.needs_reference and (algo.kl_coef > 0 or algo.policy_loss == "online_dpo")


def get_algorithm(name: str, **overrides) -> AlgorithmConfig:
    """Preset by name: grpo, dapo, dr_grpo, rloo, reinforce_pp, gspo, ppo, online_dpo."""
    if name not in PRESETS:
        raise ValueError(f"unknown algorithm '{name}' (choose from {', '.join(sorted(PRESETS))})")
    return PRESETS[name](**overrides)


def constant_schedule(algo: AlgorithmConfig) -> Callable[[int], AlgorithmConfig]:
    return lambda iteration: algo


def piecewise_schedule(pieces: Sequence) -> Callable[[int], AlgorithmConfig]:
    """``[(start_iteration, AlgorithmConfig), ...]``: each config from its start until the next.
    The first piece must start at 0; e.g. ``[(0, grpo()), (100, dapo())]`` switches at 100."""
    pieces = sorted(pieces, key=lambda p: p[0])
    if not pieces or pieces[0][0] != 0:
        raise ValueError("piecewise_schedule: the first piece must start at iteration 0")
    starts = [p[0] for p in pieces]

    def schedule(iteration: int) -> AlgorithmConfig:
        return pieces[bisect.bisect_right(starts, iteration) - 1][1]

    return schedule


def linear_kl_schedule(algo: AlgorithmConfig, start: float, end: float, steps: int) -> Callable:
    """``algo`` with ``kl_coef`` moving linearly from ``start`` to ``end`` over ``steps`` iterations."""

    def schedule(iteration: int) -> AlgorithmConfig:
        frac = min(max(iteration / max(steps, 1), 0.0), 1.0)
        return algo._replace(kl_coef=start + (end - start) * frac)

    return schedule
