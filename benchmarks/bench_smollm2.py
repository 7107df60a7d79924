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
    if dtype == "float32":
        products = shape_products(steps, config)
        step_s = np.median([r["time/step"] for r in steps])
        print(f"the floor's products timed at the step's own shapes (median step): generate {products[0]:.2f} s, "
              f"train {products[1]:.2f} s; together {sum(products):.2f} s = {sum(products) / np.median(floors):.2f}x "
              f"the floor; the step {step_s / sum(products):.2f}x them")
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
    from transformers import AutoModelForCausalLM

    from primitives.fixtures.pretrained import save_smollm2

    job = yaml.safe_load(open(config))
    path = save_smollm2(os.path.join(os.path.expanduser("~/.cache/rayrl"), "smollm2-135m-instruct"))
    prompt_tokens = prompt_length(job)
    n_matmul = matmul_params(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    group = job["generation"]["group_size"]
    width = getattr(torch, generation_dtype(config)).itemsize
    return [step_floor(r, prompt_tokens, group, n_matmul, flops, bandwidth, generate_flops, width) for r in steps]


def shape_products(steps: list, config: str, repeats: int = 3) -> tuple:
    """``(generate s, train s)``: the floor's products (``step_floor``, float32) of the median step, each timed
    at the shape the job runs it at, with its model's weights and this process's threads: the prompts'
    prefill as one product of (prompts' tokens) rows, a decode step of ``batch/rows`` rows on weights packed
    as the generator packs them (``primitives.model.packed_decode``) repeated ``response/len_mean`` times
    (each makes a token of every row), and the forward and both backward products of a trainer micro-batch
    (``cluster.micro_batch_size`` rows, their share of the prompts once and completions) for each
    micro-batch. A 1024 x 1024 product runs faster than these: what is left of the step once its own
    shapes are priced is the rest of its work (attention, norms, sampling, the optimizer, the sync, Python)."""
    import torch
    import yaml
    from gpu_step import matmul_shapes, median_time
    from transformers import AutoModelForCausalLM

    from primitives.fixtures.pretrained import save_smollm2

    job = yaml.safe_load(open(config))
    path = save_smollm2(os.path.join(os.path.expanduser("~/.cache/rayrl"), "smollm2-135m-instruct"))
    shapes = matmul_shapes(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    row = sorted(steps, key=lambda r: r["time/step"])[len(steps) // 2]
    rows, group = int(row["batch/rows"]), job["generation"]["group_size"]
    prompt_tokens = prompt_length(job) * rows / group
    micro = int(np.ceil(rows / job["cluster"]["micro_batch_size"]))
    train_rows = int(round((prompt_tokens + row["response/len_mean"] * rows) / micro))
    plan = product_plan(shapes, rows, int(round(prompt_tokens)), row["response/len_mean"], train_rows, micro)
    return tuple(sum(count * median_time(fn, repeats) for count, fn in parts) for parts in plan)


def product_plan(shapes: list, rows: int, prompt_tokens: int, decode_steps: float, train_rows: int,
                 micro_batches: int) -> tuple:
    """``(generate parts, train parts)``, each a list of ``(count, product)``: what ``shape_products`` times,
    per weight of ``shapes`` ((out, in) of every product of a token): the prefill once, the packed decode
    product ``decode_steps`` times, and the train micro-batch's three products ``micro_batches`` times."""
    import torch

    from primitives.model.packed_decode import pack, packed_product

    generate, train = [], []
    for out_f, in_f in shapes:
        weight = torch.randn(out_f, in_f) * in_f ** -0.5
        packed, step_in = pack(weight, rows), torch.randn(rows, in_f)
        prompt_in, x, dy = torch.randn(prompt_tokens, in_f), torch.randn(train_rows, in_f), torch.randn(train_rows,
                                                                                                          out_f)
        generate += [(1, lambda a=prompt_in, w=weight: torch.nn.functional.linear(a, w)),
                     (decode_steps, lambda a=step_in, p=packed: packed_product(a, p, None))]
        train += [(micro_batches, lambda x=x, w=weight: torch.nn.functional.linear(x, w)),  # forward
                  (micro_batches, lambda d=dy, w=weight: d @ w),  # the input's gradient
                  (micro_batches, lambda d=dy, x=x: d.t() @ x)]  # the weight's gradient
    return generate, train


def prompt_length(job: dict) -> float:
    """The mean length of the job's first 256 training prompts under the chat template."""
    from transformers import AutoTokenizer

    from primitives.fixtures.pretrained import save_smollm2
    from primitives.fixtures.tasks import TASKS
    from primitives.model.prompts import encode_prompts

    path = save_smollm2(os.path.join(os.path.expanduser("~/.cache/rayrl"), "smollm2-135m-instruct"))
    items = TASKS[job["data"]["task"]](**(job["data"].get("task_kwargs") or {})).train[:256]
    return float(np.mean([len(ids) for ids in encode_prompts(AutoTokenizer.from_pretrained(path),
                                                             [it.prompt for it in items])]))


if __name__ == "__main__":
    main()
