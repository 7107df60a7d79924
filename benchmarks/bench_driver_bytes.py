"""Bytes that pass through the driver per RL step of a job on Ray.

Run:  python benchmarks/bench_driver_bytes.py [--checkout DIR] [--algorithm.steps 6] [any override]

Runs the default job (examples/configs/default.yaml; no SFT stage, no evaluation, so the RL
steps alone are counted) with three counters in the driver process:

* ``get``  - results the driver fetched (``ray.get``), as their pickled size;
* ``put``  - objects the driver put into the object store (``ray.put``);
* ``args`` - arguments the driver passed by value to actor methods (an ``ObjectRef`` counts 0).

Each step's bytes are the counters' growth between two calls of the job's logger (one per
step); the table shows the median over the steps, and the step's rows and completion tokens
for scale. ``--checkout DIR`` runs another checkout's code (an older commit in a
``git worktree``), so before and after are measured by the same script.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile


def sized(obj) -> int:
    """Pickled bytes of ``obj``, an ObjectRef inside it counted as nothing (a ref is ~100 bytes)."""
    import ray

    class Refless(pickle.Pickler):
        def persistent_id(self, o):
            return 0 if isinstance(o, ray.ObjectRef) else None

    import io

    buf = io.BytesIO()
    try:
        Refless(buf, protocol=5).dump(obj)
    except Exception:  # something plain pickle cannot take (a function): cloudpickle's size
        import cloudpickle

        return len(cloudpickle.dumps(obj))
    return buf.tell()


def instrument(counts: dict) -> None:
    """Count what the driver gets, puts and passes by value from now on."""
    import ray
    from ray.actor import ActorMethod

    get, put, remote = ray.get, ray.put, ActorMethod.remote

    def counted_get(refs, *args, **kwargs):
        out = get(refs, *args, **kwargs)
        counts["get"] += sized(out)
        return out

    def counted_put(value, *args, **kwargs):
        counts["put"] += sized(value)
        return put(value, *args, **kwargs)

    def counted_remote(self, *args, **kwargs):
        counts["args"] += sized((args, kwargs))
        return remote(self, *args, **kwargs)

    ray.get, ray.put, ActorMethod.remote = counted_get, counted_put, counted_remote


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   help="the checkout whose code runs (default: this one)")
    p.add_argument("--json", help="also write the per-step figures here")
    known, overrides = p.parse_known_args()
    checkout = os.path.abspath(known.checkout)
    sys.path.insert(0, checkout)
    os.chdir(checkout)
    os.environ.setdefault("TQDM_DISABLE", "1")
    import cluster

    if not os.path.realpath(cluster.__file__).startswith(os.path.realpath(checkout)):
        raise SystemExit(f"cluster imported from {cluster.__file__}, not from {checkout}")
    if os.path.isdir(os.path.join(checkout, "cluster", "jobs")):
        import primitives.io.loggers as loggers
        from cluster.jobs.cli import run as rayrl
    else:  # a checkout from before the rooms (the editable install would supply the new modules: not used)
        import primitives.loggers as loggers
        from cluster.cli import run as rayrl

    counts, steps = {"get": 0, "put": 0, "args": 0}, []
    instrument(counts)
    make = loggers.run_logger  # the job's logger: called once per step

    def hooked(*args, **kwargs):
        inner, path = make(*args, **kwargs)
        last = dict(counts)

        def log(metrics):
            if "batch/rows" in metrics:  # an RL step (not the evaluation before it, nor SFT)
                steps.append({**{k: counts[k] - last[k] for k in counts}, "rows": metrics["batch/rows"],
                              "tokens": metrics.get("batch/loss_tokens", 0.0)})
            last.update(counts)
            return inner(metrics)

        return log, path

    loggers.run_logger = hooked
    out = tempfile.mkdtemp(prefix="bench-bytes-")
    rayrl(["rl", os.path.join(checkout, "examples", "configs", "default.yaml"), "--logging.out", out,
           "--sft.steps", "0", "--eval.enabled", "False", "--eval.final-pass-k", "0", "--algorithm.steps", "6",
           *overrides])
    if not steps:
        raise SystemExit("no RL step was logged")
    steps = steps[1:] or steps  # the first step's counters include the start-up calls
    med = {k: statistics.median(s[k] for s in steps) for k in ("get", "put", "args", "rows", "tokens")}
    total = med["get"] + med["put"] + med["args"]
    print(f"checkout {checkout}: {len(steps)} steps, median per step")
    print("| get (driver pulls) | put (driver pushes) | args by value | total | rows | tokens | bytes/row |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {med['get']:,.0f} | {med['put']:,.0f} | {med['args']:,.0f} | {total:,.0f} | {med['rows']:.0f} | "
          f"{med['tokens']:.0f} | {total / max(med['rows'], 1):,.0f} |")
    if known.json:
        with open(known.json, "w") as f:
            json.dump({"checkout": checkout, "steps": steps, "median": med}, f, indent=1)


if __name__ == "__main__":
    main()
