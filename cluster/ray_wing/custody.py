"""What the driver keeps on its own node, so that the loss of another node cannot take it.

An object an actor returns lives in the object store of the actor's node (above Ray's inline
limit, 100 KB); the driver owns it, but when that node is lost so is the object, and Ray cannot
make an actor's result again. Three kinds of object must outlive their node: the snapshot parts
a rebuilt group is restored from (made on the trainer and critic nodes), the rollout chunks of
the step in flight and of the update log (made on the generator, reward and reference nodes;
a rebuilt group replays them), and the critic's value shares in that log.

``keep_here`` copies each such object into the driver's node: the driver fetches it and puts it
again, so the copy is the driver's own, held where the driver runs - the head node under
``ray job submit`` and KubeRay, the one node whose loss ends the cluster anyway (it holds Ray's
control store). The cost is one transfer per object (``faults/kept_mb``, ``faults/kept_s``), and
room in the head's object store for two snapshots (the last, and the next while it is taken) and
the rollouts of the updates since the last snapshot, plus one batch of up to ``BATCH_BYTES`` in
the driver's own memory while it is copied. On one node nothing is copied.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from cluster.loop.protocol import ActorFailure
from cluster.ray_wing.groups import TRANSFER_S, Call, lost_object

BATCH_BYTES = 256 * 2 ** 20  # fetched together up to this many bytes: overlapping transfers, bounded driver memory


# Ray's default inline limit (max_direct_call_object_size): smaller results live with the driver
INLINE_BYTES = 100 * 1024
# A result's node reaches its owner in the raylet's own report, which can come after the result
# itself on a loaded machine: an object with no node yet is asked about again for this long.
PLACE_WAIT_S = 2.0


def _inline_size(entry: dict) -> bool:
    """Whether the object is small enough to be inline (Ray knows its size)."""
    size = entry.get("object_size")
    return size is not None and size <= INLINE_BYTES


def _placed(entry: Optional[dict]) -> bool:
    """Whether Ray can say where an object is: on some node, spilled, or small enough to be inline."""
    return entry is not None and bool(entry.get("node_ids") or entry.get("did_spill") or _inline_size(entry))


def where_now(refs: Sequence, locate: Callable[[list], dict], wait_s: float = PLACE_WAIT_S) -> dict:
    """``locate(refs)`` (Ray's locations), with each object Ray could not place asked about
    again, the pause doubling from 10 ms, until it is placed or ``wait_s`` have passed. An object
    whose node was lost stays unplaced: the copy then finds it lost and names its maker."""
    where = dict(locate(list(refs)))
    pause, end = 0.01, time.monotonic() + wait_s
    while True:
        unplaced = [r for r in refs if not _placed(where.get(r))]
        if not unplaced or time.monotonic() + pause > end:
            return where
        time.sleep(pause)
        pause = min(2 * pause, 0.25)
        where.update(locate(unplaced))


def _stays(entry: Optional[dict], here: str) -> bool:
    """Whether an object may stay where it is: stored on the driver's node alone, or inline (kept
    with the driver: no node holds it, it was never spilled, and it is small enough to be inline).
    An object whose location Ray could not tell, that was spilled, or that no node holds although
    it is too large to be inline (its node was lost: the copy then names its maker) is copied."""
    if entry is None or entry.get("did_spill"):
        return False
    nodes = entry.get("node_ids") or []
    if nodes:
        return nodes == [here]
    return _inline_size(entry)


def keep_here(refs: Sequence, made_by: Sequence[Call], timeout_s: float) -> tuple:
    """``(refs, bytes copied)``: each ref (None stays None) whose object may be lost with another
    node is replaced by a copy the driver puts on its own node; one stored only here (or inline,
    with the driver) is kept as it is. Fetched in batches of up to ``BATCH_BYTES`` (the transfers
    overlap; one at a time, a small one now and then waited ~1 s), each batch put and let go before
    the next, so the driver holds at most one batch besides the store's copies. ``made_by[i]``: the
    call whose result ``refs[i]`` is, named when the object was lost already (``lost_object``: its
    maker is replaced and its work done again) or its transfer took longer than the bound (stuck)."""
    import ray
    from ray.exceptions import GetTimeoutError, ObjectLostError

    real = [r for r in refs if r is not None]
    if not real:
        return list(refs), 0
    bound = max(timeout_s, TRANSFER_S)
    here = ray.get_runtime_context().get_node_id()
    try:
        where = where_now(real, lambda rs: ray.experimental.get_object_locations(rs, timeout_ms=int(bound * 1000)))
    except GetTimeoutError as error:
        raise ActorFailure(f"{made_by[0].role} {made_by[0].rank}.{made_by[0].method}: where its results are was not "
                           f"known within {bound:.0f}s", made_by[0].role, made_by[0].rank, stuck=True) from error
    far = [i for i, ref in enumerate(refs) if ref is not None and not _stays(where.get(ref), here)]
    out: list[Optional[object]] = list(refs)
    copied, batch, size = 0, [], 0
    for n, i in enumerate(far):
        batch.append(i)
        size += int((where.get(refs[i]) or {}).get("object_size") or 0)
        if size < BATCH_BYTES and n + 1 < len(far):
            continue
        try:
            values = ray.get([refs[k] for k in batch], timeout=bound)
        except ObjectLostError as error:
            lost = getattr(error, "object_ref_hex", "")
            call = next((made_by[k] for k in batch if refs[k].hex() == lost), made_by[batch[0]])
            raise lost_object(call.role, call.rank, call.method, error) from error
        except GetTimeoutError as error:
            call = made_by[batch[0]]
            raise ActorFailure(f"{call.role} {call.rank}.{call.method}: its result did not reach the driver's node "
                               f"within {bound:.0f}s", call.role, call.rank, stuck=True) from error
        for k, value in zip(batch, values, strict=True):
            out[k] = ray.put(value)
        del values
        copied, batch, size = copied + size, [], 0
    return out, copied
