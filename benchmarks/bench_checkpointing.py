"""Gradient checkpointing (``cluster.gradient_checkpointing``) against keeping the activations: a GRPO
update's peak memory and time on the same rows, each setting in a process of its own.

Run:  python benchmarks/bench_checkpointing.py [--model smollm2|tiny --rows 8 --tokens 256 --repeats 2]

Each round starts one process per setting, the order flipped every round. The process loads the model
(fp32, ``--threads`` threads), makes ``--rows`` rollouts of ``--tokens``-token random completions of
two prompts (groups of ``rows / 2``, rewards 0 and 1 so every row has an advantage), and makes
``--steps`` updates (``primitives.model.training.forward_backward``, packed, in micro-batches of
``--micro-batch`` rows, then AdamW). It reports the median update's seconds and its peak resident
memory above what the process held before the first update (``ru_maxrss``, the high-water mark: the
activations the backward keeps, plus the gradients and Adam's state). Printed: each setting's medians
over the rounds, checkpointed / kept, and whether the two gave the same loss and gradient norm.
"""
import argparse
import json
import os
import subprocess
import sys

from common import ROOT, bench_parser, median, model_path, table


def main():
    p = bench_parser(__doc__, repeats=2)
    p.add_argument("--model", default="smollm2", help="tiny, smollm2 or a local HF directory")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256, help="completion tokens of each row")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="updates per process; the first is timed too")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args, args.child == "on")))
        return
    path = args.model if os.path.isdir(args.model) else model_path(args.model)
    runs = {"kept": [], "checkpointed": []}
    for r in range(args.repeats):
        for name in (("kept", "checkpointed") if r % 2 == 0 else ("checkpointed", "kept")):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "on" if name == "checkpointed" else "off",
                   "--model", path, "--rows", str(args.rows), "--tokens", str(args.tokens), "--micro-batch",
                   str(args.micro_batch), "--steps", str(args.steps), "--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r + 1}, {name}: {runs[name][-1]}", flush=True)
    step = {name: median([x["step_s"] for x in rs]) for name, rs in runs.items()}
    peak = {name: median([x["peak_mb"] for x in rs]) for name, rs in runs.items()}
    print(table([[name, f"{step[name]:.2f}", f"{peak[name]:.0f}"] for name in runs],
                ["activations", "update s (median)", "peak MB above the loaded model (median)"]))
    kept, ck = runs["kept"][0], runs["checkpointed"][0]
    memory = f"{peak['checkpointed'] / peak['kept']:.2f}" if peak["kept"] > 0 else "n/a (no growth kept)"
    print(f"checkpointed / kept: time {step['checkpointed'] / step['kept']:.2f}, peak memory "
          f"{memory}; {args.rows} rows x {args.tokens} tokens in micro-batches "
          f"of {args.micro_batch}; first update's loss {kept['loss']:.6g} / {ck['loss']:.6g}, gradient norm "
          f"{kept['grad_norm']:.6g} / {ck['grad_norm']:.6g}")


def child(args, checkpointing: bool) -> dict:
    """One setting's updates in this process (module docstring)."""
    import resource
    import time

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from primitives.maths.algorithms import grpo
    from primitives.maths.batching import make_batch
    from primitives.model.training import enable_gradient_checkpointing, forward_backward, optim_step, step_counts
    from primitives.types import Rollout
    from rl_actors.common import setup_process
    from rl_actors.deepspeed_rank import TrainerConfig, adamw

    setup_process(num_threads=args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if checkpointing:
        enable_gradient_checkpointing(model, "benchmark")
    optimizer = adamw(model.parameters(), TrainerConfig(lr=1e-6))
    rng = np.random.default_rng(0)
    vocab, group = model.config.vocab_size, max(1, args.rows // 2)
    rollouts = [Rollout(uid=f"e0/i{i // group}/s{i % group}", group=f"e0/i{i // group}", prompt="p",
                        prompt_ids=rng.integers(0, vocab, 24), completion_ids=rng.integers(0, vocab, args.tokens),
                        loss_mask=np.ones(args.tokens, np.float32), logprobs=np.full(args.tokens, -5.0, np.float32),
                        reward=float(i % 2)) for i in range(args.rows)]
    algo = grpo(kl_coef=0.0)
    batch = make_batch(rollouts, algo, 0, budget=args.tokens)
    batch = batch._replace(old_logprobs=batch.behaviour_logprobs)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, first = [], None
    for _ in range(args.steps):
        start = time.perf_counter()
        metrics = forward_backward(model, batch, algo, step_counts(batch), micro_batch_size=args.micro_batch)
        norm = optim_step(model, optimizer, max_grad_norm=1.0)
        times.append(time.perf_counter() - start)
        first = first or {"loss": metrics["loss/policy"], "grad_norm": float(norm)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"step_s": round(float(np.median(times)), 3), "peak_mb": round((peak - base) / 1024, 1), **first}


if __name__ == "__main__":
    main()
