"""RefLogprobWorker: reference logprobs for rollouts, on the same tokens the policy sampled.

The reference is frozen by default. With a ``ref_update_fn`` (EMA, periodic reset, KL-bound
reset - ``primitives.kl``) it joins the weight-sync group, receives the policy's weights
at every sync and applies ``ref_update_fn(ref_state, policy_weights, step, kl)``.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from cluster.weight_sync import SyncAddress, TensorMeta, broadcast_buckets, init_sync_group, tensor_checksums
from primitives.kl import apply_ref_state, ref_state_from_model
from primitives.logprobs import rollout_logprobs
from primitives.types import ModelConfig
from rl_actors.common import actor_info, describe_model, load_causal_lm, setup_process


class RefLogprobWorker:
    role = "reference"

    def __init__(self, model: ModelConfig, rank: int = 0, ref_update_fn: Optional[Callable] = None,
                 micro_batch_size: Optional[int] = None, num_threads: int = 1):
        setup_process(num_threads)
        self.rank, self.micro_batch_size = rank, micro_batch_size
        self.model, self.tokenizer = load_causal_lm(model, f"reference {rank}")
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.ref_update_fn = ref_update_fn
        self.ref_state = ref_state_from_model(self.model) if ref_update_fn is not None else None
        self.sync_group, self.sync_rank = None, None

    def info(self) -> dict:
        return {**actor_info(self.role, self.rank), "model": describe_model(self.model)}

    @property
    def tracks_policy(self) -> bool:
        return self.ref_update_fn is not None

    def logprobs(self, rollouts: Sequence, temperature: float) -> list:
        """The rollouts with ``ref_logprobs`` set (new records), scored at the sampling
        ``temperature`` the policy's logprobs use (a KL between two temperatures is not 0)."""
        return [r._replace(ref_logprobs=lp) for r, lp in zip(rollouts, self.logprob_arrays(rollouts, temperature),
                                                              strict=True)]

    def logprob_arrays(self, rollouts: Sequence, temperature: float) -> list:
        """Only the reference logprobs, ``(T_i,)`` float32 each (the driver merges them with
        the reward worker's records, scored side by side)."""
        if not rollouts:
            return []
        return list(rollout_logprobs(self.model, rollouts, self.tokenizer.pad_token_id, temperature,
                                     self.micro_batch_size))

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
        if not move:
            return moved
        self.ref_state = self.ref_update_fn(self.ref_state, policy, step, kl)
        apply_ref_state(self.model, self.ref_state)
        return moved

    def weight_checksums(self) -> dict:
        return tensor_checksums(self.model.named_parameters())

    def load_weights(self, weights: dict) -> bool:
        """Replace the reference with given weights (name -> array), e.g. the SFT model."""
        from primitives.kl import RefState

        state = RefState({k: torch.from_numpy(np.array(v)) for k, v in weights.items()},
                         self.ref_state.last_reset_step if self.ref_state else 0)
        apply_ref_state(self.model, state)
        if self.ref_state is not None:
            self.ref_state = ref_state_from_model(self.model, state.last_reset_step)
        return True

    def save_weights(self, path: str) -> str:
        """The reference model in HF format (it may differ from the policy: SFT model, EMA)."""
        self.model.save_pretrained(path)
        return path

    def load_weights_from(self, path: str) -> bool:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=self.model.dtype)
        return self.load_weights({k: v.detach().numpy() for k, v in loaded.named_parameters()})
