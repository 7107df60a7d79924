"""Start-up time of the default job: process start to the first RL step, stage by stage.

Run:  python benchmarks/bench_startup.py [--runs 3] [any override of the config]

Each run is a fresh process, ``python -m cluster rl examples/configs/default.yaml`` with no SFT
stage and no evaluation (``--sft.steps 0 --algorithm.steps 2 --eval.enabled False``), so that
everything before the first RL step is start-up. The job writes ``startup_s`` and the seconds
of each stage (``startup``) into its summary.json; this prints the median of each over the
runs. ``first_step`` (the first RL step itself) is shown but not counted in ``startup_s``.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common import ROOT, median, table

FAST_START = ["--sft.steps", "0", "--algorithm.steps", "2", "--eval.enabled", "False"]


def run_once(overrides: list) -> dict:
    """One job in a new process; its summary with the process's own wall time added."""
    out = tempfile.mkdtemp(prefix="bench-startup-")
    config = os.path.join(ROOT, "examples", "configs", "default.yaml")
    cmd = [sys.executable, "-m", "cluster", "rl", config, *FAST_START, "--logging.out", out, *overrides]
    t0 = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "TQDM_DISABLE": "1"})
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    summary["process_wall_s"] = time.time() - t0
    return summary


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="fresh-process runs; medians are reported")
    args, overrides = p.parse_known_args()
    runs = []
    for i in range(args.runs):
        runs.append(run_once(overrides))
        print(f"run {i + 1}: startup {runs[-1]['startup_s']:.2f} s  {runs[-1]['startup']}", flush=True)
    stages = list(dict.fromkeys(k for r in runs for k in r["startup"]))
    rows = [[k, f"{median([r['startup'][k] for r in runs if r['startup'].get(k) is not None]):.2f}"]
            for k in stages]
    rows.append(["startup_s (first_step not counted)", f"{median([r['startup_s'] for r in runs]):.2f}"])
    rows.append(["whole process (2 RL steps, save, exit)", f"{median([r['process_wall_s'] for r in runs]):.2f}"])
    print(table(rows, ["stage", f"median s of {args.runs}"]))


if __name__ == "__main__":
    main()
