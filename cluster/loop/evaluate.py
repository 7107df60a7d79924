"""Evaluation over any backend of ``cluster.loop.protocol``: k samples per item, scored, with
accuracy and pass@k, and every sample written out."""
from __future__ import annotations

from typing import Optional, Sequence

from cluster.loop.protocol import Backend
from cluster.loop.train import collect
from primitives.io.evaluation import eval_metrics, sample_records, write_jsonl_atomic
from primitives.types import GenerationConfig


def evaluate(backend: Backend, items: Sequence, gen: GenerationConfig, k: int, correct: float = 1.0,
             samples_path: Optional[str] = None, step: int = 0,
             component_names: Optional[Sequence[str]] = None, tools=None) -> dict:
    """``k`` completions of each item at ``gen`` (its ``n`` is replaced by ``k``), generated and
    scored on ``backend`` (its generators and reward workers): ``eval_metrics``
    (mean reward, accuracy = share with reward >= ``correct``, pass@1 and pass@k), of the task's
    reward without the job's shaping function. With
    ``samples_path``, every sample is also written there as one JSON line
    (``sample_records``), replacing the file atomically.
    k = 1 at temperature 0 is greedy accuracy; pass@k with k > 1 needs temperature > 0."""
    if not items:
        raise ValueError("evaluate: no evaluation items")
    if k < 1 or (k > 1 and gen.temperature <= 0):
        raise ValueError(f"evaluate: k={k} samples per item at temperature {gen.temperature}; k must be >= 1, "
                         "and pass@k with k > 1 needs temperature > 0 (greedy samples are all the same)")
    # whole: the samples are written out; with ``tools`` (a ToolConfig) each is a multi-turn conversation. The
    # task's reward, unshaped: a length penalty would count right answers wrong, and KL shaping has no reference
    rollouts, _ = collect(backend, items, gen._replace(n=k), with_ref=False, tools=tools, shaped=False)
    metrics = eval_metrics(rollouts, k, correct, component_names)
    if samples_path is not None:
        write_jsonl_atomic(samples_path, sample_records(rollouts, step, component_names))
    return metrics


def evaluate_accuracy(backend: Backend, items: Sequence, max_new_tokens: int, correct: float = 1.0,
                      max_batch_rows: int = 0) -> float:
    """Greedy completions of ``items``, scored: the share whose reward reaches ``correct``; an HF engine
    decodes ``max_batch_rows`` rows at a time at most (0: a call's rows at once)."""
    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, n=1, max_batch_rows=max_batch_rows)
    return evaluate(backend, items, gen, k=1, correct=correct)["eval/accuracy"]
