"""Shared helpers of the benchmark scripts: medians and a local Ray on loopback."""
from __future__ import annotations

import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def start_local_ray(num_cpus: int = 8):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback; read at import
    import ray

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "TQDM_DISABLE": "1"}})
    return ray


def model_path(name: str) -> str:
    """A local HF directory of an embedded model, as a job resolves it: ``tiny`` (the random tiny
    Qwen2, built into a temporary directory) or ``smollm2`` (converted once into the model cache)."""
    import tempfile

    from cluster.jobs.inputs import resolve_model
    from primitives.types import ModelConfig

    return resolve_model(ModelConfig(name), tempfile.mkdtemp(prefix="bench-"), seed=0).model_name_or_path


def median(xs) -> float:
    return float(statistics.median(xs))


def table(rows, header) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def bench_parser(doc: str, repeats: int = 5):
    """An argument parser with the flags every throughput benchmark shares."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=repeats, help="timed runs; the median is reported")
    p.add_argument("--gpus", type=float, default=0.0, help="GPUs per actor (0: CPU)")
    return p


def publish(text: str, path=None) -> None:
    """Print a benchmark's markdown and, given ``path``, append it there (``--write``)."""
    print(text)
    if path:
        with open(path, "a") as f:
            f.write("\n" + text)
