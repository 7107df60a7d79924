"""Weight broadcast from trainer rank 0 to generators (and a policy-tracking reference).

A dedicated process group built from its own ``TCPStore`` - gloo on CPU, NCCL on GPU -
so it never touches the trainers' DeepSpeed world. Tensors travel in buckets: many
parameters are flattened into one buffer per collective (``bucket_bytes`` each), grouped
by dtype; every member computes the same plan from the same metadata, so only the bytes
cross the wire. A ZeRO-3 source gathers each bucket's parameters just before sending it.

Functions here run inside actors; the driver only hands out addresses and metadata.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import socket
import threading
import weakref
from datetime import timedelta
from typing import Callable, Iterable, Iterator, NamedTuple, Optional, Sequence, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from rl_actors.sync_buckets import PIPELINE_DEPTH, bucket_plan, bucket_slot, buffer_bytes, largest_bucket

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TensorMeta(NamedTuple):
    name: str
    shape: tuple
    dtype: str  # key of DTYPES

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.numel * torch.tensor([], dtype=DTYPES[self.dtype]).element_size()


class SyncAddress(NamedTuple):
    host: str
    port: int
    world_size: int
    backend: str  # "gloo" | "nccl"
    token: str = ""  # names this forming of the group: the driver gives it up by this name (abandon_sync_group)


# A group's store port is drawn below the kernel's ephemeral range (``ip_local_port_range``, 32768-60999
# by default), from which it gives every outgoing connection its local port: a port found free there can
# be taken by another process's connection before the store binds it (seen: EADDRINUSE in a DeepSpeed
# rendezvous beside a busy Ray, 2026-11-30). Above Ray's worker ports (10002-19999 by default).
PORT_FLOOR = 20000


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that binds now, drawn at random from ``PORT_FLOOR`` up to the kernel's
    ephemeral range (any free one where that leaves fewer than 1000)."""
    import random

    low = ephemeral_ports()[0]
    draw = random.Random()  # seeded from the OS: processes forked from one parent draw apart
    for _ in range(64 if low - PORT_FLOOR >= 1000 else 0):
        port = draw.randrange(PORT_FLOOR, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ephemeral_ports() -> tuple:
    """``(first, last)`` of the ports the kernel hands out for outgoing connections (Linux's default
    where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first, last = (int(x) for x in f.read().split())
        return first, last
    except (OSError, ValueError):
        return 32768, 60999


def dtype_name(dtype: torch.dtype) -> str:
    for k, v in DTYPES.items():
        if v == dtype:
            return k
    raise ValueError(f"unsupported dtype for weight sync: {dtype}")


def init_sync_group(address: SyncAddress, rank: int, timeout_s: float = 300.0):
    """Join the weight-sync group as ``rank`` (0 = the source, which hosts the store)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address.host, address.port, address.world_size, is_master=(rank == 0),
                          timeout=timeout, wait_for_workers=False)
    # keys of their own per forming: a member left waiting on an earlier forming never meets a new one's
    store = dist.PrefixStore("rayrl-weight-sync" + (f"/{address.token}" if address.token else ""), store)
    if address.backend == "gloo":
        store.set(f"machine/{rank}", machine_name())  # before the rendezvous: every name is there after it
        group = dist.ProcessGroupGloo(store, rank, address.world_size, timeout)
        names = [store.get(f"machine/{r}").decode() for r in range(address.world_size)]
        _ON_THIS_MACHINE[group] = names.count(machine_name())
        return group
    if address.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, address.world_size, opts)
    raise ValueError(f"unknown weight-sync backend '{address.backend}' (gloo, nccl)")


# gloo groups formed here -> how many of their members run on this process's machine (members_here)
_ON_THIS_MACHINE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def machine_name() -> str:
    """The machine this process runs on, as the members of a group compare it: the host's name.
    Ray's nodes started on one host (``ray.cluster_utils.Cluster``) share its cores, and its name."""
    return socket.gethostname()


def members_here(group) -> int:
    """How many of ``group``'s members share this process's machine, as each told the others when the
    gloo group formed (``init_sync_group``); a group formed otherwise counts all its members."""
    try:
        known = _ON_THIS_MACHINE.get(group)
    except TypeError:  # no weak reference to it: not a group formed here
        known = None
    return known if known is not None else (group.size() if hasattr(group, "size") else 1)


ABANDONED_KEY = "rayrl-sync-abandoned-"  # + a group's token: in Ray's key-value store once the driver gave it up
T = TypeVar("T")
_MARKED: list = []  # the tokens this process marked given up (abandon_sync_group), until forget_abandoned


def abandon_sync_group(address: SyncAddress, driver: bool = True) -> None:
    """The members still forming ``address``'s group leave it (``join_unless_abandoned``). Called by
    the driver when one of them died, stopped or raised while the group formed, and by a member
    whose own join raised (``driver=False``): the others would wait for it in the rendezvous until
    its timeout (minutes), every later call to them queued behind. The driver remembers its marks
    for ``forget_abandoned``; a member's mark is the driver's too (its join failing makes the
    driver mark the group)."""
    if address.token:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put((ABANDONED_KEY + address.token).encode(), b"1", overwrite=True)
        if driver:
            _MARKED.append(address.token)


def forget_abandoned() -> int:
    """Delete the marks this process left in Ray's key-value store (``abandon_sync_group``); how
    many. The driver calls it once a group has formed after them: every member of that group had
    left the given-up join before it joined (an actor answers its calls one after the other), and
    the given-up group's other members are dead or gone from the cluster, so nobody reads the marks
    again. A job that ends right after a given-up forming leaves its mark (a few bytes). Best effort:
    a mark the store could not delete now is kept for the next call, and the group that formed is
    not failed for it. The marks are the process's, not a cluster's: one driver process running two
    clusters at once could delete the other's fresh mark."""
    from ray.experimental.internal_kv import _internal_kv_del

    forgotten, kept = 0, []
    while _MARKED:
        token = _MARKED.pop()
        try:
            forgotten += bool(_internal_kv_del((ABANDONED_KEY + token).encode()))
        except Exception:  # the store unreachable for a moment
            kept.append(token)
    _MARKED.extend(kept)
    return forgotten


def abandoned_by_driver(address: SyncAddress) -> Optional[Callable[[], bool]]:
    """In a Ray actor, whether the driver gave up forming ``address``'s group (``abandon_sync_group``);
    None outside an actor or for a group without a token (nothing to watch: the join just waits)."""
    from rl_actors.common import ray_actor_id

    if not address.token or not ray_actor_id():
        return None
    from ray.experimental.internal_kv import _internal_kv_exists

    key = (ABANDONED_KEY + address.token).encode()

    def given_up() -> bool:
        try:
            return bool(_internal_kv_exists(key))
        except Exception:  # the store unreachable for a moment: keep waiting, as without a watch
            return False

    return given_up


def join_sync_group(join: Callable[[], T], address: SyncAddress) -> Optional[T]:
    """A member's ``join()`` of ``address``'s group (``join_unless_abandoned``, watching the driver's
    mark in a Ray actor); a join that raises gives the group up itself, so the other members leave
    at once: the driver's wait ends at once on a dead member, not on one that raised."""
    return join_unless_abandoned(join, abandoned_by_driver(address),
                                 give_up=lambda: abandon_sync_group(address, driver=False))


def join_unless_abandoned(join: Callable[[], T], abandoned: Optional[Callable[[], bool]],
                          poll_s: float = 0.1, give_up: Optional[Callable[[], None]] = None) -> Optional[T]:
    """``join()``, a rendezvous that waits for every member of a group, and what it returns; None
    as soon as ``abandoned()`` says the group was given up (read every ``poll_s``, and before
    anything starts). The rendezvous then runs on in a daemon thread until its own timeout, where
    it fails, since the member it waits for never comes; nothing it made is kept. So this actor
    answers its next calls (the group formed again, on a new port) at once. A ``join()`` that
    raises calls ``give_up()`` first. Without ``abandoned``, ``join()`` just runs here."""
    if abandoned is None:
        return join()
    if abandoned():
        return None
    done, value, error = threading.Event(), [], []

    def run() -> None:
        try:
            value.append(join())
        except BaseException as e:  # handed to the caller below
            error.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="rayrl-sync-join", daemon=True).start()
    while not done.wait(poll_s):
        if abandoned() and not done.is_set():
            return None
    if error:
        if give_up is not None:
            try:
                give_up()
            except Exception:  # the store unreachable: the others wait for the driver's mark instead
                pass
        raise error[0]
    return value[0]


def in_group(group, rank: Optional[int]) -> int:
    """``rank``, for a member of a weight-sync group (``init_sync_group``); an error otherwise."""
    if group is None or rank is None:
        raise RuntimeError("this actor has not joined a weight-sync group (init_weight_sync comes first)")
    return rank


@contextlib.contextmanager
def one_torch_thread(device, members: int = 1) -> Iterator[None]:
    """One torch thread while a broadcast on the CPU runs, the count restored after, where the group's
    ``members`` on this machine (``members_here``), with this actor's thread count each, would run
    more threads than it has cores. A gloo broadcast is mostly waiting on its transport's threads,
    and the idle threads of a torch thread pool spin after each of the copies around it, taking the
    cores those transport threads need. The SmolLM2 job's sync on 2 cores (2 threads in the trainer
    and 2 in the generator) took 0.85 -> 0.43 s into an HF generator and 1.33 -> 0.86 s into vLLM,
    whose generation after it was as fast (docs/benchmarks.md, 2026-12-01 session 67). An actor
    runs one call at a time, and no other thread of it uses torch during a sync."""
    before = torch.get_num_threads()
    if not (isinstance(device, torch.device) and device.type == "cpu") or before == 1 or \
            before * members <= len(os.sched_getaffinity(0)):
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def broadcast_buckets(group, meta: Sequence[TensorMeta], bucket_bytes: int, rank: Optional[int],
                      device: torch.device, get_tensors: Optional[Callable[[list], list]] = None,
                      on_received: Optional[Callable[[list, list], None]] = None,
                      buffer: Optional[torch.Tensor] = None) -> int:
    """Broadcast every bucket from rank 0. The source passes ``get_tensors(metas) -> tensors``, called
    once per bucket in order, its tensors read before the next call (a ZeRO-3 source gathers a bucket
    there and lets the last one go); receivers pass ``on_received(metas, tensors)`` (None: take part
    and keep nothing). Returns bytes moved per receiver.

    Up to ``PIPELINE_DEPTH`` broadcasts are posted ahead: a receiver's ``on_received`` runs on one
    bucket while the next ones arrive (gloo's threads receive them; on NCCL its stream), and the source
    fills a bucket while the one before is on the wire. The collectives keep their order, so members
    may post ahead by different depths. With ``buffer`` (``bucket_buffer``), every bucket is laid out in it
    (``bucket_slot``; two in flight where it has the room, else one), and the tensors a receiver's
    ``on_received`` gets are views into it, valid until it returns: a receiver that keeps them copies
    them (vLLM's layerwise reload keeps what it is given until a layer is whole, so its receiver passes
    none and each bucket gets a buffer of its own). On a CPU whose cores the threads of the group's
    members there outnumber, it runs on one torch thread (``one_torch_thread``)."""
    with one_torch_thread(device, members_here(group)):
        return _broadcast_buckets(group, meta, bucket_bytes, rank, device, get_tensors, on_received, buffer)


def _broadcast_buckets(group, meta, bucket_bytes, rank, device, get_tensors, on_received, buffer) -> int:
    rank = in_group(group, rank)
    if rank == 0 and get_tensors is None:
        raise ValueError("the source of a broadcast (rank 0) passes get_tensors")
    plan, depth = bucket_plan(meta, bucket_bytes), PIPELINE_DEPTH
    if buffer is not None:
        if buffer.numel() < largest_bucket(plan, meta):
            raise ValueError(f"weight sync: a bucket of {largest_bucket(plan, meta)} bytes does not fit the "
                             f"{buffer.numel()}-byte buffer (bucket_buffer sizes it from the same plan)")
        depth = 2 if buffer.numel() >= buffer_bytes(plan, meta, 2) else 1
    posted: collections.deque = collections.deque()  # (work, metas, flat) of the broadcasts in flight, in order
    total = 0

    def post(k: int, metas: list) -> None:
        numel, dtype = sum(m.numel for m in metas), DTYPES[metas[0].dtype]
        if buffer is None:
            flat = torch.empty(numel, dtype=dtype, device=device)
        else:  # the bucket that used this room last (k - depth) is done, its on_received returned
            start = bucket_slot(k, numel * dtype.itemsize, buffer.numel(), depth)
            flat = buffer[start: start + numel * dtype.itemsize].view(dtype)
        if rank == 0:
            fill(flat, metas, get_tensors(metas))
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        posted.append((group.broadcast([flat], opts), metas, flat))

    def finish() -> int:
        work, metas, flat = posted.popleft()
        work.wait()
        if rank != 0 and on_received is not None:
            parts, offset = [], 0
            for m in metas:
                parts.append(flat[offset: offset + m.numel].view(m.shape))
                offset += m.numel
            on_received(metas, parts)
        return flat.numel() * flat.element_size()

    for k, idx in enumerate(plan):
        if len(posted) == depth:
            total += finish()
        post(k, [meta[i] for i in idx])
    while posted:
        total += finish()
    return total


def fill(flat: torch.Tensor, metas: list, tensors: Sequence[torch.Tensor]) -> None:
    """The source's side of a bucket: ``tensors`` (one per ``metas``) laid end to end in ``flat``."""
    if len(tensors) != len(metas):
        raise ValueError(f"weight sync: {len(tensors)} tensors for a bucket of {len(metas)} parameters")
    offset = 0
    for m, t in zip(metas, tensors):
        if t.numel() != m.numel:
            raise ValueError(f"weight sync: '{m.name}' has {t.numel()} elements, its metadata {m.numel}")
        flat[offset: offset + m.numel].copy_(t.detach().reshape(-1))
        offset += m.numel


def raw_broadcast(group, numel: int, dtype: torch.dtype, rank: Optional[int], device) -> float:
    """Seconds of one broadcast of a preallocated flat buffer from rank 0 (allocation and the
    first touch of its pages not timed): the throughput ceiling of the group."""
    import time

    rank = in_group(group, rank)
    flat = torch.ones(numel, dtype=dtype, device=device)  # written: its pages are in place before the clock starts
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    if flat.is_cuda:
        torch.cuda.synchronize(flat.device)
    t0 = time.perf_counter()
    group.broadcast([flat], opts).wait()
    if flat.is_cuda:  # NCCL's wait() orders the stream; the host waits here
        torch.cuda.synchronize(flat.device)
    return time.perf_counter() - t0


def copy_into_model(model, metas: Sequence[TensorMeta], tensors: Sequence[torch.Tensor]) -> None:
    """Receiver side: copy received tensors into the model's parameters by name."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for m, t in zip(metas, tensors):
            if m.name not in params:
                raise KeyError(f"weight sync: the receiving model has no parameter '{m.name}'")
            params[m.name].copy_(t)


def model_meta(named_params: Iterable) -> list:
    return [TensorMeta(n, tuple(p.shape), dtype_name(p.dtype)) for n, p in named_params]


def tensor_checksums(named_tensors: Iterable) -> dict:
    """name -> sha1 of the tensor's bytes (exact equality check across processes)."""
    out = {}
    for name, t in named_tensors:
        data = t.detach().to("cpu").contiguous()
        if data.dtype == torch.bfloat16:
            data = data.view(torch.int16)
        out[name] = hashlib.sha1(data.numpy().tobytes()).hexdigest()
    return out
