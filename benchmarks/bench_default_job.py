"""Per-phase step times of the default job (rayrl rl examples/configs/default.yaml, on Ray).

Run:  python benchmarks/bench_default_job.py [--algorithm.steps 80] [any override of the config]
Prints the median and p90 of each phase over the RL steps, and the job's accuracy figures.
"""
import json
import os
import sys
import tempfile

import numpy as np
from common import ROOT, table


def main():
    os.environ.setdefault("TQDM_DISABLE", "1")
    from cluster.jobs.cli import run as rayrl

    out = tempfile.mkdtemp(prefix="bench-default-")
    config = os.path.join(ROOT, "examples", "configs", "default.yaml")
    summary = rayrl(["rl", config, "--logging.out", out, *sys.argv[1:]])
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"phase": "sft"' not in line]
    rows = [r for r in rows if "time/step" in r][1:]  # the first step includes warm-up
    phases = ["time/generate", "time/reward", "time/ref", "time/train", "time/sync", "time/step"]
    step = np.median([r["time/step"] for r in rows])
    out_rows = [[k, f"{np.median([r[k] for r in rows]) * 1000:.1f}",
                 f"{np.percentile([r[k] for r in rows], 90) * 1000:.1f}",
                 f"{100 * np.median([r[k] for r in rows]) / step:.0f}%"] for k in phases]
    print(table(out_rows, ["phase", "median ms", "p90 ms", "share of step"]))
    print(f"steps measured: {len(rows)}; accuracy {summary['accuracy_before_rl']:.3f} -> "
          f"{summary['accuracy_after_rl']:.3f}; wall {summary['wall_s']} s")


if __name__ == "__main__":
    main()
