"""The bucketed broadcast over a TCPStore + gloo group, across real processes."""
import multiprocessing as mp

import torch

from rl_actors.weight_sync import (
    SyncAddress,
    TensorMeta,
    broadcast_buckets,
    free_port,
    init_sync_group,
    tensor_checksums,
)

META = [TensorMeta("w1", (3, 4), "float32"), TensorMeta("b1", (4,), "float32"),
        TensorMeta("emb", (7, 5), "bfloat16"), TensorMeta("w2", (50, 50), "float32")]


def _source_tensors():
    g = torch.Generator().manual_seed(0)
    return {m.name: torch.randn(m.shape, generator=g).to(getattr(torch, m.dtype)) for m in META}


def _member(rank, address, queue):
    torch.set_num_threads(1)
    group = init_sync_group(address, rank, timeout_s=60)
    src = _source_tensors()
    got = {}
    moved = broadcast_buckets(group, META, 256, rank, torch.device("cpu"),
                              get_tensors=lambda ms: [src[m.name] for m in ms],
                              on_received=lambda ms, ts: got.update({m.name: t.clone() for m, t in zip(ms, ts)}))
    queue.put((rank, moved, tensor_checksums(sorted(got.items())) if rank else None))


def test_broadcast_delivers_exact_bytes_to_every_receiver():
    address = SyncAddress("127.0.0.1", free_port(), 3, "gloo")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, address, queue)) for r in range(3)]
    for p in procs:
        p.start()
    results = dict((r, (moved, sums)) for r, moved, sums in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=30)
    expected = tensor_checksums(sorted(_source_tensors().items()))
    total = sum(m.nbytes for m in META)
    assert results[0][0] == total
    for r in (1, 2):
        assert results[r] == (total, expected)
