"""The bucketed broadcast over a TCPStore + gloo group, across real processes."""
import multiprocessing as mp
import os

import pytest
import torch

from rl_actors import sync_buckets, weight_sync
from rl_actors.sync_buckets import bucket_buffer
from rl_actors.weight_sync import (
    SyncAddress,
    TensorMeta,
    abandoned_by_driver,
    broadcast_buckets,
    free_port,
    init_sync_group,
    join_unless_abandoned,
    tensor_checksums,
)

META = [TensorMeta("w1", (3, 4), "float32"), TensorMeta("b1", (4,), "float32"),
        TensorMeta("emb", (7, 5), "bfloat16"), TensorMeta("w2", (50, 50), "float32")]


def _source_tensors():
    g = torch.Generator().manual_seed(0)
    return {m.name: torch.randn(m.shape, generator=g).to(getattr(torch, m.dtype)) for m in META}


def _member(rank, address, queue, buffered, machines):
    from rl_actors import weight_sync

    torch.set_num_threads(1)
    weight_sync.machine_name = lambda: machines[rank]  # where this member says it runs
    group = init_sync_group(address, rank, timeout_s=60)
    src = _source_tensors()
    got, in_buffer = {}, []
    buffer = bucket_buffer(META, 256, torch.device("cpu")) if buffered[rank] else None

    def keep(ms, ts):
        if buffer is not None:  # each bucket's tensors are views into the one buffer
            start = buffer.data_ptr()
            in_buffer.extend(start <= t.data_ptr() < start + buffer.numel() for t in ts)
        got.update({m.name: t.clone() for m, t in zip(ms, ts)})

    moved = broadcast_buckets(group, META, 256, rank, torch.device("cpu"),
                              get_tensors=lambda ms: [src[m.name] for m in ms], on_received=keep, buffer=buffer)
    queue.put((rank, moved, tensor_checksums(sorted(got.items())) if rank else None, in_buffer,
               weight_sync.members_here(group)))


def test_a_bucket_buffer_holds_the_two_largest_neighbours_with_two_in_flight():
    # 256-byte buckets of META: w1 and b1 (48 + 16 bytes of float32), emb alone (70 bytes of bfloat16, another
    # dtype), w2 alone (10000 bytes, larger than a bucket); two in flight: emb and w2 together, and the 64 bytes
    # the back one is aligned down by
    assert sync_buckets.PIPELINE_DEPTH == 2
    assert bucket_buffer(META, 256, torch.device("cpu")).shape == (70 + 10000 + 64,)
    assert bucket_buffer(META, 256, torch.device("cpu"), depth=1).shape == (10000,)
    assert bucket_buffer(META[:3], 256, torch.device("cpu")).shape == (64 + 70 + 64,)
    assert bucket_buffer(META[:2], 256, torch.device("cpu")).shape == (64,)  # one bucket: nothing beside it
    assert bucket_buffer(META[:2], 256, torch.device("cpu")).dtype == torch.uint8
    assert bucket_buffer([], 256, torch.device("cpu")).shape == (0,)
    with pytest.raises(ValueError, match="depth 3; 1 or 2 buckets in flight"):
        bucket_buffer(META, 256, torch.device("cpu"), depth=3)


@pytest.mark.parametrize("seed", range(20))
def test_two_neighbouring_buckets_never_share_a_byte_of_the_buffer(seed):
    """For any plan (sizes of any bytes, 1-64 buckets): every bucket lies inside the buffer, starts aligned
    to SLOT_ALIGN, and no two neighbours (the two a sync has in flight) overlap; with one in flight all start at 0."""
    import random

    from rl_actors.sync_buckets import SLOT_ALIGN, bucket_plan, bucket_sizes, bucket_slot, buffer_bytes

    draw = random.Random(seed)
    meta = [TensorMeta(f"t{i}", (draw.choice([1, 3, 7, 64, 1000, 4099]),), draw.choice(["float32", "bfloat16"]))
            for i in range(draw.randint(1, 64))]
    plan = bucket_plan(meta, draw.choice([8, 100, 4096, 10 ** 6]))
    sizes = bucket_sizes(plan, meta)
    for depth in (1, 2):
        size = buffer_bytes(plan, meta, depth)
        spans = [(bucket_slot(k, n, size, depth), n) for k, n in enumerate(sizes)]
        assert all(start % SLOT_ALIGN == 0 and start + n <= size for start, n in spans)
        if depth == 1:
            assert {start for start, _ in spans} == {0}
        for (a, n), (b, m) in zip(spans, spans[1:]):
            assert depth == 1 or a + n <= b or b + m <= a


def test_broadcast_delivers_exact_bytes_to_every_receiver():
    """Every receiver gets the source's bytes, whether a member lays every bucket out in one
    reused buffer (the sender and receiver 1) or each bucket in a buffer of its own (receiver 2,
    as vLLM's receiver does; the tests of vLLM's wire send that way too). Each member counts the
    members on its own machine: ranks 0 and 1 here say they share one, rank 2 another."""
    buffered = (True, True, False)
    address = SyncAddress("127.0.0.1", free_port(), 3, "gloo")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    machines = ("node-a", "node-a", "node-b")
    procs = [ctx.Process(target=_member, args=(r, address, queue, buffered, machines)) for r in range(3)]
    for p in procs:
        p.start()
    answers = [queue.get(timeout=120) for _ in procs]
    results = dict((r, (moved, sums)) for r, moved, sums, _, _ in answers)
    in_buffer = dict((r, views) for r, _, _, views, _ in answers)
    assert {r: here for r, *_, here in answers} == {0: 2, 1: 2, 2: 1}
    for p in procs:
        p.join(timeout=30)
    expected = tensor_checksums(sorted(_source_tensors().items()))
    total = sum(m.nbytes for m in META)
    assert results[0][0] == total
    for r in (1, 2):
        assert results[r] == (total, expected)
    assert in_buffer[1] == [True] * len(META) and in_buffer[2] == []


def test_a_short_buffer_or_a_wrong_tensor_is_refused_before_anything_is_sent():
    """The checks come before the first collective (the group here is never called)."""
    group, cpu = object(), torch.device("cpu")
    src = _source_tensors()
    with pytest.raises(ValueError, match="a bucket of 10000 bytes does not fit the 70-byte buffer"):
        broadcast_buckets(group, META, 256, 1, cpu, buffer=bucket_buffer(META[:3], 256, cpu, depth=1))
    wrong = lambda ms: [src[m.name][:2] if m.name == "b1" else src[m.name] for m in ms]  # noqa: E731
    with pytest.raises(ValueError, match="'b1' has 2 elements, its metadata 4"):
        broadcast_buckets(group, META, 256, 0, cpu, get_tensors=wrong, buffer=bucket_buffer(META, 256, cpu))
    with pytest.raises(ValueError, match="1 tensors for a bucket of 2 parameters"):
        broadcast_buckets(group, META, 256, 0, cpu, get_tensors=lambda ms: [src[ms[0].name]])


class CountingGroup:
    """A group of one that records the torch threads at each broadcast (and may fail one)."""

    def __init__(self, fail_at: int = -1, members: int = 2):
        self.threads, self.fail_at, self.members = [], fail_at, members

    def size(self):
        return self.members

    def broadcast(self, tensors, opts):
        self.threads.append(torch.get_num_threads())
        if len(self.threads) == self.fail_at:
            raise RuntimeError("the link dropped")
        return type("Done", (), {"wait": lambda self: None})()


def test_a_cpu_broadcast_runs_on_one_torch_thread_and_restores_the_count(monkeypatch):
    """Idle pool threads spin after each copy and take the cores gloo's transport needs: where the
    members' threads outnumber the cores, the sync runs on one torch thread (docs/benchmarks.md,
    2026-12-01 session 67), and the actor's count comes back after it, a failed one too; with cores
    for every thread (members on other machines not counted), or on another device, the count is left alone."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})  # 3 cores: 2 members x 2 threads overrun
    src = _source_tensors()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sender = CountingGroup()
        broadcast_buckets(sender, META, 256, 0, torch.device("cpu"), get_tensors=lambda ms: [src[m.name] for m in ms])
        assert sender.threads == [1, 1, 1] and torch.get_num_threads() == 2  # three buckets
        failing = CountingGroup(fail_at=2)
        with pytest.raises(RuntimeError, match="the link dropped"):
            broadcast_buckets(failing, META, 256, 1, torch.device("cpu"), on_received=lambda ms, ts: None)
        assert failing.threads == [1, 1] and torch.get_num_threads() == 2
        elsewhere = CountingGroup()
        broadcast_buckets(elsewhere, META, 256, 1, torch.device("meta"))
        assert elsewhere.threads == [2, 2, 2]
        apart = CountingGroup()  # its other member on another machine (init_sync_group's count): 2 threads fit
        monkeypatch.setitem(weight_sync._ON_THIS_MACHINE, apart, 1)
        broadcast_buckets(apart, META, 256, 1, torch.device("cpu"), on_received=lambda ms, ts: None)
        assert apart.threads == [2, 2, 2]
        room = CountingGroup()
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})  # 4 cores for 2 x 2 threads
        broadcast_buckets(room, META, 256, 1, torch.device("cpu"), on_received=lambda ms, ts: None)
        assert room.threads == [2, 2, 2]
    finally:
        torch.set_num_threads(before)


class Wire:
    """One member's view of a group whose broadcasts complete at the worst moment for a buffer reused too
    soon: a receiver's bucket lands as soon as it is posted (the source's bytes, taken from ``source``),
    a source's is read only when it is waited for. ``events`` records posts, waits and the receiver's loads."""

    def __init__(self, rank: int, source: dict, plan: list):
        self.rank, self.source, self.plan, self.events, self.sent, self.outstanding = rank, source, plan, [], [], 0
        self.most = 0  # broadcasts in flight at once, at most

    def size(self):
        return 2

    def broadcast(self, tensors, opts):
        (flat,), k = tensors, sum(e[0] == "post" for e in self.events)
        self.events.append(("post", k))
        self.outstanding += 1
        self.most = max(self.most, self.outstanding)
        if self.rank:
            names = [m.name for m in META if m.name in self.plan[k]]
            flat.copy_(torch.cat([self.source[n].reshape(-1) for n in names]))
        wire = self

        class Work:
            def wait(self):
                wire.events.append(("wait", k))
                wire.outstanding -= 1
                if wire.rank == 0:
                    wire.sent.append(flat.clone())
        return Work()


@pytest.mark.parametrize("buffered", [False, True])
def test_buckets_are_posted_ahead_and_a_slot_is_reused_only_once_its_bucket_is_done(buffered, monkeypatch):
    """Two broadcasts in flight (``PIPELINE_DEPTH``): a receiver's bucket k+1 is posted before bucket k is
    loaded, and the source fills bucket k+1 before bucket k is waited for; yet no bucket is overwritten
    while a member still reads it: the receiver's every load sees its own bucket's bytes though each bucket
    lands the moment it is posted, the source's every bucket its own bytes though read only at its wait.
    With a depth of 1 (a one-slot buffer) nothing is posted ahead."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    src = _source_tensors()
    plan = [["w1", "b1"], ["emb"], ["w2"]]  # 256-byte buckets of META
    buffer = bucket_buffer(META, 256, torch.device("cpu")) if buffered else None
    receiver, loaded = Wire(1, src, plan), {}

    def load(ms, ts):
        receiver.events.append(("load", len(loaded)))
        loaded[len(loaded)] = {m.name: t.clone() for m, t in zip(ms, ts)}

    broadcast_buckets(receiver, META, 256, 1, torch.device("cpu"), on_received=load, buffer=buffer)
    assert receiver.events == [("post", 0), ("post", 1), ("wait", 0), ("load", 0), ("post", 2), ("wait", 1),
                               ("load", 1), ("wait", 2), ("load", 2)]
    assert receiver.most == 2
    for k, names in enumerate(plan):
        assert sorted(loaded[k]) == sorted(names)
        for n in names:
            assert torch.equal(loaded[k][n], src[n])
    source = Wire(0, src, plan)
    broadcast_buckets(source, META, 256, 0, torch.device("cpu"), get_tensors=lambda ms: [src[m.name] for m in ms],
                      buffer=bucket_buffer(META, 256, torch.device("cpu")) if buffered else None)
    assert source.events == [("post", 0), ("post", 1), ("wait", 0), ("post", 2), ("wait", 1), ("wait", 2)]
    for sent, names in zip(source.sent, plan):
        want = torch.cat([src[n].reshape(-1) for n in names])
        assert torch.equal(sent, want)
    one = Wire(1, src, plan)
    broadcast_buckets(one, META, 256, 1, torch.device("cpu"), on_received=lambda ms, ts: None,
                      buffer=bucket_buffer(META, 256, torch.device("cpu"), depth=1))
    assert one.most == 1 and [e for e, _ in one.events] == ["post", "wait"] * 3


def test_a_rendezvous_given_up_is_left_at_once_and_one_that_completes_is_kept():
    """``join_unless_abandoned``: rank 0 of a 2-member gloo group whose rank 1 never comes (it died
    before joining) leaves the rendezvous as soon as the driver gives the group up, not after the
    rendezvous's own timeout (60 s here); the rendezvous itself waits on in its thread, without
    the interpreter. A group whose members all come is returned; a join that raises gives the
    group up and raises; a group given up before the member's call starts is not joined."""
    import threading
    import time

    given_up = threading.Event()
    timer = threading.Timer(0.5, given_up.set)
    timer.start()
    address = SyncAddress("127.0.0.1", free_port(), 2, "gloo", token="t")
    t0 = time.monotonic()
    assert join_unless_abandoned(lambda: init_sync_group(address, 0, timeout_s=60), given_up.is_set,
                                 poll_s=0.05) is None
    assert 0.5 <= time.monotonic() - t0 < 5

    whole = SyncAddress("127.0.0.1", free_port(), 1, "gloo", token="u")  # a group of one forms at once
    group = join_unless_abandoned(lambda: init_sync_group(whole, 0, timeout_s=60), lambda: False, poll_s=0.05)
    assert group.size() == 1

    def broken():
        raise ValueError("bad address")

    gave_up = []
    with pytest.raises(ValueError, match="bad address"):  # and the member gives the group up for the others
        join_unless_abandoned(broken, lambda: False, poll_s=0.05, give_up=lambda: gave_up.append(True))
    assert gave_up == [True]
    started = []
    assert join_unless_abandoned(lambda: started.append(True), lambda: True) is None  # given up before it came
    assert started == []
    assert join_unless_abandoned(lambda: 7, None) == 7  # nothing to watch (outside an actor): joined here
    assert abandoned_by_driver(address) is None  # not in a Ray actor


def test_the_driver_forgets_its_marks_and_only_its_own(monkeypatch):
    """``abandon_sync_group`` writes a group's mark; ``forget_abandoned`` deletes the marks the driver
    wrote since the last call, once each, and none that a member wrote (``driver=False``: the
    driver marks that group too, when its join fails) or that another process wrote; a group
    without a token leaves none; a delete the store fails is tried again at the next call, without
    raising."""
    import ray.experimental.internal_kv as kv

    from rl_actors import weight_sync
    from rl_actors.weight_sync import ABANDONED_KEY, abandon_sync_group, forget_abandoned

    store = {(ABANDONED_KEY + "other-driver").encode(): b"1"}
    monkeypatch.setattr(kv, "_internal_kv_put", lambda key, value, overwrite=False: store.__setitem__(key, value))
    monkeypatch.setattr(kv, "_internal_kv_del", lambda key: int(store.pop(key, None) is not None))
    monkeypatch.setattr(weight_sync, "_MARKED", [])
    address = SyncAddress("127.0.0.1", 1, 2, "gloo")
    abandon_sync_group(address._replace(token="a"))
    abandon_sync_group(address._replace(token="b"))
    abandon_sync_group(address._replace(token="m"), driver=False)
    abandon_sync_group(address)  # no token: nothing to mark
    assert sorted(store) == sorted(f"{ABANDONED_KEY}{t}".encode() for t in ("a", "b", "m", "other-driver"))
    assert forget_abandoned() == 2
    assert sorted(store) == sorted(f"{ABANDONED_KEY}{t}".encode() for t in ("m", "other-driver"))
    assert forget_abandoned() == 0
    abandon_sync_group(address._replace(token="c"))  # the store fails the delete once: kept for the next call

    def flaky_del(key):
        monkeypatch.setattr(kv, "_internal_kv_del", lambda k: int(store.pop(k, None) is not None))
        raise ConnectionError("GCS unreachable")

    monkeypatch.setattr(kv, "_internal_kv_del", flaky_del)
    assert forget_abandoned() == 0 and f"{ABANDONED_KEY}c".encode() in store
    assert forget_abandoned() == 1 and f"{ABANDONED_KEY}c".encode() not in store


def test_a_free_port_is_drawn_below_the_kernels_ephemeral_range(monkeypatch):
    """A store's port is not one the kernel may give another process's outgoing connection meanwhile:
    drawn between ``PORT_FLOOR`` and the ephemeral range, free, and apart from call to call; where that
    leaves too few ports, any free one."""
    import socket

    from rl_actors import weight_sync

    low = weight_sync.ephemeral_ports()[0]
    ports = {free_port() for _ in range(20)}
    assert all(weight_sync.PORT_FLOOR <= p < low for p in ports) and len(ports) > 10
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free
    monkeypatch.setattr(weight_sync, "ephemeral_ports", lambda: (weight_sync.PORT_FLOOR + 10, 60999))
    assert free_port() >= low  # too few ports below: the kernel's choice, from its own range
