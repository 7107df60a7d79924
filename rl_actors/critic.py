"""CriticWorker: one rank of the PPO critic's DeepSpeed ZeRO-1/2/3 group (PPO only).

The critic is a value model (``primitives.model.value.ValueModel``: the policy's backbone, or a
reward model's, with a scalar head) trained by its own AdamW in its own DeepSpeed engine.
Critic ranks rendezvous among themselves exactly as trainers do (rank 0's ``endpoint()``,
then ``setup(ip, port)`` on every rank; the ``rl_actors.deepspeed_rank.DeepSpeedRank`` each
worker holds does that plumbing, as the trainer's does), so the critic group is sharded
like the trainer group but never shares a collective with it.

Per PPO step the driver:

1. asks for values of the rollouts: ``values_share(rollouts)`` on every rank, each rank
   computing its contiguous ``np.array_split`` share, then ``concat_value_shares`` of the
   results in rank order (``values(rollouts)`` computes all of them on one rank);
2. builds the batch (``make_batch(rollouts, algo, pad_id, values=values)``: GAE gives the
   advantages and the returns);
3. calls ``value_step(batch, algo)`` on every rank, beside the trainers' ``train_step``: the
   clipped value loss over the same PPO epochs x mini-batches as the policy, one optimizer
   update each, each rank on its shard, the loss divided by the mini-batch's global token
   count and multiplied by the world size (DeepSpeed averages gradients over ranks).
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import numpy as np
import torch

from primitives.maths.algorithms import AlgorithmConfig
from primitives.maths.batching import planned_batch
from primitives.model.training import enable_gradient_checkpointing, updates_of
from primitives.model.value import (
    rollout_values,
    save_value_model,
    value_forward_backward,
    value_model_from_policy,
    value_model_from_reward_model,
)
from primitives.types import Batch, BatchPlan, ModelConfig, planned_rollouts
from rl_actors.common import check_model_path, loaded, planned_inputs
from rl_actors.deepspeed_rank import (
    DeepSpeedRank,
    TrainerConfig,
    micro_batch_count,
    passes,
    rendezvous_endpoint,
)
from rl_actors.reuse import Reusable
from rl_actors.scratch import snapshot_bytes


def concat_value_shares(per_rank: Sequence[Sequence[np.ndarray]]) -> list:
    """The values of all rollouts from the ranks' ``values_share`` results, given in rank
    order (the shares are contiguous slices of the rollout list)."""
    return [v for share in per_rank for v in share]


class CriticWorker(Reusable):
    """One critic rank: a value model in a DeepSpeed engine (``self.ds``, a ``DeepSpeedRank``,
    holds the group plumbing). ``model`` is the policy's ``ModelConfig`` (its tokenizer, and its
    backbone when ``init="policy"``); ``init`` is ``"policy"`` or the directory of an HF
    sequence-classification reward model with one label, whose backbone and score head
    become the value model. ``head_init_std`` > 0 draws a policy-initialised head from a
    normal (seeded by ``seed``) instead of zeros. ``config`` is the critic's own optimizer
    and engine settings (its lr, ZeRO stage, micro-batch size)."""

    role = "critic"

    def __init__(self, model: ModelConfig, rank: int, world_size: int, config: TrainerConfig = TrainerConfig(),
                 seed: int = 0, num_threads: int = 1, init: str = "policy", head_init_std: float = 0.0):
        check_model_path(model.model_name_or_path, f"critic {rank}")
        if init != "policy" and not os.path.isdir(init):
            raise FileNotFoundError(f"critic {rank}: init must be 'policy' or a reward model directory, got "
                                    f"'{init}' (not a directory)")
        # critic/grad_norm, critic/lr: apart from the policy's keys
        self.ds = DeepSpeedRank(model, rank, world_size, config, seed, num_threads, role=self.role,
                                metric_prefix="critic/")
        self.rank, self.world_size, self.config = rank, world_size, config
        self.init, self.head_init_std, self.seed = init, head_init_std, seed

    def endpoint(self) -> tuple:
        """``(ip, free port)`` on this actor's node: rank 0 hosts the rendezvous stores."""
        return rendezvous_endpoint()

    def setup(self, master_addr: str, master_port: int) -> dict:
        """Build the value model (fp32; DeepSpeed casts it for bf16), join the critics' process
        group and build the DeepSpeed engine (all ranks together)."""
        from transformers import AutoTokenizer

        path = self.ds.model_config.model_name_or_path
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=self.ds.model_config.trust_remote_code)
        if self.init == "policy":
            module = value_model_from_policy(path, head_init_std=self.head_init_std, dtype=torch.float32,
                                             seed=self.seed)
        else:
            module = value_model_from_reward_model(self.init, dtype=torch.float32)
        if self.config.gradient_checkpointing:
            enable_gradient_checkpointing(module, f"critic {self.rank}")
        self.ds.setup(master_addr, master_port, module.to(self.ds.module_device))
        loaded()  # the value model and the engine built: what building them freed goes back
        return self.info()

    def info(self) -> dict:
        return {**self.ds.info(), "init": self.init}

    @property
    def module(self):
        return self.ds.module

    def pad_token_id(self) -> int:
        tok = self.tokenizer
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

    # --------------------------------------------------------------- values
    def values(self, rollouts: Sequence) -> list:
        """Values of every rollout, one (T_i,) float32 array each, computed on this rank.
        Under ZeRO-1/2 one rank suffices; under ZeRO-3 the forward is collective, so every
        rank must call it (prefer ``values_share`` there: the work is split)."""
        return rollout_values(self.module, rollouts, self.pad_token_id(), self.config.micro_batch_size)

    def values_share(self, rollouts: Sequence) -> list:
        """This rank's contiguous share of the rollouts' values (``np.array_split`` of the
        list over the ranks). The driver calls it on every rank with the same list and joins
        the results in rank order with ``concat_value_shares``.

        Under ZeRO-3 each forward gathers parameters collectively, so a rank with fewer
        micro-batches than the largest share (or no rollouts at all) pads with discarded
        forwards until every rank has made the same number (``DeepSpeedRank.pad_forwards``)."""
        mbs = self.config.micro_batch_size
        mine = np.array_split(np.arange(len(rollouts)), self.world_size)[self.rank]
        share = [rollouts[i] for i in mine]
        out = self.values(share) if share else []
        self.ds.pad_forwards(micro_batch_count(len(share), mbs), passes(len(rollouts), self.world_size, mbs))
        return out

    # --------------------------------------------------------------- training
    def values_planned(self, plan: BatchPlan, num_parts: int, *resolved) -> list:
        """``values_share`` of the rollouts ``plan`` names (the parts follow it)."""
        parts, _ = planned_inputs(num_parts, resolved)
        return self.values_share(planned_rollouts(plan, parts))

    def value_step_planned(self, plan: BatchPlan, algo: AlgorithmConfig, num_parts: int, *resolved) -> list:
        """``value_step`` on the batch ``plan`` names, built here as the trainer ranks build it
        (the parts, then every critic rank's value share); [] when it has nothing to train."""
        parts, values = planned_inputs(num_parts, resolved)
        batch = planned_batch(plan, parts, algo, values)
        return [] if batch is None else self.value_step(batch, algo)

    def value_step(self, batch: Batch, algo: AlgorithmConfig, lr: Optional[float] = None) -> list:
        """Train the value model on ``batch`` (with ``values``, the rollout-time values, and
        ``returns`` from GAE): ``algo.ppo_epochs`` passes of ``algo.mini_batches`` updates,
        the same updates as the policy's, each on this rank's shard, the loss clipped by
        ``algo.value_clip``. Returns one metric dict per update, this rank's shares plus the
        reduced ``critic/grad_norm`` and ``critic/lr``
        (``primitives.maths.metrics.merge_rank_updates`` adds the ranks)."""
        if batch.values is None or batch.returns is None:
            raise ValueError(f"critic {self.rank}: value_step needs batch.values and batch.returns (build the batch "
                             f"with make_batch(..., values=...) and an algorithm whose advantage_fn is GAE)")

        def prepare(part: Batch, fix_old: bool) -> Batch:
            return part.shard(self.rank, self.world_size)  # the clip's anchor is batch.values: nothing to fix

        return [self._update(shard, counts, algo.value_clip, lr)
                for shard, counts in updates_of(batch, algo, prepare)]

    def _update(self, shard: Batch, counts, clip: float, lr: Optional[float]) -> dict:
        """One optimizer update on this rank's shard; the loss is divided by global counts. Every
        rank makes the largest shard's number of backward passes (``DeepSpeedRank.update``)."""
        def run() -> dict:
            return value_forward_backward(self.ds.engine, shard, counts, clip, self.config.micro_batch_size,
                                          backward=self.ds.backward, loss_scale=float(self.world_size))

        return self.ds.update(passes(counts.num_rows, self.world_size, self.config.micro_batch_size),
                              run if shard.size else None, lr)

    # --------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str) -> str:
        """The critic's DeepSpeed shards (optimizer included) and RNG under ``deepspeed/``, an
        HF-style value model (``primitives.model.value.save_value_model``, with the tokenizer) under
        ``hf/`` and ``critic.json``, atomically. All ranks call it together. To keep it with
        the policy's checkpoint, pass the finished directory to the trainer's
        ``save_checkpoint(..., extra_dirs={"critic": path})``."""
        hf_tmp = path + ".hf.tmp"
        with self.ds.gathered([name for name, _ in self.module.named_parameters()]):  # collective under ZeRO-3
            if self.rank == 0:
                save_value_model(self.module, hf_tmp)
                self.tokenizer.save_pretrained(hf_tmp)

        def write(staging: str) -> None:
            os.rename(hf_tmp, os.path.join(staging, "hf"))
            with open(os.path.join(staging, "critic.json"), "w") as f:
                json.dump({"steps": self.ds.steps, "init": self.init}, f)

        return self.ds.save(path, write)

    def full_state(self, rank0_only: bool = False) -> dict:
        """Every parameter of the value model, gathered, as numpy fp32 (collective under ZeRO-3)."""
        return self.ds.full_state(rank0_only)

    def snapshot(self) -> tuple:
        """``(bytes, part)``: this rank's part of the critic group's in-memory snapshot
        (``DeepSpeedRank.snapshot``) and its size."""
        part = self.ds.snapshot()
        return snapshot_bytes(part), part

    def restore(self, *parts: dict) -> bool:
        """Become this rank of the critic group whose snapshot ``parts`` are given (all ranks together)."""
        self.ds.restore(parts)
        return True

    def load_checkpoint(self, path: str) -> dict:
        """Restore the value model, its optimizer, the step count and the RNG (all ranks
        together, into a group of the same ZeRO stage and size); returns ``critic.json``."""
        self.ds.load(path)
        with open(os.path.join(path, "critic.json")) as f:
            return json.load(f)
