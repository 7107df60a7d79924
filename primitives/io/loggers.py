"""Loggers: ``logger(metrics: dict) -> None`` over one flat dict with namespaced keys.

Compose with ``multi_logger``; ``noop_logger`` keeps the loop free of ``if wandb:``.
``plot_curves`` writes training curves to a PNG.
"""
from __future__ import annotations

import json
import math
import os
from typing import Callable, Literal, Optional, Sequence


def noop_logger(metrics: dict) -> None:
    return None


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def console_logger(keys: Optional[Sequence[str]] = None, every: int = 1,
                   write: Optional[Callable] = None) -> Callable:
    """Print ``step k=v ...`` every ``every`` calls (through tqdm.write so bars stay intact)."""
    if write is None:
        from tqdm import tqdm
        write = tqdm.write

    def logger(metrics: dict) -> None:
        step = metrics.get("step", 0)
        if every > 1 and step % every:
            return
        shown = {k: metrics[k] for k in (keys or metrics) if k in metrics and k != "step"}
        write(f"step {step} " + " ".join(f"{k}={_fmt(v)}" for k, v in shown.items()))

    return logger


def jsonl_logger(path: str) -> Callable:
    """Append each metrics dict as one JSON line (the file is opened per call: no open handle)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def logger(metrics: dict) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics, default=float) + "\n")

    return logger


def wandb_logger(project: str, run_name: Optional[str] = None, config: Optional[dict] = None,
                 directory: Optional[str] = None) -> Callable:
    """Weights & Biases; offline mode when no ``WANDB_API_KEY`` is set (sync later with ``wandb sync``)."""
    import wandb

    mode: Literal["online", "offline"] = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    run = wandb.init(project=project, name=run_name, config=config or {}, dir=directory, mode=mode,
                     reinit="finish_previous")

    def logger(metrics: dict) -> None:
        run.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics.get("step"))

    logger.finish = run.finish  # type: ignore[attr-defined]  # the caller ends the run
    return logger


def multi_logger(*loggers: Callable) -> Callable:
    def logger(metrics: dict) -> None:
        for lg in loggers:
            lg(metrics)

    return logger


def read_jsonl_metrics(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


PANEL = (4.2, 3.0)  # inches per panel of plot_curves
TITLE_IN = 0.35  # inches above the panels for the figure's title
# each panel's margins in inches, room for what is drawn there: the y tick labels and their scale (offset text),
# the panel's title, the x tick labels and the x label (tests/primitives/test_checkpoint_logging.py draws the
# widest matplotlib writes and finds no two panels' drawings overlapping)
MARGINS = {"left": 0.75, "right": 0.2, "top": 0.35, "bottom": 0.5}


def curves_figure(history: Sequence[dict], keys: Sequence[str], title: str = "training curves",
                  x_key: str = "step"):
    """``plot_curves``'s figure, not yet drawn: one panel per key of ``keys`` found in ``history``, three
    to a row, each ``PANEL`` inches with ``MARGINS`` around it. The layout is fixed, not measured:
    ``tight_layout`` draws the figure once more to measure it, 0.45 of the 1.4 s a nine-panel plot took
    (the test run writes about 50). A ``matplotlib.figure.Figure`` without pyplot, which keeps every
    figure it opens in a global registry."""
    from matplotlib.figure import Figure

    wanted, keys = list(keys), [k for k in keys if any(k in row for row in history)]
    if not keys:
        raise ValueError(f"plot_curves: none of the keys {wanted} appear in the history")
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    width, height = PANEL[0] * cols, PANEL[1] * rows + TITLE_IN
    inner_w = PANEL[0] - MARGINS["left"] - MARGINS["right"]
    inner_h = PANEL[1] - MARGINS["top"] - MARGINS["bottom"]
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(left=MARGINS["left"] / width, right=1 - MARGINS["right"] / width,
                        bottom=MARGINS["bottom"] / height, top=1 - (TITLE_IN + MARGINS["top"]) / height,
                        wspace=(MARGINS["left"] + MARGINS["right"]) / inner_w,
                        hspace=(MARGINS["top"] + MARGINS["bottom"]) / inner_h)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, key in zip(axes.flat, keys):
        pts = [(row.get(x_key, i), row[key]) for i, row in enumerate(history) if key in row]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 40 else None)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel(x_key)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    # 12 points (matplotlib's) unless the title is too long for the figure: a character is about 0.6 of the size
    fig.suptitle(title, y=1 - 0.08 / height, va="top", fontsize=min(12.0, 0.95 * width * 72 / (0.6 * len(title) + 1)))
    return fig


def plot_curves(history: Sequence[dict], keys: Sequence[str], path: str, title: str = "training curves",
                x_key: str = "step") -> str:
    """One panel per key (metrics missing from a row are skipped), as a PNG at ``path``; returns ``path``."""
    fig = curves_figure(history, keys, title, x_key)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def run_logger(out_dir: str, console_keys: Sequence[str], every: int = 10):
    """``(logger, metrics_path)``: a fresh ``out_dir/metrics.jsonl`` plus a console line every
    ``every`` steps showing ``console_keys`` - what an example script logs to."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(path):
        os.remove(path)
    return multi_logger(jsonl_logger(path), console_logger(console_keys, every=every)), path


def update_ema_metrics(current: dict, ema: dict, momentum: float = 0.9) -> dict:
    """A new dict of smoothed metrics (the seeds' ``update_ema_metrics``): ``momentum * ema[k] +
    (1 - momentum) * current[k]`` for a key both have, ``current[k]`` for a key seen first now
    (no bias toward a zero start); keys only in ``ema`` are kept as they were. A value that is not
    a number (an algorithm's name) is taken as it is; a NaN or infinity leaves the average alone."""
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"update_ema_metrics: momentum must be in [0, 1), got {momentum}")

    def finite(x) -> Optional[float]:
        """A finite number's value (Python, numpy or a 0-d tensor), else None."""
        if isinstance(x, (bool, str, bytes)) or getattr(x, "ndim", 0) != 0:
            return None
        try:
            value = float(x)
        except (TypeError, ValueError):
            return None
        return value if math.isfinite(value) else None

    out = dict(ema)
    for key, value in current.items():
        now = finite(value)
        if now is not None:
            old = finite(ema.get(key))
            out[key] = now if old is None else momentum * old + (1.0 - momentum) * now
        elif key not in ema or isinstance(value, (bool, str, bytes)) or getattr(value, "ndim", 0) != 0:
            out[key] = value  # a name, or a NaN with nothing to keep
    return out


def mean_of(rows: Sequence[dict], key: str) -> Optional[float]:
    """Mean of ``key`` over the rows that have it (None if none do), rounded for summaries."""
    values = [r[key] for r in rows if key in r]
    return round(sum(values) / len(values), 4) if values else None


def write_summary(out_dir: str, summary: dict) -> dict:
    """Write ``out_dir/summary.json`` and print it."""
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))
    return summary
