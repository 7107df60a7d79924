"""TrainerWorker: one rank of a DeepSpeed ZeRO-1/2/3 engine (gloo + fp32 on CPU, NCCL + bf16 on GPU).

The group plumbing (rendezvous, engine, one gradient reduction per update, checkpoints) is a
``rl_actors.deepspeed_rank.DeepSpeedRank`` the worker holds (``self.ds``), as the PPO critic does;
the worker builds the causal LM and does the policy's work. Every rank receives the whole step
batch by reference, trains on its contiguous shard, and divides its loss by the step's *global*
token / sequence counts; DeepSpeed averages gradients over ranks, so the loss is multiplied by the
world size. Forward passes go through the engine (not ``engine.module``): ZeRO-3 counts
micro-steps in ``engine.forward`` (without it each micro-batch's gradient overwrote the last one).
Rank 0 is the source of the weight broadcast.

With ``reference=True`` (``cluster.reference_on_trainers``) every rank also holds the
reference (``rl_actors.reference.Reference``, a frozen copy of the initial policy in the
model's dtype, not partitioned by ZeRO) and scores its own shard of each batch that arrives
without reference logprobs, once per mini-batch, before the first update; when KL goes in
the reward the driver asks it for the rollouts' reference logprobs first, as it would a
reference worker.

With ``host_generator=True`` (``cluster.generate_on_trainers``, ZeRO-1/2) every rank also hosts a
``GeneratorWorker`` generating with this rank's module (in eval mode meanwhile), reached through
``generate`` / ``generate_multiturn``; a weight sync only stamps its version.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from primitives.maths.algorithms import AlgorithmConfig
from primitives.maths.batching import planned_batch, rollout_metrics
from primitives.model import tied_gradient
from primitives.model.logprobs import rollout_logprobs
from primitives.model.lora import add_reference_adapter, merged_state, save_adapter, with_lora
from primitives.model.training import (
    enable_gradient_checkpointing,
    forward_backward,
    pair_unit,
    sft_eval_loss,
    sft_forward_backward,
    updates_of,
    with_old_logprobs,
)
from primitives.types import Batch, BatchPlan, ModelConfig
from rl_actors.clock import BusyClock
from rl_actors.common import GENERATE_ON_ZERO3, frozen_recompute_error, load_causal_lm, loaded, planned_inputs
from rl_actors.deepspeed_rank import (
    DeepSpeedRank,
    TrainerConfig,
    deepspeed_config,
    largest_shard,
    micro_batch_count,
    passes,
    rendezvous_endpoint,
)
from rl_actors.generator import GeneratorWorker
from rl_actors.open_update import OpenUpdates
from rl_actors.reference import AdapterReference, Reference
from rl_actors.reuse import Reusable
from rl_actors.scratch import snapshot_bytes
from rl_actors.sync_buckets import bucket_buffer, bucket_plan
from rl_actors.weight_sync import (
    DTYPES,
    SyncAddress,
    TensorMeta,
    broadcast_buckets,
    dtype_name,
    init_sync_group,
    join_sync_group,
    raw_broadcast,
    tensor_checksums,
)

__all__ = ["TrainerWorker", "TrainerConfig", "deepspeed_config", "micro_batch_count"]

class TrainerWorker(Reusable, OpenUpdates):
    """One trainer rank: the policy as a causal LM in a DeepSpeed engine (``self.ds``, a ``DeepSpeedRank``, holds
    the group plumbing), RL and SFT updates on this rank's shard, updates left open (``OpenUpdates``), weights sent."""

    role = "trainer"

    def __init__(self, model: ModelConfig, rank: int, world_size: int, config: TrainerConfig = TrainerConfig(),
                 seed: int = 0, num_threads: int = 1, reference: bool = False,
                 ref_update_fn: Optional[Callable] = None, host_generator: bool = False):
        if host_generator and config.zero_stage == 3:
            raise ValueError(f"{self.role} {rank}: {GENERATE_ON_ZERO3}")
        self.ds = DeepSpeedRank(model, rank, world_size, config, seed, num_threads, role=self.role)
        self.rank, self.world_size, self.config, self.seed = rank, world_size, config, seed
        self.with_reference, self.ref_update_fn, self.host_generator = reference, ref_update_fn, host_generator
        self.reference: Optional[Reference] = None  # built in setup
        self.hosted: Optional[GeneratorWorker] = None  # built in setup
        self.sync_group = None
        self.clock = BusyClock()

    def endpoint(self) -> tuple:
        """``(ip, free port)`` on this actor's node: rank 0 hosts the rendezvous stores."""
        return rendezvous_endpoint()

    def setup(self, master_addr: str, master_port: int) -> dict:
        """Load the policy (fp32; DeepSpeed casts it for bf16), join the trainers' process group
        and build the DeepSpeed engine (all ranks together)."""
        refused = frozen_recompute_error(self.ds.model_config.lora.enabled, self.config.zero_stage,
                                         self.config.gradient_checkpointing)
        if refused:
            raise ValueError(f"{self.role} {self.rank}: {refused}")
        module, self.tokenizer = load_causal_lm(
            self.ds.model_config._replace(device=self.ds.module_device, dtype="float32"), f"{self.role} {self.rank}")
        lora = self.ds.model_config.lora
        if lora.enabled:  # the adapters train, the base is frozen (every rank draws the same A from the seed)
            module = with_lora(module, lora)
            if self.with_reference:  # the reference lives in the same module: adapters off, or a frozen adapter
                add_reference_adapter(module)
                initial = {n: p.detach().float().clone() for n, p in module.named_parameters() if p.requires_grad}
        elif self.with_reference:  # a copy before DeepSpeed wraps (and under ZeRO-3 partitions) the policy
            self.reference = Reference(copy.deepcopy(module).to(getattr(torch, self.ds.model_config.dtype)),
                                       self.ref_update_fn)
        if self.config.gradient_checkpointing:  # after the reference's copy: it never trains
            enable_gradient_checkpointing(module, f"{self.role} {self.rank}")
        self.ds.setup(master_addr, master_port, module)
        if lora.enabled and self.with_reference:
            self.reference = AdapterReference(self.module, initial, self.ds.assign, self.ref_update_fn,
                                              collective=self.config.zero_stage == 3)
        if self.host_generator:
            self.hosted = GeneratorWorker.hosted(self.module, self.tokenizer, self.rank, self.seed,
                                                 f"{self.role} {self.rank}", host_clock=self.clock)
        loaded()  # the engine built: what building it freed goes back
        return self.info()

    def info(self) -> dict:
        """The rank's engine (``DeepSpeedRank.info``) and whether its updates fold a tied embedding's gradient
        (``primitives.model.tied_gradient``: a CPU float32 pair outside ZeRO-3)."""
        return {**self.ds.info(), "folds_tied_gradient": tied_gradient.ENABLED and self.ds.engine is not None
                and tied_gradient.tied_pair(self.ds.engine) is not None}

    @property
    def module(self):
        return self.ds.module

    def reset_optimizer(self, lr: Optional[float] = None) -> bool:
        """Forget Adam moments (between SFT and RL, say) and optionally set a new lr."""
        return self.ds.reset_optimizer(lr)

    def full_state(self, rank0_only: bool = False) -> dict:
        """Every parameter, gathered, as numpy fp32 (collective under ZeRO-3; see ``DeepSpeedRank.full_state``)."""
        return self.ds.full_state(rank0_only)

    # --------------------------------------------------------------- training
    def train_step(self, batch: Batch, algo: AlgorithmConfig, temperature: float, lr: Optional[float] = None) -> list:
        """Train on ``batch``: ``algo.ppo_epochs`` passes of ``algo.mini_batches`` optimizer
        updates, each on this rank's shard of a mini-batch of the whole batch. ``temperature``
        is the sampling temperature the rollouts were drawn at. Returns one metric dict per
        update, this rank's shares (``primitives.maths.metrics.merge_rank_updates`` adds the ranks)."""
        unit = pair_unit(algo)
        mbs = self.config.micro_batch_size

        def prepare(part: Batch, fix_old: bool) -> Batch:
            shard = part.shard(self.rank, self.world_size, unit)
            most = micro_batch_count(largest_shard(part.size, self.world_size, unit), mbs)
            if shard.ref_logprobs is None and self.reference is not None:
                # a copy of its own: no collective; the LoRA reference is the policy's module (ZeRO-3: collective,
                # so the padding forwards run with the reference's adapters too)
                pad = (lambda s: self.ds.pad_forwards(micro_batch_count(s.size, mbs), most)) \
                    if self.reference.collective else None
                shard = self.reference.score_batch(shard, temperature, mbs, then=pad)
            if not fix_old:
                return shard
            shard = with_old_logprobs(self.module, shard, temperature, mbs)  # micro-batches of mbs rows, pairs or not
            self.ds.pad_forwards(micro_batch_count(shard.size, mbs), most)
            return shard

        with self.clock.working():
            return [self._update(shard, counts, algo, temperature, lr)
                    for shard, counts in updates_of(batch, algo, prepare)]

    def train_planned(self, plan: BatchPlan, algo: AlgorithmConfig, temperature: float, lr: Optional[float],
                      num_parts: int, *resolved) -> tuple:
        """``train_step`` on the batch ``plan`` names, built here from the parts (and critic value
        shares) that follow it (``rl_actors.common.planned_inputs``): every rank builds the same
        batch and trains on its shard. Returns ``(updates, the batch's rollout_metrics)``, or
        ``([], None)`` when the batch has nothing to train (no update is made)."""
        parts, values = planned_inputs(num_parts, resolved)
        batch = planned_batch(plan, parts, algo, values)
        if batch is None:
            return [], None
        return self.train_step(batch, algo, temperature, lr), rollout_metrics(batch, plan.component_names)

    def busy(self) -> float:
        """Seconds spent in RL updates since the last call (the driver's ``idle/trainers``)."""
        return self.clock.read()

    def memory(self) -> dict:
        """This rank's peak memory and parameter counts (``DeepSpeedRank.memory``)."""
        return self.ds.memory()

    def _update(self, shard: Batch, counts, algo: AlgorithmConfig, temperature: float, lr: Optional[float]) -> dict:
        """One optimizer update on this rank's shard; the loss is divided by global counts. Every
        rank makes the largest shard's number of backward passes (``DeepSpeedRank.update``)."""
        unit = pair_unit(algo)

        def run() -> dict:
            return forward_backward(self.ds.engine, shard, algo, counts, self.config.micro_batch_size, temperature,
                                    backward=self.ds.backward, loss_scale=float(self.world_size),
                                    where=f"{self.role} {self.rank}")

        return self.ds.update(passes(counts.num_rows, self.world_size, self.config.micro_batch_size, unit),
                              run if shard.size else None, lr)

    def sft_step(self, input_ids: np.ndarray, attention_mask: np.ndarray, loss_mask: np.ndarray,
                 lr: Optional[float] = None) -> dict:
        """One SFT optimizer step: this rank's rows, loss normalised by the global target count."""
        num_tokens = int(loss_mask[:, 1:].sum())
        rows = np.array_split(np.arange(len(input_ids)), self.world_size)[self.rank]

        def run() -> dict:
            return sft_forward_backward(self.ds.engine, input_ids[rows], attention_mask[rows], loss_mask[rows],
                                        num_tokens, self.config.micro_batch_size, backward=self.ds.backward,
                                        loss_scale=float(self.world_size))

        return self.ds.update(passes(len(input_ids), self.world_size, self.config.micro_batch_size),
                              run if len(rows) else None, lr)

    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def sft_eval(self, input_ids: np.ndarray, attention_mask: np.ndarray, loss_mask: np.ndarray) -> dict:
        """This rank's share of the held-out SFT loss (no update). Under ZeRO-3 a rank with fewer
        rows (or none) pads its forwards to the largest share's count (``DeepSpeedRank.pad_forwards``)."""
        num_tokens = int(loss_mask[:, 1:].sum())
        mbs = self.config.micro_batch_size
        rows = np.array_split(np.arange(len(input_ids)), self.world_size)[self.rank]
        metrics = sft_eval_loss(self.ds.engine, input_ids[rows], attention_mask[rows], loss_mask[rows], num_tokens,
                                mbs) if len(rows) else {}
        self.ds.pad_forwards(micro_batch_count(len(rows), mbs), passes(len(input_ids), self.world_size, mbs))
        return metrics

    # --------------------------------------------------------------- weights
    def weight_meta(self) -> list:
        """Names, full shapes and dtypes of the parameters that train (what a sync sends): every
        weight, or with LoRA the policy's adapters alone."""
        meta, trained = [], set(self.ds.trained_names())
        for name, p in self.module.named_parameters():
            if name not in trained:
                continue
            shape = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
            dtype = torch.bfloat16 if self.ds.bf16 else torch.float32
            meta.append(TensorMeta(name, shape, dtype_name(dtype)))
        return meta

    def init_weight_sync(self, address: SyncAddress) -> bool:
        """Rank 0 hosts the sync group's store and is its rank 0; other ranks only gather."""
        # gloo carries CPU tensors (a GPU rank sends the adapters to vLLM over gloo: copies on the way)
        self.sync_device = torch.device("cpu") if address.backend == "gloo" else self.ds.device
        if self.rank == 0:
            self.sync_group = join_sync_group(lambda: init_sync_group(address, 0), address)
            return self.sync_group is not None
        return True

    def weight_buckets(self, meta: Sequence[TensorMeta], bucket_bytes: int):
        """``(metas, tensors)`` of each bucket of ``meta`` in order, gathered while used (ZeRO-3:
        collective; one bucket's parameters whole at a time)."""
        params = dict(self.module.named_parameters())
        for idx in bucket_plan(meta, bucket_bytes):
            metas = [meta[i] for i in idx]
            with self.ds.gathered([m.name for m in metas]):
                yield metas, [params[m.name].data for m in metas]

    def send_weights(self, meta: Sequence[TensorMeta], bucket_bytes: int) -> int:
        """All ranks call this (ZeRO-3 gathers are collective); rank 0 broadcasts bucket by bucket,
        to every receiver alike (HF generators, a tracking reference, vLLM on either device), filling
        the next bucket while the last is on the wire (``broadcast_buckets``)."""
        buckets = self.weight_buckets(meta, bucket_bytes)
        if self.rank != 0:
            for _ in buckets:  # the gathers, in step with rank 0's
                pass
            return 0

        def bucket(metas: list) -> list:  # asking for bucket k+1 ends bucket k's gather (copied by then)
            sent, tensors = next(buckets)
            if sent != metas:
                raise RuntimeError(f"weight sync: trainer bucket {[m.name for m in sent][:2]}... where the plan has "
                                   f"{[m.name for m in metas][:2]}...")
            return tensors

        try:
            return broadcast_buckets(self.sync_group, meta, bucket_bytes, 0, self.sync_device, get_tensors=bucket,
                                     buffer=bucket_buffer(meta, bucket_bytes, self.sync_device))
        finally:
            buckets.close()  # the last bucket's gather ends (at once, a failed sync's too)

    def broadcast_probe(self, numel: int, dtype: str = "float32") -> float:
        """Seconds for one raw broadcast of ``numel`` elements in the sync group (a link check
        and the baseline the bucketed sync is measured against)."""
        return raw_broadcast(self.sync_group, numel, DTYPES[dtype], 0, self.sync_device)

    def weight_checksums(self) -> dict:
        """sha1 of each parameter a sync sends (``weight_meta``), as the generators compute theirs."""
        sums, params = {}, dict(self.module.named_parameters())
        for name in self.ds.trained_names():
            p = params[name]
            with self.ds.gathered([name]):
                sums.update(tensor_checksums([(name, p.data)]))
        return sums

    def logprobs(self, rollouts: Sequence, temperature: float) -> list:
        """Trainer-side logprobs of rollouts at the sampling temperature (the parity check
        against generators). Under ZeRO-3 the forward is collective: call it on every rank."""
        return rollout_logprobs(self.module, rollouts, self.tokenizer.pad_token_id, temperature)

    # --------------------------------------------------------------- the reference it holds
    def _held_reference(self) -> Reference:
        if self.reference is None:
            raise RuntimeError(f"{self.role} {self.rank} holds no reference (cluster.reference_on_trainers is off)")
        return self.reference

    def _alone_check(self) -> None:
        """A LoRA reference under ZeRO-3 is the partitioned policy module: it cannot score a chunk alone."""
        if self._held_reference().collective:
            raise RuntimeError(f"{self.role} {self.rank}: a LoRA reference under ZeRO-3 scores in collective "
                               "forwards, so it cannot score a chunk of rollouts alone (KL in the reward); use "
                               "cluster.zero_stage 1 or 2")

    def _policy_state(self) -> dict:
        """What the reference reads of the policy: every weight, or with LoRA its adapters (gathered)."""
        names = self.ds.trained_names() if self.ds.frozen else None
        return {k: torch.from_numpy(v) for k, v in self.ds.full_state(names=names).items()}

    def move_reference(self, step: int, kl: Optional[float] = None) -> bool:
        """``ref_update_fn`` on this rank's copy of the reference, from the policy as it stands
        (every rank does the same, so the copies stay equal; a collective under ZeRO-3)."""
        self._held_reference().move(self._policy_state(), step, kl)
        return True

    def copy_policy_to_reference(self) -> bool:
        """The reference becomes the policy as it stands (after SFT, say; collective under ZeRO-3)."""
        self._held_reference().load(self._policy_state())
        return True

    def reference_logprobs(self, rollouts: Sequence, temperature: float) -> list:
        """Reference logprobs ``(T_i,)`` of rollouts, before a batch is made (KL in the reward):
        this rank's copy serves as a reference worker would (no collective: any rank, any chunk)."""
        self._alone_check()
        return self._held_reference().rollout_arrays(rollouts, self.tokenizer.pad_token_id, temperature,
                                                     self.config.micro_batch_size)

    def reference_logprobs_counted(self, rollouts: Sequence, temperature: float) -> tuple:
        """``(count, reference logprobs)`` as two results (``RefLogprobWorker.logprobs_counted``)."""
        arrays = self.reference_logprobs(rollouts, temperature)
        return len(arrays), arrays

    def with_reference_logprobs(self, rollouts: Sequence, temperature: float) -> list:
        """The rollouts with ``ref_logprobs`` set (new records)."""
        self._alone_check()
        return self._held_reference().scored(rollouts, self.tokenizer.pad_token_id, temperature,
                                             self.config.micro_batch_size)

    def save_reference(self, path: str) -> str:
        return self._held_reference().save(path)

    def load_reference_from(self, path: str) -> bool:
        self._held_reference().load_from(path)
        return True

    def reference_checksums(self) -> dict:
        return self._held_reference().checksums()

    # --------------------------------------------------------------- the generator it hosts
    def _hosted_generator(self) -> GeneratorWorker:
        if self.hosted is None:
            raise RuntimeError(f"{self.role} {self.rank} hosts no generator (cluster.generate_on_trainers is off)")
        return self.hosted

    def generate(self, items: Sequence, gen) -> list:
        """Rollouts of ``items`` from the generator this rank hosts (``cluster.generate_on_trainers``),
        sampled with this rank's module; the generation counts as this rank's busy time."""
        return self._hosted_generator().generate(items, gen)

    def generate_multiturn(self, items: Sequence, gen, tools) -> list:
        return self._hosted_generator().generate_multiturn(items, gen, tools)

    def generator_version(self, version: int) -> int:
        """A weight sync for the hosted generator: it holds this rank's weights already, so only
        the version its rollouts carry moves."""
        return self._hosted_generator().receive_weights((), 0, version)

    def generator_info(self) -> dict:
        return self._hosted_generator().info()

    def generator_busy(self) -> float:
        """Seconds the hosted generator spent generating since the last call."""
        return self._hosted_generator().busy()

    # --------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str, train_state: Optional[dict] = None, extra_dirs: Optional[dict] = None) -> str:
        """DeepSpeed shards (optimizer included) + an HF copy of the weights + RNG, atomically.

        Every rank writes its shard into one temporary directory that rank 0 renames when all
        are done; the driver calls this on all ranks together. ``extra_dirs`` (name -> finished
        directory, e.g. the reference weights or a critic checkpoint) are moved into the
        checkpoint in the same rename.
        """
        state = {name: torch.from_numpy(v) for name, v in self.full_state().items()}  # collective under ZeRO-3
        lora = self.ds.model_config.lora

        def write(staging: str) -> None:
            if lora.enabled:  # the adapters as PEFT loads them, and merged into a plain HF model
                save_adapter(self.module, os.path.join(staging, "adapter"), state)
                self.tokenizer.save_pretrained(os.path.join(staging, "adapter"))
                self.module.get_base_model().save_pretrained(os.path.join(staging, "hf"),
                                                             state_dict=merged_state(state, lora))
            else:
                self.module.save_pretrained(os.path.join(staging, "hf"), state_dict=state)
            self.tokenizer.save_pretrained(os.path.join(staging, "hf"))
            for name, directory in (extra_dirs or {}).items():
                os.rename(directory, os.path.join(staging, name))
            with open(os.path.join(staging, "train_state.json"), "w") as f:
                json.dump(train_state or {}, f)

        return self.ds.save(path, write)

    def snapshot(self) -> tuple:
        """``(bytes, part)``: this rank's part of the group's in-memory snapshot
        (``DeepSpeedRank.snapshot``) and its size; rank 0's part also holds the reference it
        keeps (every rank's copy is the same)."""
        part = self.ds.snapshot()
        if self.reference is not None and self.rank == 0:
            part["reference"] = self.reference.snapshot()
        return snapshot_bytes(part), part

    def restore(self, *parts: dict) -> bool:
        """Become this rank of the group whose snapshot ``parts`` are given (all ranks together):
        weights, optimizer, step count, RNG and the reference copy as they were."""
        self.ds.restore(parts)
        if self.reference is not None:
            self.reference.restore(next(p["reference"] for p in parts if "reference" in p))
        return True

    def load_checkpoint(self, path: str) -> dict:
        """Restore weights, optimizer, step count and RNG; returns the saved ``train_state``."""
        self.ds.load(path)
        with open(os.path.join(path, "train_state.json")) as f:
            return json.load(f)
