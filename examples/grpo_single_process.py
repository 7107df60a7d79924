"""GRPO on the embedded tiny model and arithmetic task, in one process on CPU, no Ray.

Run:   python examples/grpo_single_process.py          (under a minute on 2 cores)
       python examples/grpo_single_process.py --help   (all flags)

The RL loop is ``cluster.loop.train.train``, the very loop the Ray job runs
(``rayrl rl examples/configs/default.yaml``: DeepSpeed trainer ranks that also generate and
hold the reference, and a reward worker), here over ``cluster.local.LocalBackend``: everything in this process,
plain torch, no Ray. Same seed and config, same metrics (architecture section 8, invariant 7).

What it does: builds a tiny Qwen2 and a character tokenizer locally (HF format, no
network), fine-tunes it on imperfect demonstrations of two-number addition (a stated share
of carry problems drop the carry), then runs GRPO with an exact-match reward. It prints
held-out greedy accuracy before and after RL and writes to --out: summary.json,
metrics.jsonl, curves.png, base_model/ (unless --base), sft_model/ and final_model/ (HF
checkpoints).

What it leaves out, and why: no critic, no dynamic sampling, no KL by default (the SFT
model is the only reference that matters here; --kl-coef adds one), one process.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.local import LocalBackend  # noqa: E402
from cluster.loop.evaluate import evaluate_accuracy  # noqa: E402
from cluster.loop.sft import SFTRun, train_sft  # noqa: E402
from cluster.loop.train import Hooks, RLRun, train  # noqa: E402
from primitives.fixtures.tasks import ArithmeticTaskSpec, arithmetic_reward, make_arithmetic_task, sft_demonstrations  # noqa: E402
from primitives.fixtures.tiny import save_tiny_model  # noqa: E402
from primitives.io.checkpoint import save_checkpoint  # noqa: E402
from primitives.io.data import make_prompt_source, prepare_sft_text  # noqa: E402
from primitives.io.evaluation import greedy_accuracy  # noqa: E402
from primitives.io.loggers import mean_of, plot_curves, run_logger, write_summary  # noqa: E402
from primitives.io.outputs import output_dir  # noqa: E402
from primitives.maths.algorithms import constant_schedule, grpo  # noqa: E402
from primitives.model.training import linear_warmup  # noqa: E402
from primitives.types import GenerationConfig, TrainState  # noqa: E402
from rl_actors.trainer import TrainerConfig  # noqa: E402

MAX_NEW_TOKENS = 5  # answers have at most 3 digits, plus eos


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/grpo_single_process", help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed for the model, the task and sampling")
    p.add_argument("--base", default=None,
                   help="start from this HF model directory (the tiny character tokenizer, e.g. an SFT'd model's "
                        "sft_model/) instead of building the random tiny model")
    p.add_argument("--sft-steps", type=int, default=1500, help="SFT warm-up optimizer steps")
    p.add_argument("--sft-batch", type=int, default=64, help="SFT demonstrations per step")
    p.add_argument("--sft-lr", type=float, default=1e-3, help="SFT learning rate (AdamW)")
    p.add_argument("--carry-error-rate", type=float, default=0.7,
                   help="share of carry problems whose demonstration drops the carry")
    p.add_argument("--rl-steps", type=int, default=80, help="GRPO optimizer steps")
    p.add_argument("--prompts-per-step", type=int, default=32, help="prompts per GRPO step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--rl-lr", type=float, default=3e-4, help="GRPO learning rate (AdamW)")
    p.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL-in-loss coefficient (0: no reference)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--heldout", type=int, default=256, help="held-out problems for accuracy")
    p.add_argument("--eval-every", type=int, default=20, help="held-out accuracy every N RL steps (0: off)")
    args = p.parse_args(argv)
    for name in ("sft_batch", "prompts_per_step", "group_size", "heldout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.group_size < 2:
        p.error("--group-size must be at least 2: GRPO normalises rewards within a group")
    if args.sft_steps < 0 or args.rl_steps < 0:
        p.error("--sft-steps and --rl-steps must be >= 0")
    if args.base is not None and not os.path.isfile(os.path.join(args.base, "config.json")):
        p.error(f"--base {args.base}: not an HF model directory (no config.json)")
    if args.eval_every < 0:
        p.error("--eval-every must be >= 0")
    if args.temperature <= 0:
        p.error(f"--temperature must be > 0 for RL sampling, got {args.temperature}")
    if args.sft_lr <= 0 or args.rl_lr <= 0:
        p.error("--sft-lr and --rl-lr must be positive")
    return args


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def sft_warmup(base_path: str, demos, args, logger) -> LocalBackend:
    """Supervised steps on (prompt, completion) demonstrations, loss on the completion:
    ``cluster.loop.sft.train_sft`` - the Ray job's SFT loop - over a ``LocalBackend``."""
    backend = LocalBackend(base_path, arithmetic_reward, trainer=TrainerConfig(lr=args.sft_lr, max_grad_norm=1.0),
                           seed=args.seed)
    samples = [prepare_sft_text(backend.tokenizer, p, c) for p, c in demos]
    train_sft(backend, samples, SFTRun(args.sft_steps, args.sft_batch, linear_warmup(args.sft_lr, 50), seed=args.seed,
                                       log_every=50), Hooks(logger=logger))
    return backend


def grpo_train(model_path: str, train_items, args, logger, heldout) -> tuple:
    """GRPO with ``cluster.loop.train.train`` over a ``LocalBackend`` started from ``model_path``;
    held-out greedy accuracy every ``--eval-every`` steps and after the last.
    Returns ``(metrics history, backend)``."""
    backend = LocalBackend(model_path, arithmetic_reward, with_reference=args.kl_coef > 0,
                           trainer=TrainerConfig(lr=args.rl_lr, max_grad_norm=1.0), seed=args.seed)
    gen_config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=args.temperature, n=args.group_size)

    def eval_fn(b, state) -> dict:
        return {"eval/accuracy": evaluate_accuracy(b, heldout, MAX_NEW_TOKENS)}

    algo = grpo(kl_coef=args.kl_coef)
    state = train(backend, make_prompt_source(train_items, seed=args.seed), constant_schedule(algo),
                  RLRun(gen_config, num_steps=args.rl_steps, prompts_per_step=args.prompts_per_step,
                        lr_schedule=lambda step: args.rl_lr),
                  state=TrainState(rng_seed=args.seed),
                  hooks=Hooks(logger=logger, eval_fn=eval_fn if args.eval_every else None, eval_every=args.eval_every))
    return list(state.metrics_history), backend


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.out = output_dir(args.out)  # under ray job submit: $RAYRL_OUTPUT_ROOT, not Ray's temporary copy
    start = time.time()
    seed_everything(args.seed)
    logger, metrics_path = run_logger(args.out, ["loss/sft", "reward/mean", "eval/accuracy", "policy/entropy"])

    base = args.base or save_tiny_model(os.path.join(args.out, "base_model"), seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    spec = ArithmeticTaskSpec(num_heldout=args.heldout, carry_error_rate=args.carry_error_rate, seed=args.seed)
    train_items, heldout = make_arithmetic_task(spec)
    demos, wrong_share = sft_demonstrations(train_items, spec)
    evaluate = lambda m: greedy_accuracy(m, tokenizer, heldout, arithmetic_reward, MAX_NEW_TOKENS)  # noqa: E731

    acc_base = evaluate(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32))
    sft = sft_warmup(base, demos, args, logger)
    acc_before = evaluate(sft.policy)
    sft_path = save_checkpoint(os.path.join(args.out, "sft_model"), sft.policy, tokenizer)
    tqdm.write(f"held-out accuracy after SFT (before RL): {acc_before:.3f}")

    history, backend = grpo_train(sft_path, train_items, args, logger, heldout)
    acc_after = history[-1]["eval/accuracy"] if history and "eval/accuracy" in history[-1] \
        else evaluate_accuracy(backend, heldout, MAX_NEW_TOKENS)
    tqdm.write(f"held-out accuracy after GRPO:            {acc_after:.3f}")
    save_checkpoint(os.path.join(args.out, "final_model"), backend.policy, backend.tokenizer)

    all_rows = [json.loads(line) for line in open(metrics_path)]
    plot_curves(all_rows, ["loss/sft", "reward/mean", "eval/accuracy", "policy/entropy", "grad_norm",
                           "time/generate"],
                os.path.join(args.out, "curves.png"), title="SFT warm-up, then GRPO, on the tiny arithmetic task")
    summary = {
        "accuracy_base_model": acc_base, "accuracy_before_rl": acc_before, "accuracy_after_rl": acc_after,
        "accuracy_gain_points": round(100 * (acc_after - acc_before), 2),
        "sft_steps": args.sft_steps, "rl_steps": args.rl_steps, "sft_wrong_share": round(wrong_share, 4),
        "carry_error_rate": args.carry_error_rate, "group_size": args.group_size,
        "prompts_per_step": args.prompts_per_step, "heldout_size": len(heldout),
        "reward_mean_first5": mean_of(history[:5], "reward/mean"),
        "reward_mean_last5": mean_of(history[-5:], "reward/mean"),
        "seed": args.seed, "wall_s": round(time.time() - start, 1),
    }
    return write_summary(args.out, summary)


if __name__ == "__main__":
    main()
