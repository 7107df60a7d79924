"""GRPO on the embedded SmolLM2-135M-Instruct (real BPE tokenizer, chat template), on Ray, CPU.

Run:  python benchmarks/bench_smollm2.py [any override of the config, e.g. --algorithm.steps 30]

Runs ``rayrl rl examples/configs/smollm2_arithmetic.yaml``: chat-formatted two-number addition
(operands 0-99, "Reply with the number only"), reward 1 when the last number of the reply is
the sum; one generator, one trainer (ZeRO-2), one reward worker, no KL (no reference), each
actor with the machine's two threads (the phases run one after another). Prints held-out
greedy accuracy by evaluation, and the median seconds per step and per phase; the job writes
metrics.jsonl, curves.png, samples/ and summary.json to its output directory.

Beside the step: its floor, measured in the same run (``step_floor``): the step's FLOPs over the
matmul rate measured here before and after the job (the faster of the two: this shared machine's
speed moved by a quarter within the hour, and the floor is what the machine can do), each prompt
counted once per group (the generators and the trainer both share it) and every completion token,
2 FLOPs per matmul parameter to generate (or the weights read once per decode step, if that takes
longer) and 6 to train; sync and rewards count 0. Generators computing in bf16 (``--model.dtype
bfloat16``; the trainer keeps float32) have their FLOPs priced at the bf16 rate, measured after the
job. ``benchmarks/gpu_step.py --model smollm2`` puts the phases beside a plain PyTorch loop.
"""
import json
import os
import sys
from typing import Optional

import numpy as np
from common import ROOT, table


def main():
    os.environ.setdefault("TQDM_DISABLE", "1")
    from cluster.jobs.cli import run as rayrl

    config = os.path.join(ROOT, "examples", "configs", "smollm2_arithmetic.yaml")
    before = rates()
    summary = rayrl(["rl", config, *sys.argv[1:]])
    after = rates()
    print(f"matmul GFLOPS before / after the job: {before[0] / 1e9:.0f} / {after[0] / 1e9:.0f}; "
          f"memory GB/s {before[1] / 1e9:.1f} / {after[1] / 1e9:.1f}")
    rows = [json.loads(line) for line in open(os.path.join(summary["out"], "metrics.jsonl"))]
    steps = [r for r in rows if "time/step" in r][1:]  # the first step includes warm-up
    print("held-out greedy accuracy by step:",
          {r["step"] + 1: round(r["eval/accuracy"], 3) for r in rows if "eval/accuracy" in r})
    phases = ["time/generate", "time/reward", "time/train", "time/sync", "time/step"]
    print(table([[k, f"{np.median([r[k] for r in steps]):.2f}"] for k in phases], ["phase", "median s"]))
    best = max(before[0], after[0]), max(before[1], after[1])  # the faster: what the machine can do
    config = os.path.join(summary["out"], "config.yaml")  # the job's, overrides included
    dtype = generation_dtype(config)
    generate_rate = best[0] if dtype == "float32" else rates(dtype)[0]
    if dtype != "float32":
        print(f"generation in {dtype}: matmul GFLOPS {generate_rate / 1e9:.0f} (after the job), the generation "
              f"floor's rate; the train phase's float32")
    floors = step_floors(steps, config, *best, generate_rate)
    ratio = np.median([r["time/step"] / f for r, f in zip(steps, floors)])
    print(f"step floor {np.median(floors):.2f} s; step / floor {ratio:.2f} (median of the steps)")
    print(f"accuracy {summary['accuracy_before_rl']:.3f} -> {summary['accuracy_after_rl']:.3f} "
          f"({summary['accuracy_gain_points']:+.1f} points); reward {summary['reward_mean_first5']} -> "
          f"{summary['reward_mean_last5']} (first and last 5 steps); wall {summary['wall_s']} s")


def step_floor(row: dict, prompt_tokens: float, group: int, n_matmul: int, flops: float, bandwidth: float,
               generate_flops: Optional[float] = None, generate_bytes: int = 4) -> float:
    """Seconds one step needs at least (module docstring), from its logged rows and mean completion
    length and longest completion (decode steps). Generation in another dtype than the train phase's
    float32 (``model.dtype``) is priced at that dtype's rate, ``generate_flops``, its weights read at
    ``generate_bytes`` a parameter."""
    rollouts = row["batch/rows"]
    tokens = prompt_tokens * rollouts / group + row["response/len_mean"] * rollouts
    generate = max(2 * n_matmul * tokens / (generate_flops or flops),
                   row["response/len_max"] * n_matmul * generate_bytes / bandwidth)
    return generate + 6 * n_matmul * tokens / flops


def generation_dtype(config: str) -> str:
    """The dtype the job's generators compute in (``model.dtype`` of its resolved config)."""
    import yaml

    return (yaml.safe_load(open(config)).get("model") or {}).get("dtype", "float32")


def rates(dtype: str = "float32") -> tuple:
    """``(matmul FLOP/s, memory bytes/s)`` measured now, in ``dtype``, this process's threads."""
    import torch
    from gpu_step import machine_rates

    return machine_rates(torch.device("cpu"), getattr(torch, dtype))


def step_floors(steps: list, config: str, flops: float, bandwidth: float, generate_flops: float) -> list:
    """``step_floor`` of each logged step of the job whose resolved ``config`` (its output's
    config.yaml) is given, with the prompts' mean length under the chat template, the
    model's matmul parameters and the machine's rates given."""
    import torch
    import yaml
    from gpu_step import matmul_params
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primitives.fixtures.pretrained import save_smollm2
    from primitives.fixtures.tasks import TASKS
    from primitives.model.prompts import encode_prompts

    job = yaml.safe_load(open(config))
    path = save_smollm2(os.path.join(os.path.expanduser("~/.cache/rayrl"), "smollm2-135m-instruct"))
    items = TASKS[job["data"]["task"]](**(job["data"].get("task_kwargs") or {})).train[:256]
    prompt_tokens = float(np.mean([len(ids) for ids in encode_prompts(AutoTokenizer.from_pretrained(path),
                                                                      [it.prompt for it in items])]))
    n_matmul = matmul_params(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    group = job["generation"]["group_size"]
    width = getattr(torch, generation_dtype(config)).itemsize
    return [step_floor(r, prompt_tokens, group, n_matmul, flops, bandwidth, generate_flops, width) for r in steps]


if __name__ == "__main__":
    main()
