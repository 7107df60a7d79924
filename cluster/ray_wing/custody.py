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
control store). The cost is one transfer per object, and room in the head's object store for
one snapshot and a step's rollouts (``faults/kept_mb``). On one node nothing is copied.
"""
from __future__ import annotations

from typing import Optional, Sequence

from cluster.ray_wing.groups import Call, lost_object


def keep_here(refs: Sequence, made_by: Sequence[Call], timeout_s: float) -> tuple:
    """``(refs, bytes copied)``: each ref (None stays None) whose object is stored on a node other
    than the driver's alone is replaced by a copy the driver puts on its own node; one stored
    only here (or inline, with the driver) is kept as it is. ``made_by[i]``: the call whose result
    ``refs[i]`` is, named when the object was lost already (``lost_object``: its maker is then
    replaced and its work done again)."""
    import ray
    from ray.exceptions import ObjectLostError

    real = [r for r in refs if r is not None]
    if not real:
        return list(refs), 0
    here = ray.get_runtime_context().get_node_id()
    where = ray.experimental.get_object_locations(real, timeout_ms=int(timeout_s * 1000))

    def elsewhere(ref) -> bool:  # stored on another node (with a copy here or not); [] is inline, with the driver
        nodes = (where.get(ref) or {}).get("node_ids") or []
        return bool(nodes) and nodes != [here]

    far = [i for i, ref in enumerate(refs) if ref is not None and elsewhere(ref)]
    out: list[Optional[object]] = list(refs)
    if not far:
        return out, 0
    try:  # fetched together: the transfers overlap (one at a time, a small one now and then waited ~1 s)
        values = ray.get([refs[i] for i in far], timeout=timeout_s)
    except ObjectLostError as error:
        lost = getattr(error, "object_ref_hex", "")
        call = next((made_by[i] for i in far if refs[i].hex() == lost), made_by[far[0]])
        raise lost_object(call.role, call.rank, call.method, error) from error
    for i, value in zip(far, values, strict=True):
        out[i] = ray.put(value)
    copied = sum(int((where.get(refs[i]) or {}).get("object_size") or 0) for i in far)
    return out, copied
