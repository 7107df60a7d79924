"""An actor kept for another job (``rl_actors.reuse.Reusable``), in one process without Ray: a
trainer rank released and rebuilt joins a new process group and trains as a new rank does (the
same losses and weights, step by step, though DeepSpeed keeps a registry of the groups it built);
release drops what the job built; the peak memory a kept rank reports is its own job's."""
import sys

import numpy as np
import pytest
import torch

from primitives.types import ModelConfig
from rl_actors.critic import CriticWorker
from rl_actors.reuse import Reusable, peak_rss_mb, reset_peak_memory
from rl_actors.trainer import TrainerConfig, TrainerWorker
from rl_actors.weight_sync import free_port


class Counter(Reusable):
    def __init__(self, start: int):
        self.value = start
        self.draw = torch.rand(1).item()


def test_rebuild_runs_the_constructor_afresh_and_release_drops_the_job():
    c = Counter(3)
    c.value += 1
    c.extra = "left from the job"
    assert c.release() is True and vars(c) == {}
    torch.manual_seed(0)
    seeded = torch.rand(1).item()
    torch.manual_seed(0)
    assert c.rebuild(start=7) is True and vars(c).keys() == {"value", "draw"} and c.value == 7
    assert c.draw != seeded  # torch's global generator was seeded afresh, as a new process's is


class Cyclic:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


class JobWithACycle(Reusable):
    def __init__(self):
        self.held = Cyclic()


@pytest.mark.parametrize("in_actor", [True, False])
def test_release_collects_the_jobs_cycles_and_freezes_what_survives_in_an_actor(monkeypatch, in_actor):
    """In an actor, what survives the first release (the process's imports) is frozen out of every
    later collection, once: the next job's reference cycles are collected at its own release, and
    nothing it leaves is frozen. Outside an actor the caller's heap is left unfrozen."""
    import gc
    import weakref

    import rl_actors.reuse as reuse

    monkeypatch.setattr(reuse, "ray_actor_id", lambda: "an actor" if in_actor else "")
    gc.unfreeze()
    try:
        frozen, survivor = [], []
        for _ in range(2):  # a first job, then a job on the kept actor
            survivor.append(Cyclic())  # what a job leaves alive (a cache it filled)
            job = JobWithACycle()
            cycle = weakref.ref(job.held)
            gc.disable()  # no automatic collection in between: the release's own must free the cycle
            try:
                assert job.release() is True
                assert cycle() is None
            finally:
                gc.enable()
            frozen.append(gc.get_freeze_count())
            assert (frozen[-1] > 0) is in_actor
        assert frozen[1] <= frozen[0]  # the second release froze nothing more (frozen objects freed leave)
        tracked = {id(o) for o in gc.get_objects()}  # the collector's generations, not the frozen ones
        assert (id(survivor[0]) in tracked) is not in_actor and id(survivor[1]) in tracked
    finally:
        gc.unfreeze()  # the test process's heap back as it was


def batch(seed: int):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 40, size=(4, 10))
    mask = np.ones_like(ids)
    loss = np.zeros_like(ids)
    loss[:, 5:] = 1
    return ids, mask, loss


def three_steps(worker: TrainerWorker) -> tuple:
    worker.setup("127.0.0.1", free_port("127.0.0.1"))
    losses = [worker.sft_step(*batch(s))["loss/sft"] for s in range(3)]
    numbers = ([getattr(m, "ds_id", -1) for m in worker.module.modules()],
               [getattr(p, "ds_id", -1) for p in worker.module.parameters()])  # ZeRO-3's, else -1
    return losses, {k: v.detach().clone() for k, v in worker.module.state_dict().items()}, numbers


@pytest.mark.no_ray
@pytest.mark.slow  # DeepSpeed's import and six engines: 15 s, more than the fast tier's tests take
@pytest.mark.parametrize("stages", [(2, 2), (2, 3), (3, 3)], ids=["zero2-zero2", "zero2-zero3", "zero3-zero3"])
def test_a_released_trainer_rank_trains_as_a_new_one(tiny_model_path, stages):
    model = ModelConfig(tiny_model_path)
    new = TrainerWorker(model, 0, 1, TrainerConfig(zero_stage=stages[1], lr=1e-2), seed=0)
    fresh = three_steps(new)  # the comparison first: before this process ran any other job
    new.release()
    first = TrainerWorker(model, 0, 1, TrainerConfig(zero_stage=stages[0], lr=1e-2), seed=0)
    before = three_steps(first)
    assert torch.distributed.is_initialized()
    assert first.release() is True and not torch.distributed.is_initialized()
    first.rebuild(model=model, rank=0, world_size=1, config=TrainerConfig(zero_stage=stages[1], lr=1e-2), seed=0)
    kept = three_steps(first)
    first.release()
    assert kept[0] == fresh[0] and len(set(kept[0])) == 3  # the losses of every step, exactly (and they move)
    assert all(torch.equal(kept[1][k], fresh[1][k]) for k in fresh[1])
    assert before[0][0] == fresh[0][0]  # the same first step whatever ZeRO stage
    # ZeRO-3 numbers parameters and modules per process, and its ranks check that they agree: a kept
    # rank numbers from 0 as a new one does, after a ZeRO-3 job of its own too (a group of kept and
    # new ranks failed "Detected a disagreement on list contents between rank0 and rank1")
    assert kept[2] == fresh[2] and (stages[1] != 3 or max(kept[2][0]) > 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")
def test_the_peak_memory_starts_afresh_after_a_release():
    """256 MB mapped, touched and unmapped by hand: malloc's settings do not matter (an actor built in this
    process earlier, ``reuse_freed_memory``, keeps freed blocks mapped), nor the process's earlier peak."""
    import mmap

    reset_peak_memory(on_gpu=False)
    before = peak_rss_mb()
    block = mmap.mmap(-1, 256 * 2 ** 20)
    for page in range(0, len(block), mmap.PAGESIZE):  # touch every page: resident
        block[page] = 1
    high = peak_rss_mb()
    assert high > before + 200
    block.close()
    reset_peak_memory(on_gpu=False)
    assert peak_rss_mb() < high - 200


def test_freed_memory_is_reused_where_asked_and_given_back_on_release():
    """``reuse_freed_memory`` (an actor's ``setup_process`` calls it): an 80 MB array filled again
    after one was freed faults in almost none of its 20480 pages; in a plain process each fills
    every page anew (glibc maps a block that large on its own and unmaps it when freed).
    ``return_free_memory`` (a kept actor's release) hands the freed 80 MB back to the system.
    Subprocesses: the test's own malloc is left as it is."""
    import subprocess

    code = ("import sys; from rl_actors.common import refaults, reuse_freed_memory, setup_process\n"
            "setup_process(needs_torch=False)  # outside an actor: malloc left alone\n"
            "if sys.argv[1] == 'reuse': assert reuse_freed_memory()\n"
            "print(*refaults())")
    got = {}
    for mode in ("plain", "reuse"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        got[mode] = [float(x) for x in out.stdout.split()]
    (first, second, _, _), (r_first, r_second, held, after) = got["plain"], got["reuse"]
    # 4 KB pages here (transparent huge pages on request only); where they are always on, 2 MB pages
    # fault fewer times, alike in both fills
    assert first > 0 and second >= 0.9 * first  # every fill faults in its pages
    assert r_first > 0 and r_second <= 0.05 * r_first  # the second fill finds them mapped
    assert held - after >= 70  # the freed 80 MB went back


@pytest.mark.no_ray
@pytest.mark.slow  # DeepSpeed's import and two engines
def test_an_actor_hands_back_what_loading_freed(tiny_model_path, monkeypatch):
    """In an actor the heap keeps what tensors free (above), so the model's load and the trainer
    rank's and the critic's setups (their DeepSpeed engines built) each end by giving its free pages back
    (``rl_actors.common.loaded``); in the caller's own process neither does. The actor is
    simulated: its id set, no heartbeat thread."""
    import rl_actors.common as common

    calls: list = []
    monkeypatch.setattr(common, "return_free_memory", lambda: calls.append("trim") or True)
    monkeypatch.setattr(common, "start_heartbeat", lambda: False)  # no thread, no mallopt in this process
    for in_actor in (False, True):
        actor_id = "an actor" if in_actor else ""
        monkeypatch.setattr(common, "ray_actor_id", lambda actor_id=actor_id: actor_id)
        worker = TrainerWorker(ModelConfig(tiny_model_path), 0, 1, TrainerConfig(zero_stage=2, lr=1e-2), seed=0)
        worker.setup("127.0.0.1", free_port("127.0.0.1"))
        assert calls == (["trim", "trim"] if in_actor else [])  # after the load, after the engine
        worker.release()
        critic = CriticWorker(ModelConfig(tiny_model_path), 0, 1, TrainerConfig(zero_stage=2, lr=1e-2), seed=0)
        critic.setup("127.0.0.1", free_port("127.0.0.1"))
        assert calls == (["trim", "trim", "trim"] if in_actor else [])  # after the value model and its engine
        critic.release()
        calls.clear()
