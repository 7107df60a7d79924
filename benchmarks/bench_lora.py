"""LoRA against full fine-tuning: the SmolLM2 arithmetic job both ways, side by side (issue 23).

Run:  python benchmarks/bench_lora.py [--algorithm.steps N] [--write docs/benchmarks.md] [any job override]

Runs ``examples/configs/smollm2_arithmetic.yaml`` (full fine-tuning) and then
``examples/configs/smollm2_lora.yaml`` (rank-16 adapters on every linear layer, the base frozen)
through ``rayrl rl``, one after the other, each on a fresh local Ray, with the same overrides
(``--algorithm.steps`` defaults to 20; every other flag not named here goes to both jobs). Prints a
markdown table of the two and LoRA/full: trained parameters, the trainer rank's peak resident
memory, the bytes and seconds of a weight sync, the median step and train phase, held-out greedy
accuracy before -> after RL, and wall seconds. Medians are over the RL steps after the first
(warm-up). ``--write FILE`` appends it, as a dated section, to FILE (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile

from common import ROOT, publish, table

CONFIGS = {"full": "smollm2_arithmetic.yaml", "LoRA": "smollm2_lora.yaml"}


def run_job(config: str, overrides: list, out: str) -> dict:
    """One RL job through ``rayrl rl``; its summary with the medians this benchmark reports."""
    import ray

    from cluster.jobs.cli import run as rayrl

    summary = rayrl(["rl", os.path.join(ROOT, "examples", "configs", config), *overrides, "--logging.out", out])
    ray.shutdown()  # the next job starts its own Ray, as this one did
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "time/step" in r][1:]  # the first step includes warm-up

    def median(key):
        xs = [r[key] for r in steps if key in r]
        return statistics.median(xs) if xs else float("nan")

    lr = next(r["lr"] for r in rows if "lr" in r)
    evals = {r["step"] + 1: round(r["eval/accuracy"], 3) for r in rows if "eval/accuracy" in r}
    return {**summary, "sync_bytes": median("sync/bytes"), "sync_s": median("time/sync"),
            "step_s": median("time/step"), "train_s": median("time/train"), "lr": lr, "evals": evals}


def comparison(full: dict, lora: dict) -> str:
    """The markdown table: one row per figure, full, LoRA and LoRA/full."""
    def share(s):
        return s["trained_params"] / (s["trained_params"] + s["frozen_params"])

    def ratio(a, b):
        return f"{b / a:.3g}" if a else "-"

    def accuracy(s):
        return f"{s['accuracy_before_rl']:.3f} -> {s['accuracy_after_rl']:.3f}"

    rows = [
        ["trained parameters", f"{full['trained_params']:,} ({share(full):.1%})",
         f"{lora['trained_params']:,} ({share(lora):.2%})", ratio(full["trained_params"], lora["trained_params"])],
        ["trainer peak RSS, MB", f"{full['trainer_peak_rss_mb']:.0f}", f"{lora['trainer_peak_rss_mb']:.0f}",
         ratio(full["trainer_peak_rss_mb"], lora["trainer_peak_rss_mb"])],
        ["sync bytes per step, MB", f"{full['sync_bytes'] / 1e6:.1f}", f"{lora['sync_bytes'] / 1e6:.2f}",
         ratio(full["sync_bytes"], lora["sync_bytes"])],
        ["median sync s", f"{full['sync_s']:.3f}", f"{lora['sync_s']:.3f}", ratio(full["sync_s"], lora["sync_s"])],
        ["median step s", f"{full['step_s']:.2f}", f"{lora['step_s']:.2f}", ratio(full["step_s"], lora["step_s"])],
        ["median train s", f"{full['train_s']:.2f}", f"{lora['train_s']:.2f}", ratio(full["train_s"], lora["train_s"])],
        ["held-out accuracy before -> after", accuracy(full), accuracy(lora), "-"],
        ["gain, points", f"{full['accuracy_gain_points']:+.1f}", f"{lora['accuracy_gain_points']:+.1f}", "-"],
        ["wall s", f"{full['wall_s']:.0f}", f"{lora['wall_s']:.0f}", ratio(full["wall_s"], lora["wall_s"])],
    ]
    return table(rows, ["", "full", "LoRA", "LoRA/full"])


def section(full: dict, lora: dict, steps: int, overrides: list) -> str:
    """The dated docs/benchmarks.md section: how the figures were made, the table, what they mean."""
    flags = " ".join(["--algorithm.steps", str(steps), *overrides])
    return f"""## {datetime.date.today().isoformat()}, CPU: LoRA against full fine-tuning (issue 23)

`python benchmarks/bench_lora.py {flags}` on the development machine ({os.cpu_count()} cores, no GPU):
the SmolLM2-135M-Instruct chat arithmetic job twice, one job after the other, the same seed and
the same overrides. Full: `examples/configs/smollm2_arithmetic.yaml`, every weight trains at lr
{full['lr']:g}. LoRA: `examples/configs/smollm2_lora.yaml`, rank-16 adapters (alpha 32) on every
linear layer but the output head, the base frozen, lr {lora['lr']:g}. One generator, one trainer
rank (ZeRO-2), no reference. Medians over the RL steps after the first (warm-up).

{comparison(full, lora)}

Held-out greedy accuracy by step: full {full['evals']}, LoRA {lora['evals']}.

What the figures mean. Trained parameters are the adapters' share of all the parameters on the
rank. The peak memory is the trainer process's peak resident set on CPU, libraries (torch,
DeepSpeed, Ray) included, so it shows what LoRA saves (the full model's gradients and Adam
moments) against a fixed floor, not the model's memory alone. A sync sends the trained
parameters alone: with LoRA only the adapters travel to the generator. The held-out set has 64
problems, so one standard error of an accuracy near 0.5 is about 0.06: a gap under about 12
points between the two gains is not evidence that one learns better. The machine's two cores
are shared with other work, so the seconds are noisy; the ratios of the same run are the
figures to read.
"""


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--algorithm.steps", dest="steps", type=int, default=20, help="RL steps of both jobs")
    p.add_argument("--write", default=None, help="append the dated section to this markdown file")
    p.add_argument("--out", default=None, help="where the jobs write (default: a temporary directory, removed)")
    args, overrides = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    job_flags = ["--algorithm.steps", str(args.steps), *overrides]
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as scratch:
        out = args.out or scratch
        results = {name: run_job(config, job_flags, os.path.join(out, name)) for name, config in CONFIGS.items()}
    for name, r in results.items():
        print(f"{name}: held-out accuracy by step {r['evals']}", flush=True)
    full, lora = results["full"], results["LoRA"]
    publish(section(full, lora, args.steps, overrides), args.write)
    return results


if __name__ == "__main__":
    main()
