"""GRPO on the embedded SmolLM2-135M-Instruct (real BPE tokenizer, chat template), on Ray, CPU.

Run:  python benchmarks/bench_smollm2.py [any override of the config, e.g. --algorithm.steps 30]

Runs ``rayrl rl examples/configs/smollm2_arithmetic.yaml``: chat-formatted two-number addition
(operands 0-99, "Reply with the number only"), reward 1 when the last number of the reply is
the sum; one generator, one trainer (ZeRO-2), one reward worker, no KL (no reference), each
actor with the machine's two threads (the phases run one after another). Prints held-out
greedy accuracy by evaluation, and the median seconds per step and per phase; the job writes
metrics.jsonl, curves.png, samples/ and summary.json to its output directory.
"""
import json
import os
import sys

import numpy as np
from common import ROOT, table


def main():
    os.environ.setdefault("TQDM_DISABLE", "1")
    from cluster.jobs.cli import run as rayrl

    config = os.path.join(ROOT, "examples", "configs", "smollm2_arithmetic.yaml")
    summary = rayrl(["rl", config, *sys.argv[1:]])
    rows = [json.loads(line) for line in open(os.path.join(summary["out"], "metrics.jsonl"))]
    steps = [r for r in rows if "time/step" in r][1:]  # the first step includes warm-up
    print("held-out greedy accuracy by step:",
          {r["step"] + 1: round(r["eval/accuracy"], 3) for r in rows if "eval/accuracy" in r})
    phases = ["time/generate", "time/reward", "time/train", "time/sync", "time/step"]
    print(table([[k, f"{np.median([r[k] for r in steps]):.2f}"] for k in phases], ["phase", "median s"]))
    print(f"accuracy {summary['accuracy_before_rl']:.3f} -> {summary['accuracy_after_rl']:.3f} "
          f"({summary['accuracy_gain_points']:+.1f} points); reward {summary['reward_mean_first5']} -> "
          f"{summary['reward_mean_last5']} (first and last 5 steps); wall {summary['wall_s']} s")


if __name__ == "__main__":
    main()
