"""An update left open between calls: the seeds' plan's ``forward_backward(batch)`` now and
``optim_step()`` later, on every rank of a DeepSpeed trainer group (``rl_primitives.plan``).

``DeepSpeedRank.update`` knows its passes up front and makes the last one the gradient-accumulation
boundary. Here the caller may call ``forward_backward`` several times (gradient accumulation)
before it steps, so no pass of an ``accumulate`` is the boundary, and ``step_accumulated`` makes
one padding pass at the boundary (a one-token forward times zero: it adds nothing, and what
DeepSpeed does at the boundary runs), then steps. Each ZeRO stage communicates at each pass as it
does inside ``update`` (ZeRO-2 and 3 at every backward), so every rank makes the same number of
passes in each call (the largest shard's), as in ``update``.

A failed ``accumulate`` leaves gradients partly added: the rank marks its update spoiled
(``open_passes`` -1), and every later step, update, load or restore on it refuses; the group must
be rebuilt (the jobs' loop does so) or restored from a checkpoint by new processes. A ``loss_fn``
that raises on one rank while the others go on leaves them waiting in a collective until the
driver's call timeout names them.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from primitives.model.training import loss_fn_forward_backward
from rl_actors.deepspeed_rank import passes


def accumulate(ds: Any, count: int, run: Optional[Callable[[], dict]]) -> dict:
    """``count`` backward passes on the ``DeepSpeedRank`` ``ds`` (``run`` makes this rank's, padding
    makes the rest), none of them the boundary. Returns ``run``'s metrics."""
    if ds.open_passes < 0:
        ds.check_closed("another forward_backward")
    ds._backwards_left = max(1, count) + 1  # one more than this call makes: the step's pass is the boundary
    try:
        metrics = run() if run is not None else {}
    except BaseException:
        ds.open_passes = -1  # spoiled: part of this batch's gradients are in
        raise
    if ds._backwards_left < 1:
        raise RuntimeError(f"{ds.role} {ds.rank}: made more backward passes than the {max(1, count)} planned")
    while ds._backwards_left > 1:
        ds.padding_backward()
    ds.open_passes += max(1, count)
    return metrics


def step_accumulated(ds: Any, lr: Optional[float]) -> dict:
    """Close what ``accumulate`` left open: one padding pass at the boundary, then the step."""
    if ds.open_passes < 0:
        ds.check_closed("a step")
    if not ds.open_passes:
        raise RuntimeError(f"{ds.role} {ds.rank}: optim_step with no forward_backward since the last step")
    ds._backwards_left = 1
    ds.padding_backward()
    ds.open_passes = 0
    return ds.finish_step({}, lr)


class OpenUpdates:
    """The two calls on a trainer rank (a mixin of ``TrainerWorker``: its ``ds``, rank, world
    size, micro-batch size and busy clock)."""

    ds: Any
    rank: int
    world_size: int
    config: Any
    clock: Any

    def accumulate(self, arrays: dict, loss_fn: Callable, global_rows: int) -> dict:
        """``forward_backward``: ``loss_fn`` over this rank's rows of ``arrays``
        (``primitives.model.training.loss_fn_forward_backward``), gradients accumulated, the update
        left open. Returns this rank's share of the batch's mean ``loss`` and its ``rows``."""
        rows = np.array_split(np.arange(global_rows), self.world_size)[self.rank]
        mine = {k: np.asarray(v)[rows] for k, v in arrays.items()}
        mbs = self.config.micro_batch_size

        def run() -> dict:
            return loss_fn_forward_backward(self.ds.engine, mine, loss_fn, global_rows, mbs,
                                            backward=self.ds.backward, loss_scale=float(self.world_size))

        with self.clock.working():
            return accumulate(self.ds, passes(global_rows, self.world_size, mbs), run if len(rows) else None)

    def step_accumulated(self, lr: Optional[float] = None) -> dict:
        """``optim_step``: the accumulated gradients reduce over ranks and the optimizer steps;
        ``grad_norm`` (before clipping) and ``lr``."""
        with self.clock.working():
            return step_accumulated(self.ds, lr)
