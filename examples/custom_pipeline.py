"""A complete custom pipeline on a local Ray cluster: the user's own reward, advantage,
loss and schedule, each a plain module-level function.

Run:   python examples/custom_pipeline.py            (under a minute on 2 CPU cores)
       python examples/custom_pipeline.py --help     (all flags)

What it shows (the seeds' "complete custom pipeline"): every extension point of one RL
step replaced by a function of this file, none of them registered anywhere:

* reward ``closeness(rollout)``: 1 - |answer - first number of the completion| / 100, runs
  on the reward worker;
* advantage ``rank_advantage(inputs, algo)``: the centred rank of each reward within its
  group, in [-1/2, 1/2] (ties share their mean rank) - robust to the reward's scale;
* loss ``reinforce_loss(inputs, algo)``: REINFORCE, -A log pi, token-mean over the step,
  plus ``algo.kl_coef`` times ``algo.kl_fn`` against the reference; it logs its own
  ``pipeline/*`` metrics, computed on every trainer rank and merged by the driver;
* schedule ``adaptive_kl_schedule(iteration, last_metrics)``: the adaptive KL controller of
  Ziegler et al. 2019 (arXiv 1909.08593, section 2.2), ``beta <- beta * (1 + K e)`` with
  ``e = clip(KL / target - 1, -0.2, 0.2)``. The coefficient and the KL it reacts to come
  from the last step's logged metrics - no hidden counter, so a resumed run goes on alike.

The algorithm record ties them together:
``AlgorithmConfig(name="reinforce_rank", advantage_fn=rank_advantage, loss_fn=reinforce_loss, kl_coef=...)``.
Writes to --out: metrics.jsonl, summary.json, curves.png.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.loop.train import Hooks, RLRun, train  # noqa: E402
from cluster.ray_wing.backend import RayBackend  # noqa: E402
from cluster.ray_wing.config import ClusterConfig  # noqa: E402
from cluster.ray_wing.roles import build_rl_cluster, ray_left_as_found, shutdown_cluster  # noqa: E402
from primitives.env.rewards import parse_first_number  # noqa: E402
from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task  # noqa: E402
from primitives.fixtures.tiny import save_tiny_model  # noqa: E402
from primitives.io.data import make_prompt_source  # noqa: E402
from primitives.io.loggers import mean_of, plot_curves, run_logger, write_summary  # noqa: E402
from primitives.io.outputs import output_dir  # noqa: E402
from primitives.maths.advantages import broadcast_to_tokens  # noqa: E402
from primitives.maths.algorithms import AlgorithmConfig  # noqa: E402
from primitives.types import GenerationConfig, TrainState  # noqa: E402
from rl_actors.trainer import TrainerConfig  # noqa: E402

CLUSTER = ClusterConfig(generators=1, trainers=2, reward_workers=1, threads_per_actor=1)
PROMPTS_PER_STEP, GROUP_SIZE, LR = 8, 4, 1e-2
KL_GAIN = 1.0  # K_beta of the controller; Ziegler et al. use 0.1 over many more steps than this run has


# ----------------------------------------------------------------------------- the user's functions
def closeness(rollout) -> float:
    """``1 - |answer - guess| / 100`` for the completion's first number, floored at 0; 0
    without one (the answers are sums below 100)."""
    guess = parse_first_number(rollout.text)
    return 0.0 if guess is None else max(0.0, 1.0 - abs(float(guess) - float(rollout.answer)) / 100.0)


def rank_advantage(inputs, algo):
    """Centred rank within the group, ``(#lower - #higher) / (2 (G - 1))`` in [-1/2, 1/2], on
    every loss token: ties share their mean rank, and each group sums to 0. -> ((B, T), None)"""
    rewards_B, groups = inputs.rewards, np.asarray(inputs.groups)
    adv_B = torch.zeros_like(rewards_B)
    for g in dict.fromkeys(inputs.groups):
        idx = torch.from_numpy(np.flatnonzero(groups == g))
        r = rewards_B[idx]
        lower, higher = (r[:, None] > r[None, :]).sum(1), (r[:, None] < r[None, :]).sum(1)
        adv_B[idx] = (lower - higher) / (2.0 * max(len(idx) - 1, 1))
    return broadcast_to_tokens(adv_B, inputs.mask), None


def reinforce_loss(inputs, algo):
    """REINFORCE with a KL penalty: ``sum(-A * logp + kl_coef * kl) / N`` over the loss
    tokens, N the step's global token count (so micro-batches and ranks add up). Metrics
    are shares of the step, summed by the driver: ``pipeline/kl_coef`` is the coefficient
    this step used, ``pipeline/adv_sum`` the sum of the rows' advantages (0 for centred
    ranks), ``pipeline/adv_abs_max`` the largest (merged by max)."""
    x, n = inputs, max(inputs.counts.num_tokens, 1)
    pg = -(x.advantages * x.logp * x.mask).sum() / n
    kl = algo.kl_fn(x.logp, x.ref_logp, x.mask).sum() / n
    loss = pg + algo.kl_coef * kl
    share = float(x.mask.sum()) / n
    adv_row = (x.advantages * x.mask).sum(-1) / x.mask.sum(-1).clamp(min=1)  # (B,)
    return loss, {"loss/policy": float(pg.detach()), "loss/kl": float(kl.detach()), "loss/total": float(loss.detach()),
                  "pipeline/kl_coef": algo.kl_coef * share, "pipeline/adv_sum": float(adv_row.sum()),
                  "pipeline/adv_abs_max": float(adv_row.abs().max())}


def adaptive_kl_schedule(iteration, last_metrics, *, kl_coef, kl_target):
    """Ziegler et al.'s adaptive KL controller as a schedule: the last step's coefficient
    times ``1 + KL_GAIN * clip(KL / target - 1, -0.2, 0.2)`` (``kl_coef`` at the first step)."""
    algo = AlgorithmConfig(name="reinforce_rank", advantage_fn=rank_advantage, loss_fn=reinforce_loss,
                           kl_coef=kl_coef)
    if not last_metrics:
        return algo
    error = float(np.clip(last_metrics["loss/kl"] / kl_target - 1.0, -0.2, 0.2))
    return algo._replace(kl_coef=last_metrics["pipeline/kl_coef"] * (1.0 + KL_GAIN * error))


# ----------------------------------------------------------------------------- the run
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/custom_pipeline", help="output directory")
    p.add_argument("--steps", type=int, default=30, help="RL steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the prompts and sampling")
    p.add_argument("--kl-coef", type=float, default=0.05, help="the KL coefficient of the first step")
    p.add_argument("--kl-target", type=float, default=0.3, help="the KL the controller steers to")
    args = p.parse_args(argv)
    if args.kl_coef <= 0 or args.kl_target <= 0:
        p.error("--kl-coef and --kl-target must be positive: the controller scales the coefficient")
    return args


def main(argv=None) -> dict:
    args, start = parse_args(argv), time.time()
    args.out = output_dir(args.out)  # under ray job submit: $RAYRL_OUTPUT_ROOT, not Ray's temporary copy
    keys = ["reward/mean", "loss/kl", "pipeline/kl_coef", "pipeline/adv_abs_max"]
    logger, _ = run_logger(args.out, keys, every=5)
    model = save_tiny_model(os.path.join(args.out, "base_model"), seed=args.seed)
    items, _ = make_arithmetic_task(ArithmeticTaskSpec(num_train=512, num_heldout=1, seed=args.seed))
    schedule = functools.partial(adaptive_kl_schedule, kl_coef=args.kl_coef, kl_target=args.kl_target)
    with ray_left_as_found():  # a Ray of its own is shut down after; the caller's stays up
        cluster = build_rl_cluster(model, CLUSTER, TrainerConfig(lr=LR), closeness, with_reference=True, seed=args.seed)
        backend = RayBackend(cluster)
        try:
            state = train(backend, make_prompt_source(items, seed=args.seed), schedule,
                          RLRun(GenerationConfig(max_new_tokens=6, n=GROUP_SIZE), num_steps=args.steps,
                                prompts_per_step=PROMPTS_PER_STEP, lr_schedule=lambda step: LR),
                          state=TrainState(rng_seed=args.seed), hooks=Hooks(logger=logger))
        finally:
            shutdown_cluster(backend.cluster)
    history = list(state.metrics_history)
    plot_curves(history, keys, os.path.join(args.out, "curves.png"), title="REINFORCE, rank advantages, adaptive KL")
    summary = {"algorithm": history[0]["algorithm"], "steps": args.steps,
               "kl_coef_first": history[0]["pipeline/kl_coef"], "kl_coef_last": history[-1]["pipeline/kl_coef"],
               "kl_target": args.kl_target, "loss_kl_last5": mean_of(history[-5:], "loss/kl"),
               "reward_mean_first5": mean_of(history[:5], "reward/mean"),
               "reward_mean_last5": mean_of(history[-5:], "reward/mean"),
               "seed": args.seed, "wall_s": round(time.time() - start, 1)}
    return write_summary(args.out, summary)


if __name__ == "__main__":
    main()
