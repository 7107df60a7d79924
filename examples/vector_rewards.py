"""Vector rewards with a user aggregator, on a local Ray cluster.

Run:   python examples/vector_rewards.py                 (under a minute on 2 CPU cores)
       python examples/vector_rewards.py --help          (all flags)

What it shows (the seeds' "vector rewards with custom aggregation"): the reward function
returns one number per objective - correctness, format (digits only) and brevity (the
model ends its answer itself) - and the user's aggregator folds them into the scalar
reward that GRPO trains on. The reward workers compute both; the driver logs every
component as ``reward/<name>`` beside ``reward/mean``, so each objective can be followed.
From the untrained tiny model the format and brevity components move first; correctness
needs the SFT warm-up that ``grpo_single_process.py`` does.

The cluster (``CLUSTER``): 1 generator, 2 DeepSpeed trainer ranks, 1 reward worker, one thread each.
Writes to --out: metrics.jsonl (every step), summary.json, curves.png.
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
from primitives.env.rewards import compute_vector_reward  # noqa: E402
from primitives.fixtures.tasks import ArithmeticTaskSpec, arithmetic_reward, make_arithmetic_task  # noqa: E402
from primitives.fixtures.tiny import save_tiny_model  # noqa: E402
from primitives.io.data import make_prompt_source  # noqa: E402
from primitives.io.loggers import mean_of, plot_curves, run_logger, write_summary  # noqa: E402
from primitives.io.outputs import output_dir  # noqa: E402
from primitives.maths.algorithms import constant_schedule, grpo  # noqa: E402
from primitives.types import GenerationConfig, TrainState  # noqa: E402
from rl_actors.trainer import TrainerConfig  # noqa: E402

CLUSTER = ClusterConfig(generators=1, trainers=2, reward_workers=1, threads_per_actor=1)
PROMPTS_PER_STEP, GROUP_SIZE, LR = 8, 4, 1e-3


# ----------------------------------------------------------------------------- the user's reward
def digits_only(rollout) -> float:
    """Format: the share of the completion's characters that are digits."""
    text = rollout.text.strip()
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def brevity(rollout) -> float:
    """1 when the model ended its answer (eos) before the token budget ran out."""
    return float(rollout.finish_reason == "stop")


COMPONENTS = {"correct": arithmetic_reward, "digits": digits_only, "brief": brevity}  # logged as reward/<name>
WEIGHTS = (1.0, 0.3, 0.2)


def multi_objective_reward(rollout):
    """The vector reward, one component per objective: (K,) = (3,)."""
    return compute_vector_reward(rollout, list(COMPONENTS.values()))


def correctness_first(vector) -> float:
    """The user's aggregator: a weighted sum in which correctness outweighs the rest together."""
    return sum(w * v for w, v in zip(WEIGHTS, vector))


# ----------------------------------------------------------------------------- the run
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/vector_rewards", help="output directory")
    p.add_argument("--steps", type=int, default=100, help="GRPO steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the prompts and sampling")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args, start = parse_args(argv), time.time()
    args.out = output_dir(args.out)  # under ray job submit: $RAYRL_OUTPUT_ROOT, not Ray's temporary copy
    keys = ["reward/mean"] + [f"reward/{name}" for name in COMPONENTS]
    logger, _ = run_logger(args.out, keys, every=10)
    model = save_tiny_model(os.path.join(args.out, "base_model"), seed=args.seed)
    items, _ = make_arithmetic_task(ArithmeticTaskSpec(num_train=512, num_heldout=1, seed=args.seed))
    with ray_left_as_found():  # a Ray of its own is shut down after; the caller's stays up
        cluster = build_rl_cluster(model, CLUSTER, TrainerConfig(lr=LR), multi_objective_reward, with_reference=False,
                                   aggregate_fn=correctness_first, seed=args.seed)
        backend = RayBackend(cluster)
        try:
            state = train(backend, make_prompt_source(items, seed=args.seed), constant_schedule(grpo(kl_coef=0.0)),
                          RLRun(GenerationConfig(max_new_tokens=6, n=GROUP_SIZE), num_steps=args.steps,
                                prompts_per_step=PROMPTS_PER_STEP, lr_schedule=lambda step: LR,
                                component_names=list(COMPONENTS)),
                          state=TrainState(rng_seed=args.seed), hooks=Hooks(logger=logger))
        finally:
            shutdown_cluster(backend.cluster)
    history = list(state.metrics_history)
    plot_curves(history, keys, os.path.join(args.out, "curves.png"), title="GRPO on a vector reward")
    summary = {"steps": args.steps, "aggregator": dict(zip(COMPONENTS, WEIGHTS)),
               "reward_first10": {k.split("/")[1]: mean_of(history[:10], k) for k in keys},
               "reward_last10": {k.split("/")[1]: mean_of(history[-10:], k) for k in keys},
               "seed": args.seed, "wall_s": round(time.time() - start, 1)}
    return write_summary(args.out, summary)


if __name__ == "__main__":
    main()
