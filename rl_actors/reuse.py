"""What an actor process keeps from one job to the next, and what it must let go of: an actor kept
for the driver's next cluster (``cluster.ray_wing.pool``) drops its job (``Reusable.release``) and
is built again (``rebuild``); DeepSpeed's registry of process groups and the process's peak-memory
count start afresh with it."""
from __future__ import annotations

import copy
import sys

from rl_actors.common import ray_actor_id, return_free_memory


class Reusable:
    """An actor a driver may keep for its next cluster of the same shape (``cluster.ray_wing.pool``):
    ``release`` drops what this job built (models, engines, process groups); ``rebuild`` then runs
    the constructor again with the next job's keywords, in the same process, whose imports (torch,
    transformers, DeepSpeed: 6-8 s of CPU) are already paid. A rebuilt actor computes what a new
    one would: the constructor sets every seed, and torch's global generator is seeded afresh, as a
    new process's is."""

    def release(self) -> bool:
        """Drop this job's state. False: this actor cannot be reused (the driver kills it)."""
        import gc

        if not self.reusable():
            return False  # killed as it is: nothing to tear down first
        ds = getattr(self, "ds", None)  # a DeepSpeed rank (trainer, critic): its engine and process groups
        if ds is not None:
            ds.release()
        for name in list(vars(self)):
            delattr(self, name)
        torch = sys.modules.get("torch")
        if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        gc.collect()  # the job's reference cycles (DeepSpeed's hooks and closures, the process groups)
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()  # what the job's model and engine held, cycles included, goes back to the device
        if ray_actor_id():
            return_free_memory()  # an actor keeps the memory its job freed (reuse_freed_memory); not while it waits
        if ray_actor_id() and gc.get_freeze_count() == 0:
            # at the first release, what survives is the process's imports (400k objects in a trainer
            # with torch, transformers and DeepSpeed: 0.4 s a full collection here): no collection
            # scans them again. Once only, so that nothing a later job leaves is frozen with them;
            # only in an actor: the caller's own heap is not ours to freeze
            gc.freeze()
        return True

    def reusable(self) -> bool:
        return True

    def rebuild(self, **kwargs) -> bool:
        """This actor as ``type(self)(**kwargs)`` would start it."""
        if vars(self):
            self.release()
        if "torch" in sys.modules:  # a new process draws its global generator's seed from the OS
            sys.modules["torch"].seed()
        type(self).__init__(self, **kwargs)
        return True


_GROUP_REGISTRY: dict = {}  # deepspeed.utils.groups' module state before any group was built


def remember_group_registry() -> None:
    """Note, once per process, DeepSpeed's registry of process groups (``deepspeed.utils.groups``:
    data-parallel, expert and mesh groups, ``mpu``) as it stands before any group is built."""
    if not _GROUP_REGISTRY:
        from deepspeed.utils import groups

        _GROUP_REGISTRY.update({k: copy.copy(v) for k, v in vars(groups).items()
                                if not k.startswith("__") and (v is None or isinstance(v, (dict, list)))})


def forget_group_registry() -> None:
    """Put DeepSpeed's registry of process groups back as ``remember_group_registry`` found it: the
    groups of a destroyed process group are not valid in the next. ZeRO-3's counters of parameters
    and modules start at 0 again too: every rank checks that its peers number their modules alike,
    and a new process numbers from 0, so a kept rank beside a new one must as well."""
    if _GROUP_REGISTRY:
        from deepspeed.utils import groups

        for name, value in _GROUP_REGISTRY.items():
            setattr(groups, name, copy.copy(value))
    zero3 = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if zero3 is not None:
        zero3.Init.param_id = 0
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None:  # its module counter is the mutable default of the method that numbers them
        offload.DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0][0] = 0


def peak_rss_mb() -> float:
    """This process's peak resident set in MiB since it started or since ``reset_peak_memory``: Linux's
    ``VmHWM``, elsewhere ``ru_maxrss`` (since the start)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        import resource

        per_mib = 2 ** 20 if sys.platform == "darwin" else 2 ** 10  # bytes on macOS, KiB elsewhere
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / per_mib


def reset_peak_memory(on_gpu: bool) -> None:
    """Start this process's peak memory afresh (a kept actor's next job reports its own): Linux
    resets ``VmHWM`` when ``5`` is written to ``/proc/self/clear_refs``; torch its CUDA peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    if on_gpu:
        import torch

        torch.cuda.reset_peak_memory_stats()
