"""DeepSpeedRank: what every rank of a DeepSpeed ZeRO-1/2/3 group does, whatever it trains.

The trainer (``rl_actors.trainer.TrainerWorker``) and the PPO critic
(``rl_actors.critic.CriticWorker``) are both one rank of such a group, gloo + fp32 on CPU,
NCCL + bf16 on GPU. Each actor holds a ``DeepSpeedRank`` (``self.ds``) and builds its own
fp32 module (a causal LM, a value model); this object holds the engine and does what the
two share.

* **Rendezvous.** Rank 0's actor answers ``rendezvous_endpoint()``: ``(ip, free port)``;
  every rank then calls ``setup(ip, port, module)`` together. Each group (trainers,
  critics) is its own set of processes with its own default process group, so the two
  never share collectives.
* **One reduction per update.** An update may hold any number of micro-batches:
  ``update(passes, run, lr)`` says how many backward passes it makes, and before each
  ``backward`` the rank tells DeepSpeed whether it is the last one
  (``set_gradient_accumulation_boundary``), so gradients reduce once, then ``finish_step``
  steps. DeepSpeed averages gradients over ranks, so the caller multiplies its loss (already
  divided by the step's *global* counts) by the world size.
* **The same passes on every rank.** Shards differ by a row (or a pair) whenever the rows do
  not split evenly, so ranks would make different numbers of micro-batches. ZeRO-2 reduces
  gradients at every backward and ZeRO-3 gathers parameters at every forward: the
  collectives stop matching (gloo aborts with a collective mismatch, NCCL hangs). Every rank
  therefore makes the largest shard's count (``passes``); a rank with fewer rows (or none) makes the
  rest as padding passes, a one-token forward whose loss is multiplied by zero (``padding_backward``),
  and under ZeRO-3 forward-only work is padded the same way (``pad_forwards``).
* **One rank runs without ZeRO's copies.** One fp32 rank runs ZeRO-1/2 as DeepSpeed's stage 0 (torch's
  clip; one optimizer state in its checkpoint), one bf16 rank as ZeRO-1 (``engine_stage``): gradients
  bucketed once per update, not at every backward. A checkpoint loads in a group of its size and stage.
* **Checkpoints.** Every rank writes its DeepSpeed shard (optimizer included) and RNG state into one
  temporary directory that rank 0 renames into the checkpoint (``atomic_directory``): never half-written.
* **Snapshots.** ``snapshot`` is that checkpoint of one rank in memory, its files as byte arrays in the
  object store, outliving this process. A new group of the same size and ZeRO stage ``restore``s every
  rank from all the parts (DeepSpeed reads every rank's optimizer file when it loads).
"""
from __future__ import annotations

import glob
import os
import shutil
from contextlib import nullcontext
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from primitives.io.checkpoint import atomic_directory, capture_rng_state, restore_rng_state
from primitives.model.training import fused_adamw, micro_batch_rows
from primitives.types import ModelConfig
from rl_actors.common import actor_info, describe_model, environ, gpu_visible, setup_process
from rl_actors.reuse import forget_group_registry, peak_rss_mb, remember_group_registry, reset_peak_memory
from rl_actors.scratch import read_tree, scratch, snapshot_bytes, write_tree


def micro_batch_count(rows: int, micro_batch_size: int, unit: int = 1) -> int:
    """How many backward passes ``forward_backward`` makes over ``rows`` rows."""
    step = micro_batch_rows(micro_batch_size, rows, unit)
    return -(-rows // step) if rows else 0


def largest_shard(rows: int, world_size: int, unit: int = 1) -> int:
    """Rows of the largest of ``world_size`` shards of ``rows`` rows split in whole ``unit``s
    (``Batch.shard``, ``np.array_split``: shares differ by at most one unit)."""
    return -(-(rows // unit) // world_size) * unit


def passes(rows: int, world_size: int, micro_batch_size: int, unit: int = 1) -> int:
    """Micro-batch passes every rank makes when ``rows`` rows are sharded over ``world_size``
    ranks: the largest shard's count, so that collectives match on every rank."""
    return micro_batch_count(largest_shard(rows, world_size, unit), micro_batch_size, unit)


class TrainerConfig(NamedTuple):
    """Optimizer and engine settings of a DeepSpeed group (the trainers, or the critics)."""

    zero_stage: int = 2  # 1, 2 or 3
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    adam_eps: float = 1e-8  # AdamW's epsilon
    max_grad_norm: float = 1.0
    micro_batch_size: int = 64  # rows per forward/backward on one rank
    bf16: Optional[bool] = None  # None: bf16 on GPU, fp32 on CPU
    gradient_checkpointing: bool = False  # recompute layers' activations in the backward (training.py)


def adamw(params, cfg: TrainerConfig, lr: Optional[float] = None) -> torch.optim.AdamW:
    """``fused_adamw`` with ``cfg``'s settings (``lr`` in place of ``cfg.lr`` where given)."""
    return fused_adamw(params, lr=cfg.lr if lr is None else lr, betas=tuple(cfg.betas), eps=cfg.adam_eps,
                       weight_decay=cfg.weight_decay)


def engine_stage(zero_stage: int, world_size: int, bf16: bool) -> int:
    """The ZeRO stage DeepSpeed runs: the configured one, except on one rank, where ZeRO partitions
    nothing and only its copies are left (each gradient into a bucket, averaged over a world of one,
    into a flat partition). One fp32 rank runs ZeRO-1/2 as stage 0: SmolLM2's train step went from 1.3x
    a plain loop's to 0.89x on CPU. One bf16 rank runs them as ZeRO-1, the same fp32-master optimizer,
    its gradients bucketed once per update instead of at every backward: on one H200 our train phase
    went 1.20-1.34 -> 0.92 s, 1.41-1.51x a plain loop's -> 1.04x (46.5M parameters; docs/benchmarks.md).
    bf16 keeps ZeRO: stage 0 sums bf16 gradients in bf16 (``test_one_rank_bf16_updates_as_fp32_does``)."""
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
    return (1 if bf16 else 0) if world_size == 1 and zero_stage in (1, 2) else zero_stage


def deepspeed_config(cfg: TrainerConfig, world_size: int, bf16: bool) -> dict:
    stage = engine_stage(cfg.zero_stage, world_size, bf16)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": True,
                              "stage3_param_persistence_threshold": 0},
        # without ZeRO, DeepSpeed clips but keeps no norm: the rank clips (DeepSpeedRank.finish_step)
        "gradient_clipping": cfg.max_grad_norm if stage else 0.0,
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def skip_shm_comm_op() -> None:
    """Keep DeepSpeed's CPU accelerator from JIT-building and loading its shared-memory
    all-reduce op (``deepspeed_shm_comm``) at ``init_distributed``. DeepSpeed calls it only in
    ``inference_all_reduce`` (tensor-parallel inference); ZeRO's collectives go through
    torch.distributed (gloo). Built, it is a C++ compile of about 20 s on two cores, repeated
    whenever another install last used ~/.cache/torch_extensions/py311_cpu (the build
    directory is shared by every install of one Python version)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # DeepSpeed keeps the one dict it probed


def import_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon optimizer module with torch.compile off. DeepSpeed imports it in
    ``initialize`` and in ZeRO's gradient reduction whatever the optimizer, and the module
    decorates three functions with ``torch.compile``, which imports TorchInductor: about 1.2 s
    of CPU per rank. The optimizer here is torch's AdamW, so those functions never run;
    torch.compile is left on for everything else in the process."""
    try:
        with environ({"TORCHDYNAMO_DISABLE": "1"}):  # read when torch.compile decorates
            import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except ImportError:
        pass  # a DeepSpeed without Muon imports no TorchInductor for it either


def rendezvous_endpoint() -> tuple:
    """``(ip, free port)`` on this actor's node: rank 0 hosts the rendezvous stores."""
    import ray

    from rl_actors.weight_sync import free_port

    ip = ray.util.get_node_ip_address()
    return ip, free_port(ip)


class DeepSpeedRank:
    """One rank of a DeepSpeed group, held by the actor that is that rank. ``role`` names
    the actor in ``info`` and errors; ``metric_prefix`` is the namespace of the
    ``grad_norm`` / ``lr`` keys ``finish_step`` reports."""

    def __init__(self, model: ModelConfig, rank: int, world_size: int, config: TrainerConfig = TrainerConfig(),
                 seed: int = 0, num_threads: int = 1, *, role: str, metric_prefix: str = ""):
        setup_process(num_threads, seed)
        self.model_config, self.rank, self.world_size, self.config = model, rank, world_size, config
        self.role, self.metric_prefix = role, metric_prefix
        self.on_gpu = gpu_visible()
        self.bf16 = self.on_gpu if config.bf16 is None else config.bf16
        if not self.on_gpu:  # before anything imports deepspeed (transformers does): it picks its accelerator once
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        self.engine: Any = None  # DeepSpeed's engine and optimizer, built in setup
        self.optimizer: Any = None
        self.frozen = False  # some parameters do not train (LoRA): checkpoints and snapshots leave them out
        self.steps = 0
        self._backwards_left = 0  # micro-batches still to come in the current update
        self.stage = engine_stage(config.zero_stage, world_size, self.bf16)  # the stage DeepSpeed runs
        self.clipped: Optional[list] = None  # the parameters finish_step clips (fp32 without ZeRO), else None
        self.open_passes = 0  # backward passes of an update left open by accumulate (the seeds' forward_backward)

    @property
    def module_device(self) -> str:
        """Where the actor builds its fp32 module, before ``setup``."""
        return "cuda" if self.on_gpu else "cpu"

    def setup(self, master_addr: str, master_port: int, module: torch.nn.Module) -> None:
        """Join this group's process group and wrap ``module`` (fp32, on ``module_device``;
        DeepSpeed casts it for bf16) in the DeepSpeed engine with its AdamW (all ranks together)."""
        os.environ.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(self.rank),
                           "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": "0", "LOCAL_SIZE": "1"})
        import deepspeed

        remember_group_registry()
        if not self.on_gpu:
            skip_shm_comm_op()
        import_muon_uncompiled()
        deepspeed.init_distributed(dist_backend="nccl" if self.on_gpu else "gloo", auto_mpi_discovery=False,
                                   init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                   world_size=self.world_size)
        # what trains: every weight, or with LoRA the adapters alone (the base and a reference adapter are frozen)
        trained = [p for p in module.parameters() if p.requires_grad]
        self.frozen = len(trained) < len(list(module.parameters()))
        optimizer = adamw(trained, self.config)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, config=deepspeed_config(self.config, self.world_size, self.bf16))
        self.device = self.engine.device
        # stage 0 (one rank): nothing to reduce (DeepSpeed would copy each gradient out and back); the rank clips
        self.engine.enable_backward_allreduce, self.clipped = (False, trained) if self.stage == 0 else (True, None)

    def release(self) -> None:
        """Let go of this group (its actor is kept for another job: ``rl_actors.reuse.Reusable``):
        the engine and its optimizer, the process group, and DeepSpeed's registry of groups built
        on it, so that the next ``setup`` joins a new group as a new process would."""
        import torch.distributed as dist

        if self.engine is not None:
            self.engine.destroy()
        self.engine = self.optimizer = None
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        forget_group_registry()
        reset_peak_memory(self.on_gpu)

    def info(self) -> dict:
        return {**actor_info(self.role, self.rank), "zero_stage": self.config.zero_stage, "bf16": self.bf16,
                "engine_stage": self.stage,
                "model": describe_model(self.module) if self.engine is not None else {}}

    @property
    def module(self):
        return self.engine.module

    # --------------------------------------------------------------- one update
    def set_lr(self, lr: Optional[float]) -> None:
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward; the gradients reduce over ranks after the update's last."""
        self._backwards_left -= 1
        self.engine.set_gradient_accumulation_boundary(self._backwards_left <= 0)
        self.engine.backward(loss, scale_wrt_gas=False)

    def _padding_input(self) -> dict:
        """One token (id 0, attended): the cheapest input every model here takes."""
        one = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        return {"input_ids": one, "attention_mask": torch.ones_like(one)}

    def padding_backward(self) -> None:
        """A backward pass that adds nothing: a one-token forward through the engine (so ZeRO-3
        gathers and counts it like a real micro-batch) and its output times zero, which reaches
        every parameter, so the gradient reduction runs as after a real micro-batch."""
        out = self.engine(**self._padding_input())
        self.backward(getattr(out, "logits", out).float().sum() * 0.0)

    @torch.no_grad()
    def pad_forwards(self, made: int, passes: int) -> None:
        """Under ZeRO-3 every forward gathers parameters collectively: after ``made`` forwards
        of forward-only work (old or reference logprobs, values, an eval loss), make discarded
        one-token forwards up to ``passes``, the count of the rank with the most rows. ZeRO-1/2
        forwards are local: nothing to pad."""
        if self.config.zero_stage == 3:
            for _ in range(passes - made):
                self.module(**self._padding_input())

    def update(self, passes: int, run: Optional[Callable[[], dict]], lr: Optional[float]) -> dict:
        """One optimizer update of ``passes`` backward passes, the same count on every rank (at
        least one): ``run()`` makes this rank's micro-batches through ``backward`` and returns
        their metrics, then padding passes (``padding_backward``) make up the count; ``run``
        None is a rank without rows. Then the engine steps (``finish_step``)."""
        self.check_closed("another update")
        self.engine.train()  # every rank's passes alike: a rank without rows recomputes checkpointed layers too
        self._backwards_left = max(1, passes)
        metrics = run() if run is not None else {}
        if self._backwards_left < 0:
            raise RuntimeError(f"{self.role} {self.rank}: made {max(1, passes) - self._backwards_left} backward "
                               f"passes in an update of {max(1, passes)}")
        while self._backwards_left > 0:
            self.padding_backward()
        return self.finish_step(metrics, lr)

    def check_closed(self, what: str) -> None:
        """No update is left open (``rl_actors.open_update``): its gradients would land on other weights."""
        if self.open_passes < 0:
            raise RuntimeError(f"{self.role} {self.rank}: a forward_backward failed part-way here: its update can "
                               f"be neither applied nor continued ({what}); rebuild the trainer group")
        if self.open_passes:
            raise RuntimeError(f"{self.role} {self.rank}: an update left open by forward_backward ({self.open_passes} "
                               f"passes) must be stepped (optim_step) before {what}")

    def finish_step(self, metrics: dict, lr: Optional[float]) -> dict:
        """Step the engine (after the last micro-batch's backward) and add the reduced
        ``grad_norm`` and the ``lr``, under ``metric_prefix``."""
        self.set_lr(lr)
        clipped = None if self.clipped is None else \
            torch.nn.utils.clip_grad_norm_(self.clipped, self.config.max_grad_norm or float("inf"))  # as DeepSpeed
        if clipped is not None and not torch.isfinite(clipped):  # no update, as ZeRO-1/2 skip it (AdamW skips
            for p in self.clipped or ():  # a parameter without a gradient: weights and moments stay)
                p.grad = None
        self.engine.step()
        self.steps += 1
        norm = self.engine.get_global_grad_norm() if clipped is None else clipped
        metrics[self.metric_prefix + "grad_norm"] = float(norm) if norm is not None else float("nan")
        metrics[self.metric_prefix + "lr"] = float(self.optimizer.param_groups[0]["lr"])
        return metrics

    def reset_optimizer(self, lr: Optional[float] = None) -> bool:
        """Forget Adam moments (between SFT and RL, say) and optionally set a new lr."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        inner.state.clear()
        self.set_lr(lr)
        return True

    def memory(self) -> dict:
        """This rank's peak memory so far, in MiB: the process's resident set (``ru_maxrss``: weights,
        optimizer state, activations and the libraries), and on a GPU what torch allocated there. Its
        trained and frozen parameter counts say what the optimizer state covers."""
        params = list(self.module.parameters())
        out = {"peak_rss_mb": peak_rss_mb(),
               "trained_params": sum(full_numel(p) for p in params if p.requires_grad),
               "frozen_params": sum(full_numel(p) for p in params if not p.requires_grad)}
        if self.on_gpu:
            out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
        return out

    # --------------------------------------------------------------- weights
    def gathered(self, names: Sequence[str], modifier_rank: Optional[int] = None):
        """Context in which the named parameters are whole on this rank (ZeRO-3 gathers;
        collective: every rank enters it). With ``modifier_rank`` what that rank writes into them
        is kept (ZeRO-3 partitions it again on the way out)."""
        import deepspeed

        params = dict(self.module.named_parameters())
        chosen = [params[n] for n in names]
        if self.config.zero_stage == 3:
            return deepspeed.zero.GatheredParameters(chosen, modifier_rank=modifier_rank)
        return nullcontext()

    def trained_names(self) -> list:
        """The parameters the optimizer updates (and a weight sync sends): all of them, or the adapters."""
        return [n for n, p in self.module.named_parameters() if p.requires_grad]

    def full_state(self, rank0_only: bool = False, names: Optional[Sequence[str]] = None) -> dict:
        """Every parameter (or those ``names``), gathered, as numpy fp32. All ranks must call it
        under ZeRO-3; with ``rank0_only`` the other ranks only join the gathers and return {}."""
        out, chosen = {}, None if names is None else set(names)
        for name, p in self.module.named_parameters():
            if chosen is not None and name not in chosen:
                continue
            with self.gathered([name]):
                if self.rank == 0 or not rank0_only:
                    out[name] = p.detach().float().cpu().numpy().copy()
        return out

    @torch.no_grad()
    def assign(self, values: dict) -> None:
        """Overwrite the named parameters with ``values`` (name -> tensor, the whole parameter; every
        rank passes the same), cast to each parameter's dtype. Collective under ZeRO-3: all ranks call it."""
        params = dict(self.module.named_parameters())
        with self.gathered(list(values), modifier_rank=0):
            for name, value in values.items():
                params[name].data.copy_(value.to(device=params[name].device, dtype=params[name].dtype))

    # --------------------------------------------------------------- checkpoints
    def save(self, path: str, write: Callable[[str], None]) -> str:
        """Write ``path`` atomically: ``deepspeed/`` (every rank's engine shard, optimizer
        included, and ``rng_rank{r}.pt``) plus whatever ``write(staging_dir)`` adds on rank 0.

        All ranks call this together: each writes its shard into one temporary directory,
        and when all are done rank 0 moves it into the staging directory, runs ``write`` and
        renames the staging directory to ``path``. Anything collective (ZeRO-3 gathers) must
        happen before this call."""
        import torch.distributed as dist

        tmp = path + ".tmp"
        if self.rank == 0 and os.path.exists(tmp):
            shutil.rmtree(tmp)
        dist.barrier()
        self.engine.save_checkpoint(tmp, tag="engine", client_state={"steps": self.steps},
                                    exclude_frozen_parameters=self.frozen)
        torch.save({"rng": capture_rng_state()}, os.path.join(tmp, f"rng_rank{self.rank}.pt"))
        dist.barrier()
        if self.rank == 0:
            def stage(staging: str) -> None:
                os.rename(tmp, os.path.join(staging, "deepspeed"))
                write(staging)
            atomic_directory(path, stage)
        dist.barrier()
        return path

    def load(self, path: str) -> None:
        """Restore the engine shard (weights and optimizer), the step count and the RNG of
        this rank from ``path/deepspeed`` (all ranks call it together)."""
        self.check_closed("a checkpoint is loaded")
        if not os.path.isdir(os.path.join(path, "deepspeed")):
            raise FileNotFoundError(f"{self.role} {self.rank}: {path} is not a {self.role} checkpoint "
                                    f"(no deepspeed/)")
        # another shape of group's files: DeepSpeed would fail deep inside (a KeyError, a None, a size)
        shards = len(glob.glob(os.path.join(path, "deepspeed", "engine", "*zero_pp_rank_*optim_states.pt")))
        if shards != (self.world_size if self.stage else 0):
            wrote = f"{shards} ZeRO optimizer shard(s)" if shards else "one optimizer state, no ZeRO shards (one rank)"
            runs = f"ZeRO-{self.stage}" if self.stage else "without ZeRO"
            raise ValueError(f"{self.role} {self.rank}: {path} holds {wrote}; this group of {self.world_size} rank(s) "
                             f"under zero_stage {self.config.zero_stage} runs {runs}: load it in a group of the size "
                             f"and zero_stage that wrote it")
        _, client = self.engine.load_checkpoint(os.path.join(path, "deepspeed"), tag="engine",
                                                load_module_strict=not self.frozen)
        self.steps = int((client or {}).get("steps", 0))
        rng = torch.load(os.path.join(path, "deepspeed", f"rng_rank{self.rank}.pt"), weights_only=False)
        restore_rng_state(rng["rng"])

    # --------------------------------------------------------------- in-memory snapshots
    def state_bytes(self) -> int:
        """An upper bound of this rank's snapshot: trained parameters, fp32 masters and Adam moments."""
        params = sum(full_numel(p) for p in self.module.parameters() if p.requires_grad)
        return int(params * (4 + 12 / self.world_size))

    def snapshot(self) -> dict:
        """This rank's part of the group's state: its DeepSpeed checkpoint files (as ``save`` writes them)
        as bytes, the step count and the RNG. All ranks call it together (the save is collective); the
        part lives in the driver's object store and outlives this process (``restore``)."""
        with scratch(f"snapshot-{self.role}{self.rank}", self.state_bytes(), self.world_size) as tmp:
            self.engine.save_checkpoint(tmp, tag="engine", client_state={"steps": self.steps}, save_latest=False,
                                        exclude_frozen_parameters=self.frozen)
            files = read_tree(tmp)
        return {"rank": self.rank, "world_size": self.world_size, "zero_stage": self.config.zero_stage,
                "engine_stage": self.stage, "files": files, "steps": self.steps, "rng": capture_rng_state()}

    def restore(self, parts: Sequence[dict]) -> None:
        """Become rank ``self.rank`` of the group whose ``snapshot`` parts (one per rank, any order) are given,
        exactly as it was. All ranks call it together, in a group of the snapshot's size and stages."""
        self.check_closed("a snapshot is restored")
        ranks, stages = sorted(p["rank"] for p in parts), sorted({(p["zero_stage"], p["engine_stage"]) for p in parts})
        if ranks != list(range(self.world_size)) or stages != [(self.config.zero_stage, self.stage)]:
            raise ValueError(f"{self.role} {self.rank}: a snapshot of ranks {ranks} (ZeRO stage, stage run: {stages}) "
                             f"does not fit a group of {self.world_size} ranks under ZeRO-{self.config.zero_stage}, "
                             f"run at stage {self.stage}")
        # every rank writes the whole group's files: its peers on the machine fill shared memory as much
        with scratch(f"restore-{self.role}{self.rank}", sum(snapshot_bytes(p["files"]) for p in parts),
                     self.world_size) as tmp:
            for part in parts:
                write_tree(tmp, part["files"])
            self.engine.load_checkpoint(tmp, tag="engine", load_module_strict=not self.frozen)
        mine = next(p for p in parts if p["rank"] == self.rank)
        self.steps = int(mine["steps"])
        restore_rng_state(mine["rng"])


def full_numel(p: torch.Tensor) -> int:
    """A parameter's whole size, also where ZeRO-3 holds only this rank's partition of it."""
    return p.ds_numel if hasattr(p, "ds_numel") else p.numel()
