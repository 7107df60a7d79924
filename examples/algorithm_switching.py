"""Switching algorithm mid-training, on a local Ray cluster: GRPO -> DAPO -> online DPO.

Run:   python examples/algorithm_switching.py                     (by iteration, under a minute)
       python examples/algorithm_switching.py --schedule metric   (when a metric passes a threshold)
       python examples/algorithm_switching.py --help              (all flags)

An algorithm is a record of functions and numbers (``primitives.maths.algorithms.AlgorithmConfig``)
and a schedule is a function ``(iteration, last_metrics) -> AlgorithmConfig`` that the driver
calls before every step, so a switch is a function, not a mode:

* ``--schedule piecewise``: GRPO for --phase-steps steps, then DAPO (arXiv 2503.14476:
  clip-higher, token-mean loss, dynamic sampling - a group whose rewards are all equal is
  dropped and more prompts are drawn, see ``data/prompts_drawn``), then online DPO (the best
  and worst completion of each group as a pair, DPO loss against the reference: see
  ``dpo/pairs`` and ``dpo/accuracy``, computed by the trainers).
* ``--schedule metric``: GRPO until a step logs --switch-metric >= --switch-threshold, DAPO
  from the next step on. The switch sticks: the schedule reads the last step's logged
  ``algorithm``, so there is no hidden state and a resumed run switches the same way.

The logged ``algorithm`` of every step is in metrics.jsonl; summary.json has the phases.
The cluster (``CLUSTER``): 1 generator, 2 trainer ranks, 1 reward worker, 1 reference worker.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

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
from primitives.maths.algorithms import dapo, grpo, metric_switch_schedule, online_dpo, piecewise_schedule  # noqa: E402
from primitives.maths.filters import dynamic_sampling_filter  # noqa: E402
from primitives.types import GenerationConfig, TrainState  # noqa: E402
from rl_actors.trainer import TrainerConfig  # noqa: E402

CLUSTER = ClusterConfig(generators=1, trainers=2, reward_workers=1, threads_per_actor=1)
PROMPTS_PER_STEP, LR = 8, 1e-2
PHASE_KEYS = ("reward/mean", "data/prompts_drawn", "dpo/accuracy")  # averaged over each phase in summary.json

GRPO = grpo(kl_coef=0.0)
DAPO = dapo(overlong_buffer_frac=0.0)  # the soft overlong penalty is for long reasoning budgets, not 6 tokens
ONLINE_DPO = online_dpo(filters=(dynamic_sampling_filter,))  # a tied group makes no pair: drop it, draw more


def relative_error_reward(rollout) -> float:
    """``1 - |guess - answer| / answer`` for the completion's first number, floored at 0; 0
    without a number. Graded, so that groups rarely tie once the model writes numbers."""
    guess, answer = parse_first_number(rollout.text), float(rollout.answer)
    return 0.0 if guess is None else max(0.0, 1.0 - abs(float(guess) - answer) / max(answer, 1.0))


def make_schedule(args):
    """``(iteration, last_metrics) -> AlgorithmConfig``, by iteration or on a logged metric."""
    if args.schedule == "piecewise":
        k = args.phase_steps
        return piecewise_schedule([(0, GRPO), (k, DAPO), (2 * k, ONLINE_DPO)])
    return metric_switch_schedule(GRPO, DAPO, args.switch_metric, args.switch_threshold)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/algorithm_switching", help="output directory")
    p.add_argument("--steps", type=int, default=30, help="RL steps in all")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the prompts and sampling")
    p.add_argument("--schedule", choices=("piecewise", "metric"), default="piecewise", help="how to switch")
    p.add_argument("--phase-steps", type=int, default=10, help="piecewise: steps of GRPO, then of DAPO")
    p.add_argument("--switch-metric", default="reward/mean", help="metric: the logged metric to watch")
    p.add_argument("--switch-threshold", type=float, default=0.2, help="metric: switch once it reaches this")
    p.add_argument("--group-size", type=int, default=4, help="completions per prompt (a group ties more "
                                                            "often when smaller)")
    args = p.parse_args(argv)
    if args.phase_steps < 1 or args.group_size < 2:
        p.error("--phase-steps must be >= 1 and --group-size >= 2")
    return args


def main(argv=None) -> dict:
    args, start = parse_args(argv), time.time()
    args.out = output_dir(args.out)  # under ray job submit: $RAYRL_OUTPUT_ROOT, not Ray's temporary copy
    logger, _ = run_logger(args.out, ["algorithm", "reward/mean", "data/prompts_drawn", "dpo/accuracy"], every=1)
    model = save_tiny_model(os.path.join(args.out, "base_model"), seed=args.seed)
    items, _ = make_arithmetic_task(ArithmeticTaskSpec(num_train=1024, num_heldout=1, seed=args.seed))
    with ray_left_as_found():  # a Ray of its own is shut down after; the caller's stays up
        cluster = build_rl_cluster(model, CLUSTER, TrainerConfig(lr=LR), relative_error_reward, with_reference=True,
                                   seed=args.seed)
        backend = RayBackend(cluster)
        try:
            state = train(backend, make_prompt_source(items, seed=args.seed), make_schedule(args),
                          RLRun(GenerationConfig(max_new_tokens=6, n=args.group_size), num_steps=args.steps,
                                prompts_per_step=PROMPTS_PER_STEP, lr_schedule=lambda step: LR, progress=False),
                          state=TrainState(rng_seed=args.seed), hooks=Hooks(logger=logger))
        finally:
            shutdown_cluster(backend.cluster)
    history = list(state.metrics_history)
    plot_curves(history, ["reward/mean", "data/prompts_drawn", "dpo/accuracy", "policy/entropy"],
                os.path.join(args.out, "curves.png"), title=f"algorithm switching ({args.schedule})")
    phases = {}
    for m in history:
        phases.setdefault(m["algorithm"], []).append(m)
    summary = {"schedule": args.schedule, "steps": args.steps,
               "phases": {name: {"steps": f"{rows[0]['step']}-{rows[-1]['step']}",
                                 **{k: mean_of(rows, k) for k in PHASE_KEYS if k in rows[0]}}
                          for name, rows in phases.items()},
               "seed": args.seed, "wall_s": round(time.time() - start, 1)}
    return write_summary(args.out, summary)


if __name__ == "__main__":
    main()
