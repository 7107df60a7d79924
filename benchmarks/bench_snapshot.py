"""What the in-memory snapshots that trainer recovery restores from cost (issue 22).

Run:  python benchmarks/bench_snapshot.py [--config examples/configs/default.yaml] [--variants 0,1,None]
                                          [--steps N] [--write docs/benchmarks.md] [-- extra job overrides]

Runs the same job once per ``cluster.snapshot_every`` variant, one after the other (0: none, the
baseline; 1: after every step; None: by cost, at most ``cluster.snapshot_overhead`` of the run's
time), and prints, per variant, the mean RL step (snapshots included) and the median train and
sync phases, the snapshots taken, their median seconds and size
(what the object store holds: one snapshot, two while the next is taken), and the step's
overhead against the baseline. The same seed gives the same run in every variant: the
held-out accuracy after RL is printed as a check.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import ROOT, publish


def run_variant(config: str, every: str, steps: int, extra: list, out: str) -> dict:
    cmd = [sys.executable, "-m", "cluster", "rl", config, "--logging.out", out, "--cluster.snapshot-every", every,
           "--checkpoint.minutes", "0", *(["--algorithm.steps", str(steps)] if steps else []), *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps_rows = [r for r in rows if "algorithm" in r][2:]  # the first steps warm up
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    faults = summary["faults"]

    def median(key):
        xs = [r[key] for r in steps_rows if key in r]
        return statistics.median(xs) if xs else None

    # the mean step: a snapshot every few steps is in it, not in the median
    return {"snapshot_every": every, "step_s": statistics.mean(r["time/step"] for r in steps_rows),
            "train_s": median("time/train"),
            "sync_s": median("time/sync"), "snapshots": faults["snapshots"], "snapshot_s": faults["snapshot_s_median"],
            "snapshot_mb": faults["snapshot_mb"], "accuracy_after": summary.get("accuracy_after_rl"),
            "wall_s": round(time.time() - t0, 1)}


def table(rows: list, base: dict) -> str:
    lines = ["| snapshot_every | mean step s | median train s | median sync s | snapshots | median snapshot s | "
             "snapshot MB | step overhead | held-out after |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        over = (r["step_s"] / base["step_s"] - 1) * 100 if base and base["step_s"] else float("nan")
        lines.append(f"| {r['snapshot_every']} | {r['step_s']:.4f} | {r['train_s']:.4f} | {r['sync_s']:.4f} | "
                     f"{r['snapshots']} | {r['snapshot_s'] if r['snapshot_s'] is not None else '-'} | "
                     f"{r['snapshot_mb'] if r['snapshot_mb'] is not None else '-'} | {over:+.1f} % | "
                     f"{r['accuracy_after']} |")
    return "\n".join(lines)


def main(argv=None) -> list:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join("examples", "configs", "default.yaml"))
    p.add_argument("--variants", default="0,1,None", help="cluster.snapshot_every values, the first the baseline")
    p.add_argument("--steps", type=int, default=0, help="RL steps (0: the config's)")
    p.add_argument("--write", default=None, help="append the dated table to this markdown file")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_snapshot_") as scratch:
        for every in args.variants.split(","):
            rows.append(run_variant(args.config, every, args.steps, extra, os.path.join(scratch, f"every_{every}")))
            print(json.dumps(rows[-1]), flush=True)
    text = (f"### Snapshot cost ({datetime.date.today().isoformat()}, {os.cpu_count()} cores): "
            f"`{args.config}` {' '.join(extra)}\n\n" + table(rows, rows[0]) + "\n")
    publish(text, args.write)
    return rows


if __name__ == "__main__":
    main()
