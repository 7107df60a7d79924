"""GRPO on the embedded SmolLM2-135M-Instruct (real BPE tokenizer, chat template), on Ray, CPU.

Run:  python benchmarks/bench_smollm2.py [--rl-steps 30] [--out runs/bench_smollm2]

Task: chat-formatted two-number addition (operands 0-99, "Reply with the number only"), the
reward 1 when the last number of the reply is the sum. One generator, one trainer (ZeRO-2),
one reward worker, no KL (no reference), each actor with the machine's two threads (the
phases run one after another). Prints held-out greedy accuracy before and after RL and the
seconds per step; writes metrics.jsonl, curves.png and summary.json to --out.
"""
import argparse
import json
import os
import time

import numpy as np
from common import ROOT


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rl-steps", type=int, default=30)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--heldout", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=2, help="torch threads per actor")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_smollm2"))
    args = p.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")

    from cluster.config import ClusterConfig
    from cluster.driver import evaluate_accuracy, train
    from cluster.setup import build_rl_cluster, shutdown_cluster
    from primitives.algorithms import constant_schedule, grpo
    from primitives.data import make_prompt_source
    from primitives.loggers import mean_of, plot_curves, run_logger, write_summary
    from primitives.pretrained import save_smollm2
    from primitives.tasks import ArithmeticTaskSpec, chat_arithmetic_items, chat_arithmetic_reward, make_arithmetic_task
    from primitives.types import GenerationConfig
    from rl_actors.trainer import TrainerConfig

    start = time.time()
    path = save_smollm2(os.path.join(ROOT, "runs", "smollm2"))  # converted once, then reused
    train_items, heldout = make_arithmetic_task(ArithmeticTaskSpec(max_operand=99, num_train=2000,
                                                                   num_heldout=args.heldout, seed=0))
    train_items, heldout = chat_arithmetic_items(train_items), chat_arithmetic_items(heldout)
    logger, metrics_path = run_logger(args.out, ["reward/mean", "eval/accuracy", "time/step"])
    cfg = ClusterConfig(generators=1, trainers=1, reward_workers=1, zero_stage=2, threads_per_actor=args.threads,
                        call_timeout_s=1800)
    cluster = build_rl_cluster(path, cfg, TrainerConfig(zero_stage=2, lr=args.lr, micro_batch_size=16),
                               chat_arithmetic_reward, with_reference=False)
    setup_s = time.time() - start
    try:
        before = evaluate_accuracy(cluster, heldout, args.max_new_tokens)
        print(f"held-out greedy accuracy before RL: {before:.3f}", flush=True)
        logger({"step": -1, "eval/accuracy": before})  # the curve's first point
        gen = GenerationConfig(max_new_tokens=args.max_new_tokens, n=args.group_size, temperature=args.temperature)
        evaluate = lambda c, s: {"eval/accuracy": evaluate_accuracy(c, heldout, args.max_new_tokens)}  # noqa: E731
        state, cluster = train(cluster, make_prompt_source(train_items, seed=0), constant_schedule(grpo(kl_coef=0.0)),
                               gen, args.rl_steps, args.prompts_per_step, lambda step: args.lr, logger=logger,
                               eval_fn=evaluate, eval_every=args.eval_every)
    finally:
        shutdown_cluster(cluster)
    history = list(state.metrics_history)
    after = history[-1]["eval/accuracy"]
    print(f"held-out greedy accuracy after {args.rl_steps} GRPO steps: {after:.3f}", flush=True)
    rows = [json.loads(line) for line in open(metrics_path)]
    plot_curves(rows, ["reward/mean", "eval/accuracy", "response/len_mean", "policy/entropy", "grad_norm",
                       "time/step"], os.path.join(args.out, "curves.png"),
                title="GRPO on SmolLM2-135M-Instruct, chat addition (CPU, Ray)")
    steps = [m["time/step"] for m in history[1:]]  # the first step includes warm-up
    write_summary(args.out, {
        "accuracy_before_rl": before, "accuracy_after_rl": after,
        "accuracy_gain_points": round(100 * (after - before), 2),
        "eval_accuracy_by_step": {m["step"]: m["eval/accuracy"] for m in history if "eval/accuracy" in m},
        "reward_mean_first5": mean_of(history[:5], "reward/mean"),
        "reward_mean_last5": mean_of(history[-5:], "reward/mean"),
        "rl_steps": args.rl_steps, "rollouts_per_step": args.prompts_per_step * args.group_size, "lr": args.lr,
        "temperature": args.temperature, "median_step_s": round(float(np.median(steps)), 2) if steps else None,
        **{f"median_{k.replace('/', '_')}_s": round(float(np.median([m[k] for m in history[1:]])), 2)
           for k in ("time/generate", "time/reward", "time/train", "time/sync") if len(history) > 1},
        "setup_s": round(setup_s, 1), "wall_s": round(time.time() - start, 1),
    })


if __name__ == "__main__":
    main()
