"""The reference model: reference logprobs for rollouts, on the same tokens the policy sampled.

``Reference`` is the model and what it does: score rollouts (or a trainer's batch) at the
sampling temperature, move by ``ref_update_fn``, load and save. Two kinds of actor hold one:

* ``RefLogprobWorker`` - the reference as actors of its own (``cluster.reference_workers``),
  scoring the rollouts side by side with the reward workers.
* ``rl_actors.trainer.TrainerWorker`` with ``cluster.reference_on_trainers`` - every trainer
  rank holds a copy and scores its own shard of the step's batch inside the train step: no
  reference process, no reference phase, no logprobs through the object store (when KL goes
  in the reward, the ranks score the rollouts first, as reference workers would).

The reference is frozen by default. With a ``ref_update_fn`` (EMA, periodic reset, KL-bound
reset - ``primitives.maths.kl``) it moves at every RL step: ``ref_update_fn(ref_state,
policy_weights, step, kl)``. A reference worker then joins the weight-sync group and receives
the policy's weights; a trainer rank reads its own.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from primitives.maths.kl import RefState, apply_ref_state, ref_state_from_model
from primitives.model.logprobs import rollout_logprobs
from primitives.types import Batch, ModelConfig
from rl_actors.common import actor_info, describe_model, load_causal_lm, setup_process
from rl_actors.weight_sync import SyncAddress, TensorMeta, broadcast_buckets, init_sync_group, tensor_checksums


class Reference:
    """A frozen causal LM (eval mode, no gradients) and, with ``ref_update_fn``, its
    ``RefState`` (the weights the update function reads and returns)."""

    def __init__(self, model: torch.nn.Module, ref_update_fn: Optional[Callable] = None):
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model, self.ref_update_fn = model, ref_update_fn
        self.state = ref_state_from_model(model) if ref_update_fn is not None else None

    @property
    def tracks_policy(self) -> bool:
        return self.ref_update_fn is not None

    def rollout_arrays(self, rollouts: Sequence, pad_id: int, temperature: float,
                       micro_batch_size: Optional[int] = None) -> list:
        """``(T_i,)`` float32 reference logprobs of each rollout's completion tokens, at the
        sampling ``temperature`` the policy's logprobs use (a KL between two temperatures is not 0)."""
        if not rollouts:
            return []
        return list(rollout_logprobs(self.model, rollouts, pad_id, temperature, micro_batch_size))

    def scored(self, rollouts: Sequence, pad_id: int, temperature: float,
               micro_batch_size: Optional[int] = None) -> list:
        """The rollouts with ``ref_logprobs`` set (new records)."""
        arrays = self.rollout_arrays(rollouts, pad_id, temperature, micro_batch_size)
        return [r._replace(ref_logprobs=lp) for r, lp in zip(rollouts, arrays, strict=True)]

    def score_batch(self, batch: Batch, temperature: float, micro_batch_size: Optional[int] = None) -> Batch:
        """``batch`` with ``ref_logprobs`` set (0 off the loss mask), at ``temperature``."""
        from primitives.model.training import with_logprobs

        return with_logprobs(self.model, batch, "ref_logprobs", temperature, micro_batch_size)

    def move(self, policy: dict, step: int, kl: Optional[float] = None) -> None:
        """Let ``ref_update_fn`` decide the new reference from the policy's weights (name -> tensor)."""
        self.state = self.ref_update_fn(self.state, policy, step, kl)
        apply_ref_state(self.model, self.state)

    def load(self, weights: dict) -> None:
        """Replace the reference with given weights (name -> array or tensor), e.g. the SFT model;
        a tracking reference's update function starts again from them."""
        state = RefState({k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))
                          for k, v in weights.items()},
                         self.state.last_reset_step if self.state else 0)
        apply_ref_state(self.model, state)
        if self.state is not None:
            self.state = ref_state_from_model(self.model, state.last_reset_step)

    def save(self, path: str) -> str:
        """The reference model in HF format (it may differ from the policy: SFT model, EMA)."""
        self.model.save_pretrained(path)
        return path

    def load_from(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=self.model.dtype)
        self.load({k: v.detach() for k, v in loaded.named_parameters()})

    def checksums(self) -> dict:
        return tensor_checksums(self.model.named_parameters())

    def snapshot(self) -> dict:
        """What the reference is now, for a replacement to become (``restore``): its weights
        (tensors by name, in the model's dtype) and, when it tracks the policy, the update
        function's state."""
        if self.state is not None:
            return {"weights": {k: v.detach().cpu().clone() for k, v in self.state.weights.items()},
                    "last_reset_step": self.state.last_reset_step}
        return {"weights": {k: v.detach().cpu().clone() for k, v in self.model.named_parameters()}}

    def restore(self, snap: dict) -> None:
        """Become the reference ``snapshot`` described: the same weights and update state."""
        state = RefState(snap["weights"], int(snap.get("last_reset_step", 0)))
        apply_ref_state(self.model, state)
        if self.state is not None:
            self.state = RefState({k: v.to(self.model.device).clone() for k, v in state.weights.items()},
                                  state.last_reset_step)


class RefLogprobWorker:
    """The reference as an actor of its own (one of ``cluster.reference_workers``)."""

    role = "reference"

    def __init__(self, model: ModelConfig, rank: int = 0, ref_update_fn: Optional[Callable] = None,
                 micro_batch_size: Optional[int] = None, num_threads: int = 1):
        setup_process(num_threads)
        self.rank, self.micro_batch_size = rank, micro_batch_size
        loaded, self.tokenizer = load_causal_lm(model, f"reference {rank}")
        self.reference = Reference(loaded, ref_update_fn)
        self.sync_group, self.sync_rank = None, None

    @property
    def model(self):
        return self.reference.model

    def info(self) -> dict:
        return {**actor_info(self.role, self.rank), "model": describe_model(self.model)}

    @property
    def tracks_policy(self) -> bool:
        return self.reference.tracks_policy

    def with_ref_logprobs(self, rollouts: Sequence, temperature: float) -> list:
        """The rollouts with ``ref_logprobs`` set (new records), scored at the sampling ``temperature``."""
        return self.reference.scored(rollouts, self.tokenizer.pad_token_id, temperature, self.micro_batch_size)

    def logprobs(self, rollouts: Sequence, temperature: float) -> list:
        """The reference logprobs, ``(T_i,)`` float32 each, as every ``logprobs`` of an actor
        returns them (the trainer ranks join them to the reward worker's records, scored side by
        side)."""
        return self.reference.rollout_arrays(rollouts, self.tokenizer.pad_token_id, temperature,
                                             self.micro_batch_size)

    def logprobs_counted(self, rollouts: Sequence, temperature: float) -> tuple:
        """``(count, logprobs)``: as two results, the driver waits for the small count (and
        sees a failure there) while the arrays stay in the object store for the trainer ranks."""
        arrays = self.logprobs(rollouts, temperature)
        return len(arrays), arrays

    def init_weight_sync(self, address: SyncAddress, rank: int) -> bool:
        self.sync_group, self.sync_rank = init_sync_group(address, rank), rank
        return True

    def receive_weights(self, meta: Sequence[TensorMeta], bucket_bytes: int, step: int,
                        kl: Optional[float] = None, move: bool = True) -> int:
        """Receive the policy and let ``ref_update_fn`` decide the new reference. With ``move``
        false (a sync that only refreshes generators: after a checkpoint load or a replaced
        generator) the reference joins the broadcast, a collective of the whole group, and
        stays where it is."""
        policy = {}

        def keep(metas, tensors):
            policy.update({m.name: t.clone() for m, t in zip(metas, tensors)})

        moved = broadcast_buckets(self.sync_group, meta, bucket_bytes, self.sync_rank, torch.device("cpu"),
                                  on_received=keep if move else None)
        if move:
            self.reference.move(policy, step, kl)
        return moved

    def weight_checksums(self) -> dict:
        return self.reference.checksums()

    def load_weights(self, weights: dict) -> bool:
        """Replace the reference with given weights (name -> array), e.g. the SFT model."""
        self.reference.load(weights)
        return True

    def save_weights(self, path: str) -> str:
        return self.reference.save(path)

    def load_weights_from(self, path: str) -> bool:
        self.reference.load_from(path)
        return True

    def snapshot(self) -> tuple:
        """``(bytes, state)``: what this reference is now (``Reference.snapshot``) and its size."""
        from rl_actors.deepspeed_rank import snapshot_bytes

        state = self.reference.snapshot()
        return snapshot_bytes(state), state

    def restore(self, snap: dict) -> bool:
        self.reference.restore(snap)
        return True
