"""The seeds' plan (seeds/004): write your own loop, keep the trainers. A training backend whose
``forward_backward(batch)`` and ``optim_step()`` return futures, the same calls in one process
(``PyTorchTrainingBackend``) and on the Ray trainer group the jobs use (``RayTrainingBackend``:
every DeepSpeed ZeRO rank takes its rows); the plan's records (``Sample``, ``TrainingConfig``),
``collate_batch`` and ``run_sft_training``, its loop as printed.

* ``forward_backward(batch)``: ``batch`` is ``{"input_ids" (B, L), "labels", "loss_mask",
  "attention_mask", and any array with one entry per row, e.g. "advantages" (B,)}``; the
  backend's ``loss_fn(logits, labels, loss_mask, **others) -> mean over the rows`` sees logits
  aligned with their targets (position t predicts token t + 1:
  ``primitives.model.training.loss_fn_forward_backward``). Gradients accumulate until
  ``optim_step()``: two calls add two means, as two ``loss.backward()`` do.
* ``optim_step(lr=None)``: clip (the backend's ``max_grad_norm``), step, zero; ``grad_norm``
  (before clipping) and ``lr``. The gradient norm exists only after the gradients are reduced
  over ranks, so ``forward_backward``'s metrics refuse ``["grad_norm"]`` by naming where it is.
* A future's ``.result()`` blocks and returns the metrics; the future and the metrics are both
  awaitable (``await backend.forward_backward(b).result()`` as the plan prints it, under
  asyncio or trio). On Ray the call is under way when the future returns: the driver's own work
  (the next batch's collation) overlaps it. Calls reach the ranks in the order made.

A rank that dies mid-update is not recovered here (the accumulated gradients die with it): the
error names the rank. The jobs' loop (``cluster.loop.train``) recovers.
"""
from __future__ import annotations

import abc
import os
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from primitives.hooks import fn_name
from primitives.model.training import loss_fn_forward_backward, optim_step

LATER = ("grad_norm", "lr")  # known after optim_step, not after forward_backward


class Metrics(dict):
    """A step's metrics; ``await`` gives the metrics themselves (the plan awaits ``.result()``)."""

    def __await__(self):
        return self
        yield  # a generator that returns at once: awaitable under any event loop

    def __missing__(self, key):
        if key in LATER and "loss" in self:
            raise KeyError(f"{key!r} is known after the gradients are reduced and clipped: read it from "
                           f"backend.optim_step().result()[{key!r}] (forward_backward gives 'loss' and 'rows')")
        raise KeyError(key)


class Ready(str):
    """A path, awaitable (the plan awaits ``backend.save_checkpoint(...)``)."""

    def __await__(self):
        return str(self)
        yield


class TrainFuture:
    """The result of a backend call: ``result()`` (blocks; the metrics), ``done()``, ``await``."""

    def __init__(self, resolve: Callable[[], dict], is_done: Callable[[], bool] = lambda: True):
        self._resolve, self._is_done = resolve, is_done
        self._value: Optional[Metrics] = None
        self._error: Optional[BaseException] = None

    @property
    def settled(self) -> bool:
        """Whether ``result()`` has answered or raised already."""
        return self._value is not None or self._error is not None

    def done(self) -> bool:
        return self.settled or self._is_done()

    def result(self) -> Metrics:
        if self._error is not None:
            raise self._error
        value = self._value
        if value is None:
            try:
                value = self._value = Metrics(self._resolve())
            except BaseException as e:
                self._error = e
                raise
        return value

    def __await__(self):
        return self.result()
        yield


def as_arrays(batch) -> dict:
    """``batch`` as numpy arrays, checked: named errors before any work."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError(f"forward_backward(batch): batch must be a dict with 'input_ids' (B, L) and optionally "
                         f"'labels', 'loss_mask', 'attention_mask' and per-row arrays such as 'advantages'; got "
                         f"{type(batch).__name__}{sorted(batch) if isinstance(batch, dict) else ''}")
    out = {k: (v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)) for k, v in batch.items()}
    ids = out["input_ids"]
    if ids.ndim != 2 or ids.shape[0] == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"forward_backward(batch): input_ids must be a non-empty (B, L) integer array, got "
                         f"{ids.dtype}{ids.shape}")
    for k, v in out.items():
        full = k in ("labels", "loss_mask", "attention_mask")
        if (full and v.shape != ids.shape) or (not full and (v.ndim == 0 or v.shape[0] != ids.shape[0])):
            raise ValueError(f"forward_backward(batch): {k} has shape {v.shape}; expected "
                             + (f"{ids.shape}, as input_ids" if full else f"one entry per row ({ids.shape[0]}, ...)"))
    return out


def check_loss_fn(loss_fn: Callable, extra: Sequence[str] = ()) -> None:
    """``loss_fn`` takes ``(logits, labels, loss_mask)`` and the batch's other arrays by name."""
    import inspect

    if not callable(loss_fn):
        raise ValueError(f"loss_fn: {loss_fn!r} is not callable")
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None, None, None, **dict.fromkeys(extra))
    except TypeError as e:
        raise ValueError(f"loss_fn: {fn_name(loss_fn)}{sig} cannot take (logits, labels, loss_mask"
                         + "".join(f", {k}=" for k in extra) + f") ({e}): the batch's arrays other than input_ids, "
                         "labels, loss_mask and attention_mask reach it by name") from None


class PlanBackend(abc.ABC):
    """What both backends share: the futures, the order of calls and their checks."""

    loss_fn: Callable

    def __init__(self):
        self._open = False

    @abc.abstractmethod
    def _accumulate(self, arrays: dict) -> TrainFuture:
        """Start this batch's forward and backward passes."""

    @abc.abstractmethod
    def _step(self, lr: Optional[float]) -> TrainFuture:
        """Start the optimizer step."""

    @abc.abstractmethod
    def save_checkpoint(self, step: int, metrics: Optional[dict] = None) -> Ready:
        """Write ``checkpoint_dir/step_<step>``; its path."""

    def forward_backward(self, batch) -> TrainFuture:
        arrays = as_arrays(batch)
        check_loss_fn(self.loss_fn, [k for k in arrays if k not in ("input_ids", "labels", "loss_mask",
                                                                    "attention_mask")])
        future = self._accumulate(arrays)
        self._open = True
        return future

    def optim_step(self, lr: Optional[float] = None) -> TrainFuture:
        if not self._open:
            raise RuntimeError("optim_step() with no forward_backward(batch) since the last step: nothing to apply")
        self._open = False
        return self._step(lr)


class PyTorchTrainingBackend(PlanBackend):
    """The plan's backend in this process: ``model`` trained in place by ``optimizer`` (``loss_fn``
    as above; gradients clipped to ``max_grad_norm``; ``micro_batch_size`` rows per forward, all
    by default). ``save_checkpoint(step)`` writes ``checkpoint_dir/step_<step>`` (model, tokenizer
    when given, optimizer)."""

    def __init__(self, model, optimizer, loss_fn: Callable, checkpoint_dir: Optional[str] = None,
                 max_grad_norm: Optional[float] = 1.0, micro_batch_size: Optional[int] = None, tokenizer=None):
        super().__init__()
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.checkpoint_dir, self.max_grad_norm, self.micro_batch_size = checkpoint_dir, max_grad_norm, micro_batch_size
        self.tokenizer = tokenizer

    def _accumulate(self, arrays: dict) -> TrainFuture:
        try:
            metrics = loss_fn_forward_backward(self.model, arrays, self.loss_fn, len(arrays["input_ids"]),
                                               self.micro_batch_size)
        except BaseException as e:  # part of the batch's gradients are in: drop the whole update
            self.model.zero_grad(set_to_none=True)
            self._open = False
            e.add_note("forward_backward failed: the gradients accumulated since the last optim_step were dropped")
            raise
        return TrainFuture(lambda: metrics)

    def _step(self, lr: Optional[float]) -> TrainFuture:
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        norm = optim_step(self.model, self.optimizer, self.max_grad_norm)
        metrics = {"grad_norm": norm, "lr": float(self.optimizer.param_groups[0]["lr"])}
        return TrainFuture(lambda: metrics)

    def save_checkpoint(self, step: int, metrics: Optional[dict] = None) -> Ready:
        from primitives.io.checkpoint import save_checkpoint

        if self.checkpoint_dir is None:
            raise ValueError("save_checkpoint: this backend was made without checkpoint_dir")
        return Ready(save_checkpoint(os.path.join(str(self.checkpoint_dir), f"step_{step}"), self.model,
                                     self.tokenizer, self.optimizer))


class RayTrainingBackend(PlanBackend):
    """The plan's backend on a Ray trainer group (``RLCluster``, or the ``RayBackend`` of one: the
    group the jobs train with, ``build_sft_cluster`` / ``build_rl_cluster``). Each call goes to
    every rank; each takes its rows of the batch (``np.array_split``) and the ranks reduce their
    gradients at ``optim_step``, so one rank, N ranks and ``PyTorchTrainingBackend`` compute the
    same update (tested on 1, 2 and 3 ranks, ZeRO-1/2/3, CPU; for a ``loss_fn`` that is a mean over rows,
as documented: a token mean over micro-batches would weigh them by rows). ``loss_fn`` travels to the
ranks (module level, or plain data only). A ``forward_backward`` that fails on a rank spoils the
update there: the ranks refuse to step until the group is rebuilt."""

    def __init__(self, cluster: Any, loss_fn: Callable, checkpoint_dir: Optional[str] = None):
        from primitives.hooks import check_picklable

        super().__init__()
        self.cluster = getattr(cluster, "cluster", cluster)
        self.loss_fn, self.checkpoint_dir = loss_fn, checkpoint_dir
        check_picklable(loss_fn, "loss_fn")
        self._pending: Optional[TrainFuture] = None

    def _dispatch(self, method: str, combine: Callable[[list], dict], *args) -> TrainFuture:
        """``method`` on every rank, now; the future combines the ranks' answers."""
        import ray

        from cluster.ray_wing.groups import fan_out, gather

        self._settle()
        calls = fan_out(self.cluster.trainers, method, *args)
        timeout = self.cluster.timeout_s
        self._pending = TrainFuture(lambda: combine(gather(calls, timeout)),
                                    lambda: not ray.wait([c.ref for c in calls], num_returns=len(calls), timeout=0)[1])
        return self._pending

    def _settle(self) -> None:
        """The previous call's answers before the next call goes out; its error (naming the rank)
        raises here unless its future has raised it already."""
        pending, self._pending = self._pending, None
        if pending is not None and not pending.settled:
            pending.result()

    def _accumulate(self, arrays: dict) -> TrainFuture:
        import ray

        rows = len(arrays["input_ids"])
        return self._dispatch("accumulate",  # a rank with no rows answers {}
                              lambda ranks: {"loss": sum(m.get("loss", 0.0) for m in ranks), "rows": float(rows)},
                              ray.put(arrays), self.loss_fn, rows)

    def _step(self, lr: Optional[float]) -> TrainFuture:
        return self._dispatch("step_accumulated", lambda ranks: ranks[0], lr)  # the grad norm is global: rank 0's

    def save_checkpoint(self, step: int, metrics: Optional[dict] = None) -> Ready:
        from cluster.ray_wing.groups import fan_out, gather

        if self.checkpoint_dir is None:
            raise ValueError("save_checkpoint: this backend was made without checkpoint_dir")
        self._settle()
        path = os.path.join(str(self.checkpoint_dir), f"step_{step}")
        return Ready(gather(fan_out(self.cluster.trainers, "save_checkpoint", path), self.cluster.timeout_s)[0])


# ----------------------------------------------------------------------------- the plan's SFT loop

class Sample(NamedTuple):
    """One training sequence (the plan's record): ``input_ids`` (L,), ``labels`` (L,; the ids for a
    causal LM), ``loss_mask`` (L,; 1 on the tokens to learn)."""

    input_ids: Any
    labels: Any
    loss_mask: Any
    metadata: Optional[dict] = None


class TrainingConfig(NamedTuple):
    num_steps: int = 1000
    batch_size: int = 4
    log_every: int = 100
    checkpoint_every: int = 500


def prepare_sft_batch(samples: Sequence[Sample], pad_id: int = 0) -> dict:
    """The samples as one batch, right-padded to the longest (``primitives.io.data.collate_sft``:
    ``attention_mask`` and ``loss_mask`` 0 on the padding; the plan's ``torch.stack`` needs equal
    lengths); ``labels`` padded alike."""
    from primitives.io.data import SFTSample, collate_sft

    ids, attn, loss_mask = collate_sft([SFTSample(np.asarray(s.input_ids), np.asarray(s.loss_mask, np.float32))
                                        for s in samples], pad_id)
    labels = np.full_like(ids, pad_id)
    for i, s in enumerate(samples):
        labels[i, :len(s.labels)] = np.asarray(s.labels)
    return {"input_ids": ids, "labels": labels, "loss_mask": loss_mask, "attention_mask": attn}


def collate_batch(samples: Sequence[Sample], batch_size: int, step: int, pad_id: int = 0) -> dict:
    """Step ``step``'s batch: ``batch_size`` samples from ``(step * batch_size) % len(samples)``,
    wrapping around (the plan's pure function: the step is the position)."""
    if not samples or batch_size < 1:
        raise ValueError(f"collate_batch: need samples and batch_size >= 1 (got {len(samples)}, {batch_size})")
    start = (step * batch_size) % len(samples)
    picked = [samples[(start + k) % len(samples)] for k in range(batch_size)]
    return prepare_sft_batch(picked, pad_id)


def nll_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The plan's SFT loss: each row's masked token NLL over its masked tokens, averaged over rows."""
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    per_row = -(logp * loss_mask).sum(-1) / loss_mask.sum(-1).clamp(min=1.0)
    return per_row.mean()


def grpo_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
              advantages: torch.Tensor) -> torch.Tensor:
    """The plan's RL loss (its ``grpo_loss``): a plain on-policy policy gradient, each row's mean
    masked logprob times its advantage, averaged over rows, from logits the model computed (so the
    gradient reaches it; not the seeds' float-built loss, README 1). No clipping and no importance
    weight: for updates on an older policy's samples use the jobs' loop (``cluster.loop.train``)."""
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    per_row = (logp * loss_mask).sum(-1) / loss_mask.sum(-1).clamp(min=1.0)
    return -(per_row * advantages.to(per_row.dtype)).mean()


async def run_sft_training(backend: PlanBackend, samples: Sequence[Sample], config: TrainingConfig) -> list:
    """The plan's SFT loop as printed: each step ``collate_batch``, ``forward_backward``,
    ``optim_step``, both awaited; a line every ``log_every`` steps and a checkpoint every
    ``checkpoint_every`` (when the backend has a ``checkpoint_dir``). Returns one dict per step."""
    if not samples or config.num_steps <= 0 or config.batch_size <= 0:
        raise ValueError(f"run_sft_training: need samples, num_steps > 0 and batch_size > 0 (got {len(samples)} "
                         f"samples, {config})")
    history = []
    print(f"Starting SFT training...\n  Samples: {len(samples)}\n  Steps: {config.num_steps}\n"
          f"  Batch size: {config.batch_size}")
    for step in range(config.num_steps):
        batch = collate_batch(samples, config.batch_size, step)
        fwd = await backend.forward_backward(batch).result()
        opt = await backend.optim_step().result()
        history.append({**fwd, **opt, "step": step})
        if step % config.log_every == 0:
            print(f"Step {step}: loss={fwd['loss']:.4f}, grad_norm={opt['grad_norm']:.4f}, lr={opt['lr']:.4e}")
        if config.checkpoint_every and step % config.checkpoint_every == 0 and step > 0 \
                and getattr(backend, "checkpoint_dir", None) is not None:
            print(f"  Saved checkpoint to {await backend.save_checkpoint(step, history[-1])}")
    print("Training complete!")
    return history
