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

import contextlib
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from primitives.io.checkpoint import load_tracking_state, save_tracking_state
from primitives.maths.kl import RefState, apply_ref_state, ref_state_from_model
from primitives.model.logprobs import rollout_logprobs
from primitives.types import Batch, ModelConfig
from rl_actors.common import actor_info, describe_model, load_causal_lm, setup_process
from rl_actors.reuse import Reusable
from rl_actors.sync_buckets import bucket_buffer
from rl_actors.weight_sync import (
    SyncAddress,
    TensorMeta,
    broadcast_buckets,
    init_sync_group,
    join_sync_group,
    tensor_checksums,
)


class Reference:
    """A frozen causal LM (eval mode, no gradients) and, with ``ref_update_fn``, its
    ``RefState`` (the weights the update function reads and returns)."""

    collective = False  # a model of its own: any rank scores any rollouts alone

    def __init__(self, model: torch.nn.Module, ref_update_fn: Optional[Callable] = None):
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model, self.ref_update_fn = model, ref_update_fn
        self.state = ref_state_from_model(model) if ref_update_fn is not None else None

    @property
    def tracks_policy(self) -> bool:
        return self.ref_update_fn is not None

    def _scoring(self):
        """What holds while the reference scores: nothing for a model of its own (``AdapterReference``
        switches the shared module's adapters)."""
        return contextlib.nullcontext()

    def rollout_arrays(self, rollouts: Sequence, pad_id: int, temperature: float,
                       micro_batch_size: Optional[int] = None) -> list:
        """``(T_i,)`` float32 reference logprobs of each rollout's completion tokens, at the
        sampling ``temperature`` the policy's logprobs use (a KL between two temperatures is not 0)."""
        if not rollouts:
            return []
        with self._scoring():
            return list(rollout_logprobs(self.model, rollouts, pad_id, temperature, micro_batch_size))

    def scored(self, rollouts: Sequence, pad_id: int, temperature: float,
               micro_batch_size: Optional[int] = None) -> list:
        """The rollouts with ``ref_logprobs`` set (new records)."""
        arrays = self.rollout_arrays(rollouts, pad_id, temperature, micro_batch_size)
        return [r._replace(ref_logprobs=lp) for r, lp in zip(rollouts, arrays, strict=True)]

    def score_batch(self, batch: Batch, temperature: float, micro_batch_size: Optional[int] = None,
                    then: Optional[Callable[[Batch], None]] = None) -> Batch:
        """``batch`` with ``ref_logprobs`` set (0 off the loss mask), at ``temperature``. ``then(scored)``
        runs before the reference is left: a ZeRO-3 rank's padding forwards must gather the same
        modules (the same adapter) as its peers' scoring forwards."""
        from primitives.model.training import with_logprobs

        with self._scoring():
            scored = with_logprobs(self.model, batch, "ref_logprobs", temperature, micro_batch_size)
            if then is not None:
                then(scored)
            return scored

    def move(self, policy: dict, step: int, kl: Optional[float] = None) -> None:
        """Let ``ref_update_fn`` decide the new reference from the policy's weights (name -> tensor)."""
        self.state = self._update_fn()(self.state, policy, step, kl)
        apply_ref_state(self.model, self.state)

    def _update_fn(self) -> Callable:
        if self.ref_update_fn is None:
            raise RuntimeError("a fixed reference (no ref_update_fn) does not move")
        return self.ref_update_fn

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
        """The reference model in HF format (it may differ from the policy: SFT model, EMA) and, for
        one that tracks the policy, its update state beside it (``TRACKING_STATE``: the step of its
        last reset, and its float32 weights where the model holds them narrower), so a resumed job
        moves it as the job that saved it would have (a periodic reset at the same steps)."""
        self.model.save_pretrained(path)
        if self.state is not None:
            save_tracking_state(path, self.model, self.state.weights, self.state.last_reset_step)
        return path

    def load_from(self, path: str) -> None:
        """The reference ``save`` wrote to ``path`` (a directory without ``TRACKING_STATE``: a tracking
        reference starts its update state from the weights, its last reset at step 0)."""
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=self.model.dtype)
        self.load({k: v.detach() for k, v in loaded.named_parameters()})
        saved = load_tracking_state(path, self.model.device) if self.state is not None else None
        if self.state is not None and saved is not None:
            self.state = RefState({**self.state.weights, **saved[0]}, saved[1])

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


class AdapterReference(Reference):
    """The reference of a LoRA policy, held by each trainer rank inside the policy's own module: no
    second model. Until it is set or moves it is the base model, scored with the adapters off; once
    set (the SFT stage's policy, ``load``) or moved by ``ref_update_fn`` (EMA, periodic reset, on
    adapter weights) it is a second, frozen adapter ``"reference"`` of the module
    (``primitives.model.lora``), scored with that adapter on.

    ``weights`` (the reference adapter by the *policy* adapter's names, fp32, whole on every rank)
    is the state; ``assign(values)`` writes it into the module's reference adapter (a collective
    under ZeRO-3, as is every forward there: ``collective``). ``initial`` is the policy's starting
    adapter (``B`` zero, so the same function as the base model): a tracking reference's first
    ``ref_update_fn`` call starts from it."""

    def __init__(self, module: torch.nn.Module, initial: dict, assign: Callable[[dict], None],
                 ref_update_fn: Optional[Callable] = None, collective: bool = False):
        from primitives.model.lora import REFERENCE

        if REFERENCE not in module.peft_config:
            raise ValueError("AdapterReference: the module has no reference adapter (build it with "
                             "primitives.model.lora.add_reference_adapter before DeepSpeed wraps it)")
        self.model, self._assign = module, assign
        self.initial = {k: torch.as_tensor(v).detach().float().cpu().clone() for k, v in initial.items()}
        self.policy_names = sorted(self.initial)
        self.ref_update_fn, self.collective = ref_update_fn, collective
        self.state: Optional[RefState] = None  # None: the base model (adapters off)

    @contextlib.contextmanager
    def _scoring(self):
        """Eval mode (no adapter dropout) and the reference's adapters: off, or the reference adapter on."""
        from primitives.model.lora import REFERENCE, active_adapter, adapters_off

        training = self.model.training
        self.model.eval()
        try:
            with adapters_off(self.model) if self.state is None else active_adapter(self.model, REFERENCE):
                yield
        finally:
            self.model.train(training)

    def _set(self, weights: dict, last_reset_step: int) -> None:
        """The reference becomes the adapter ``weights`` (policy adapter names -> tensor)."""
        from primitives.model.lora import POLICY, REFERENCE, renamed

        missing = set(self.policy_names) - set(weights)
        if missing:
            raise KeyError(f"reference adapter state lacks {sorted(missing)[:3]}")
        fp32 = {k: (v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))).detach().float().cpu()
                for k, v in weights.items() if k in set(self.policy_names)}
        self.state = RefState(fp32, last_reset_step)
        self._assign({renamed(k, POLICY, REFERENCE): v for k, v in fp32.items()})

    def move(self, policy: dict, step: int, kl: Optional[float] = None) -> None:
        """``ref_update_fn`` on the adapter weights (name -> tensor of the policy's adapter). Before
        its first move the reference is the policy's starting adapter (``B`` zero: the base model)."""
        current = self.state if self.state is not None else RefState(dict(self.initial), 0)
        new = self._update_fn()(current, {k: torch.as_tensor(v).float() for k, v in policy.items()}, step, kl)
        self._set(new.weights, new.last_reset_step)

    def load(self, weights: dict) -> None:
        """The reference becomes the given policy adapter (the SFT stage's policy, say)."""
        self._set(weights, self.state.last_reset_step if self.state is not None else 0)

    def save(self, path: str) -> str:
        """``reference_adapter.safetensors`` (the adapter by the policy's names), or, while the
        reference is the base model, ``reference.json`` saying so."""
        import json
        import os

        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        if self.state is None:
            with open(os.path.join(path, "reference.json"), "w") as f:
                json.dump({"reference": "base model (adapters off)"}, f)
        else:
            save_file({k: v.contiguous() for k, v in self.state.weights.items()},
                      os.path.join(path, "reference_adapter.safetensors"),
                      metadata={"last_reset_step": str(self.state.last_reset_step)})
        return path

    def load_from(self, path: str) -> None:
        import os

        from safetensors import safe_open

        file = os.path.join(path, "reference_adapter.safetensors")
        if not os.path.isfile(file):
            self.state = None  # saved while it was the base model
            return
        with safe_open(file, "pt") as f:
            weights = {k: f.get_tensor(k) for k in f.keys()}
            step = int((f.metadata() or {}).get("last_reset_step", 0))
        self._set(weights, step)

    def checksums(self) -> dict:
        if self.state is None:
            return {"reference": "base model (adapters off)"}
        return tensor_checksums(sorted(self.state.weights.items()))

    def snapshot(self) -> dict:
        if self.state is None:
            return {"base": True}
        return {"weights": {k: v.clone() for k, v in self.state.weights.items()},
                "last_reset_step": self.state.last_reset_step}

    def restore(self, snap: dict) -> None:
        """Become what ``snapshot`` described (all ranks together under ZeRO-3: it writes the adapter)."""
        if snap.get("base"):
            self.state = None
        else:
            self._set(snap["weights"], int(snap.get("last_reset_step", 0)))


class RefLogprobWorker(Reusable):
    """The reference as an actor of its own (one of ``cluster.reference_workers``)."""

    role = "reference"

    def __init__(self, model: ModelConfig, rank: int = 0, ref_update_fn: Optional[Callable] = None,
                 micro_batch_size: Optional[int] = None, num_threads: int = 1):
        setup_process(num_threads)
        self.rank, self.micro_batch_size = rank, micro_batch_size
        loaded, self.tokenizer = load_causal_lm(model, f"reference {rank}")
        self.reference = Reference(loaded, ref_update_fn)
        self.sync_group = None  # set by init_weight_sync
        self.sync_rank: Optional[int] = None

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
        self.sync_rank = rank
        self.sync_group = join_sync_group(lambda: init_sync_group(address, rank), address)
        return self.sync_group is not None

    def receive_weights(self, meta: Sequence[TensorMeta], bucket_bytes: int, step: int,
                        kl: Optional[float] = None, move: bool = True) -> int:
        """Receive the policy and let ``ref_update_fn`` decide the new reference. With ``move``
        false (a sync that only refreshes generators: after a checkpoint load or a replaced
        generator) the reference joins the broadcast, a collective of the whole group, and
        stays where it is."""
        policy = {}

        def keep(metas, tensors):
            policy.update({m.name: t.clone() for m, t in zip(metas, tensors)})

        cpu = torch.device("cpu")
        moved = broadcast_buckets(self.sync_group, meta, bucket_bytes, self.sync_rank, cpu,
                                  on_received=keep if move else None, buffer=bucket_buffer(meta, bucket_bytes, cpu))
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
        from rl_actors.scratch import snapshot_bytes

        state = self.reference.snapshot()
        return snapshot_bytes(state), state

    def restore(self, snap: dict) -> bool:
        self.reference.restore(snap)
        return True
