"""A custom KL estimator in the loss and an EMA reference model, on a local Ray cluster.

Run:   python examples/custom_kl_ema.py                        (two short runs, under a minute)
       python examples/custom_kl_ema.py --kl confidence        (confidence-masked KL instead)
       python examples/custom_kl_ema.py --help                 (all flags)

What it shows (the seeds' "custom KL divergence with reference model updates"):

* The KL estimator is a field of the algorithm record:
  ``grpo(kl_coef=...)._replace(kl_fn=create_truncated_kl(threshold))`` caps each token's k3
  estimate, so one surprising token cannot dominate the penalty; ``--kl confidence`` counts
  only tokens the policy chose with probability above --confidence
  (``create_confidence_masked_kl``). The trainers compute it in the loss (``loss/kl``);
  ``kl/ref_k3`` beside it is the plain k3 of the same tokens.
* The reference moves: ``ref_update_fn=create_ema_updater(decay)`` runs on the reference
  worker at every weight sync, ``ref <- decay * ref + (1 - decay) * policy``. The same run
  with a fixed reference follows on a fresh cluster, and the summary compares the two:
  the EMA reference stays closer to the policy (smaller ``kl/ref_k3``).

Reward: the completion starts with a digit (``regex_format_reward``), which the untrained
tiny model learns within a few steps, so the policy moves away from the reference.
Writes to --out: metrics.jsonl (both runs, the field "reference" tells which), summary.json,
curves.png.
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
from primitives.env.rewards import regex_format_reward  # noqa: E402
from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task  # noqa: E402
from primitives.fixtures.tiny import save_tiny_model  # noqa: E402
from primitives.io.data import make_prompt_source  # noqa: E402
from primitives.io.loggers import mean_of, plot_curves, run_logger, write_summary  # noqa: E402
from primitives.io.outputs import output_dir  # noqa: E402
from primitives.maths.algorithms import constant_schedule, grpo  # noqa: E402
from primitives.maths.kl import create_confidence_masked_kl, create_ema_updater, create_truncated_kl  # noqa: E402
from primitives.types import GenerationConfig, TrainState  # noqa: E402
from rl_actors.trainer import TrainerConfig  # noqa: E402

STARTS_WITH_DIGIT = regex_format_reward(r"\d.*")
KEYS = ("loss/kl", "kl/ref_k3", "reward/mean")
CLUSTER = ClusterConfig(generators=1, trainers=2, reward_workers=1, threads_per_actor=1)
PROMPTS_PER_STEP, GROUP_SIZE, LR = 8, 4, 1e-3


def algorithm(args):
    """GRPO with the user's KL estimator in the loss."""
    if args.kl == "truncated":
        kl_fn, name = create_truncated_kl(args.kl_threshold), "grpo_truncated_kl"
    else:
        kl_fn, name = create_confidence_masked_kl(args.confidence), "grpo_confident_kl"
    return grpo(kl_coef=args.kl_coef)._replace(name=name, kl_fn=kl_fn)


def run(args, model: str, items, ref_update_fn, logger) -> list:
    """Train on a cluster of its own whose reference worker applies ``ref_update_fn`` (None:
    a fixed reference); returns every step's metrics."""
    cluster = build_rl_cluster(model, CLUSTER, TrainerConfig(lr=LR), STARTS_WITH_DIGIT, with_reference=True,
                               ref_update_fn=ref_update_fn, seed=args.seed)
    backend = RayBackend(cluster)
    try:
        state = train(backend, make_prompt_source(items, seed=args.seed), constant_schedule(algorithm(args)),
                      RLRun(GenerationConfig(max_new_tokens=6, n=GROUP_SIZE), num_steps=args.steps,
                            prompts_per_step=PROMPTS_PER_STEP, lr_schedule=lambda step: LR, progress=False),
                      state=TrainState(rng_seed=args.seed), hooks=Hooks(logger=logger))
    finally:
        shutdown_cluster(backend.cluster)
    return list(state.metrics_history)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/custom_kl_ema", help="output directory")
    p.add_argument("--steps", type=int, default=20, help="GRPO steps of each run")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the prompts and sampling")
    p.add_argument("--kl", choices=("truncated", "confidence"), default="truncated", help="the KL estimator")
    p.add_argument("--kl-coef", type=float, default=0.1, help="KL coefficient in the loss")
    p.add_argument("--kl-threshold", type=float, default=0.02, help="truncated: cap of each token's k3")
    p.add_argument("--confidence", type=float, default=0.02,
                   help="confidence: least policy probability counted (the untrained model's is about 0.01)")
    p.add_argument("--ema-decay", type=float, default=0.9, help="EMA decay of the reference")
    args = p.parse_args(argv)
    if not 0.0 <= args.ema_decay <= 1.0 or args.kl_coef <= 0:
        p.error("--ema-decay must be in [0, 1] and --kl-coef positive")
    return args


def main(argv=None) -> dict:
    args, start = parse_args(argv), time.time()
    args.out = output_dir(args.out)  # under ray job submit: $RAYRL_OUTPUT_ROOT, not Ray's temporary copy
    logger, _ = run_logger(args.out, ("reference",) + KEYS, every=5)
    model = save_tiny_model(os.path.join(args.out, "base_model"), seed=args.seed)
    items, _ = make_arithmetic_task(ArithmeticTaskSpec(num_train=512, num_heldout=1, seed=args.seed))
    runs = {}
    with ray_left_as_found():  # a Ray of its own is shut down after; the caller's stays up
        for name, update in (("ema", create_ema_updater(args.ema_decay)), ("fixed", None)):
            runs[name] = run(args, model, items, update, lambda m, name=name: logger({**m, "reference": name}))
    rows = [{"step": i, **{f"{k} ({name})": h[i][k] for name, h in runs.items() for k in KEYS}}
            for i in range(args.steps)]
    plot_curves(rows, [f"{k} ({name})" for k in KEYS for name in runs], os.path.join(args.out, "curves.png"),
                title=f"{algorithm(args).name}: EMA (decay {args.ema_decay}) vs fixed reference")
    summary = {"algorithm": algorithm(args).name, "kl_coef": args.kl_coef, "ema_decay": args.ema_decay,
               **({"kl_threshold": args.kl_threshold} if args.kl == "truncated" else {"confidence": args.confidence}),
               "mean_over_steps": {k: {name: mean_of(h, k) for name, h in runs.items()} for k in KEYS},
               "steps": args.steps, "seed": args.seed, "wall_s": round(time.time() - start, 1)}
    return write_summary(args.out, summary)


if __name__ == "__main__":
    main()
