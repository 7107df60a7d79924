"""What every actor does on start-up: pin threads, load a model by path, report where it runs."""
from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
from typing import Optional, Sequence

from primitives.types import ModelConfig

# said by the job's config check (cluster.jobs) and by a trainer rank built with ZeRO-3 from Python
GENERATE_ON_ZERO3 = ("cluster.generate_on_trainers needs cluster.zero_stage 1 or 2: under ZeRO-3 a rank holds only a "
                     "shard of the weights it would generate with")


# the DeepSpeed release tested recomputing frozen weights under ZeRO-3 (a LoRA base with gradient checkpointing);
# earlier ones freed a frozen weight inside the recompute, and torch's checkpoint refused it in the backward
# (CheckpointError: "saved {'shape': [1024]} vs recomputed {'shape': [0]}"; DeepSpeed PR 8148, July 2026)
FROZEN_RECOMPUTE_DEEPSPEED = (0, 19, 8)


def frozen_recompute_error(lora: bool, zero_stage: int, checkpointing: bool,
                           deepspeed_version: Optional[str] = None) -> Optional[str]:
    """Why LoRA (a frozen base) under ZeRO-3 with gradient checkpointing cannot run on this DeepSpeed
    (``FROZEN_RECOMPUTE_DEEPSPEED``), or None. ``deepspeed_version``: the installed one unless given."""
    if not (lora and zero_stage == 3 and checkpointing):
        return None
    if deepspeed_version is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            deepspeed_version = version("deepspeed")
        except PackageNotFoundError:
            return None  # no DeepSpeed here (the driver of a cluster elsewhere): the ranks check it themselves
    release = tuple(int(x) for x in re.findall(r"\d+", deepspeed_version)[:3])
    if release >= FROZEN_RECOMPUTE_DEEPSPEED:
        return None
    return (f"cluster.gradient_checkpointing with model.lora under cluster.zero_stage 3 needs DeepSpeed "
            f"{'.'.join(map(str, FROZEN_RECOMPUTE_DEEPSPEED))} or later, which keeps a frozen base weight gathered "
            f"while a layer is recomputed (earlier releases free it, and the backward fails with a CheckpointError); "
            f"this is DeepSpeed {deepspeed_version}: upgrade it, or use cluster.zero_stage 2, or no checkpointing")


def planned_inputs(num_parts: int, resolved: Sequence) -> tuple:
    """``(parts, values)`` from the trailing arguments of a planned call (``BatchPlan``):
    ``num_parts`` pairs - a chunk of scored rollouts and its reference-logprob arrays or None -
    then the critic ranks' value shares, joined in rank order (None when there are none)."""
    parts = [tuple(resolved[2 * i: 2 * i + 2]) for i in range(num_parts)]
    shares = resolved[2 * num_parts:]
    return parts, ([v for share in shares for v in share] if shares else None)


HEARTBEAT_KEY = "rayrl/heartbeat/"  # + the actor's id: a count in Ray's key-value store, raised every HEARTBEAT_EVERY_S
HEARTBEAT_EVERY_S = 2.0


_BEATING: set = set()  # the actor ids whose heartbeat thread runs in this process (one each)


def ray_actor_id() -> str:
    """This process's Ray actor id; empty outside a Ray actor (or where Ray is not imported)."""
    ray_module = sys.modules.get("ray")  # None where Ray was blocked from importing (the GPU check does that)
    if ray_module is None or not ray_module.is_initialized():
        return ""
    return ray_module.get_runtime_context().get_actor_id() or ""


def start_heartbeat(every_s: float = HEARTBEAT_EVERY_S) -> bool:
    """In a Ray actor, a daemon thread that raises this actor's count in Ray's key-value store every
    ``every_s`` seconds, in a long call too. It stops when the process does not run: stopped
    (SIGSTOP), or hung in native code that holds the interpreter. The driver takes an actor whose
    count has not moved for ``cluster.heartbeat_s`` for stuck (``cluster.ray_wing.groups``), long
    before ``cluster.call_timeout_s``. Outside an actor it does nothing (False); an actor rebuilt
    for another job (``Reusable``) keeps the thread it has."""
    actor = ray_actor_id()
    if not actor:
        return False
    import threading
    import time

    from ray.experimental.internal_kv import _internal_kv_put

    if actor in _BEATING:
        return True
    _BEATING.add(actor)
    key = (HEARTBEAT_KEY + actor).encode()

    def beat() -> None:
        count = 0
        while True:
            count += 1
            try:
                _internal_kv_put(key, str(count).encode(), overwrite=True)
            except Exception:  # Ray shutting down: the driver reads a stale count only if it still waits
                pass
            time.sleep(every_s)

    threading.Thread(target=beat, name="rayrl-heartbeat", daemon=True).start()
    return True


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4


def _glibc():
    """The C library where it is glibc (``mallopt``, ``malloc_trim``), else None (musl, macOS)."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def reuse_freed_memory() -> bool:
    """Keep the memory that large CPU tensors free in the process, for the next ones. glibc's
    malloc serves a block over its mmap threshold (at most 32 MB) with pages of its own, unmapped
    when freed, so every later tensor of that size faults in new pages: a 79 MB logits tensor
    (400 tokens x SmolLM2's 49k vocabulary) costs 33 ms of page faults each time, against 3 ms to
    fill one already mapped. Here the main heap serves every block and its top is not given back
    (up to 2 GB), as a caching allocator keeps a GPU's memory (a thread's own arena still maps a
    block over 64 MB; torch's tensors come from the calling thread, the actor's main one). A
    trainer step of SmolLM2 on CPU took 11 % less (docs/benchmarks.md, 2026-11-29). The process
    keeps its peak; what loading freed goes back once a model or engine is built (``loaded``), and
    a kept actor hands the free part back between jobs (``return_free_memory``). False where the C
    library is not glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))


def refaults(mb: int = 80) -> tuple:
    """Minor page faults of filling an ``mb`` MB block from ``malloc`` (as torch's CPU tensors
    get theirs), freeing it, and filling one again: the second is near 0 where freed memory is
    reused (``reuse_freed_memory``), near the first where each large block gets new pages. And
    the resident MB before and after ``return_free_memory``. glibc only."""
    import ctypes
    import resource

    libc = _glibc()
    if libc is None:
        raise RuntimeError("refaults: the C library is not glibc")
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]

    def fill() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(ctypes.c_size_t(mb * 2 ** 20))
        ctypes.memset(block, 1, mb * 2 ** 20)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        libc.free(block)
        return faults

    def resident_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20

    first, second = fill(), fill()
    held = resident_mb()
    return_free_memory()
    return first, second, held, resident_mb()


def return_free_memory() -> bool:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``); False where the C
    library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)  # 1 if it gave memory back, 0 if there was none to give
    return True


def loaded() -> None:
    """In an actor, after a model or engine is built: what loading freed (a checkpoint read, a
    conversion on the host before a move to the GPU) goes back to the system now, since the heap
    otherwise keeps it for the whole job (``reuse_freed_memory``)."""
    if ray_actor_id():
        return_free_memory()


def setup_process(num_threads: int = 1, seed: Optional[int] = None, needs_torch: bool = True) -> None:
    """One actor per core: more torch threads than cores oversubscribes the machine badly.
    An actor that may never need torch (a reward worker running plain Python) passes
    ``needs_torch=False`` and saves its import (about a second of CPU); a torch imported there
    later still starts with ``num_threads`` threads (``OMP_NUM_THREADS``, read at its import).
    In a Ray actor, its heartbeat starts (``start_heartbeat``) and freed memory stays in the
    process (``reuse_freed_memory``: the process is ours; a caller's own process is left as it is)."""
    if start_heartbeat():
        reuse_freed_memory()
    os.environ["OMP_NUM_THREADS"] = str(max(1, num_threads))
    if needs_torch or "torch" in sys.modules:
        import torch

        torch.set_num_threads(max(1, num_threads))
        if seed is not None:
            torch.manual_seed(seed)


def check_model_path(path: str, role: str) -> None:
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{role}: model path '{path}' is not a directory with config.json "
                                f"(pass a local Hugging Face checkpoint)")


def load_causal_lm(config: ModelConfig, role: str):
    """``(model, tokenizer)`` from a local HF checkpoint; the error names the actor role."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primitives.model.logprobs import disable_dropout

    check_model_path(config.model_name_or_path, role)
    if config.device == "auto":
        config = config._replace(device="cuda" if gpu_visible() else "cpu")
    kwargs = {"dtype": getattr(torch, config.dtype), "trust_remote_code": config.trust_remote_code}
    if config.attn_implementation:
        kwargs["attn_implementation"] = config.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(config.model_name_or_path, **kwargs).to(config.device)
    disable_dropout(model)  # every logprob forward of every role is deterministic
    tokenizer = AutoTokenizer.from_pretrained(config.model_name_or_path, trust_remote_code=config.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    loaded()
    return model, tokenizer


def describe_model(model) -> dict:
    """What an actor actually loaded: dtype, device, attention implementation and whether its layers
    recompute their activations in the backward (a value model's: its backbone's)."""
    p = next(model.parameters())
    return {"dtype": str(p.dtype).replace("torch.", ""), "device": str(p.device),
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "gradient_checkpointing": bool(getattr(getattr(model, "backbone", model), "is_gradient_checkpointing",
                                                   False))}


def actor_info(role: str, rank: int) -> dict:
    """Where this actor runs (for placement tests and error messages): the Ray node and GPUs
    inside a Ray worker; only the process and host when an actor class is driven directly
    (``benchmarks/gpu_check.py``: no Ray is started, nor need it be installed)."""
    info = {"role": role, "rank": rank, "pid": os.getpid(), "host": socket.gethostname()}
    try:
        import ray
    except ImportError:
        return info
    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        info.update(node_id=ctx.get_node_id(), gpus=ray.get_gpu_ids())
    return info


def gpu_visible() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


@contextlib.contextmanager
def environ(values: dict):
    """``os.environ`` with ``values`` set inside the block and restored after it (processes
    started inside it inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
