"""The local backend of the RL loop: everything in this process, plain torch, no Ray.

``train(LocalBackend(...), ...)`` is the notebook user's loop (the seeds' ``train(...)``):
the same ``cluster.loop.train.train`` that drives a Ray cluster, over the same primitives. The
policy generates with the weights it trains (a Ray generator holds an exact copy, synced
after every step), the reference is a frozen copy (or moved by ``ref_update_fn`` at each
sync), rewards run here, and a critic (PPO) is a value model with its own optimizer. The
same seed and config give the same metrics as a 1-generator, 1-trainer Ray cluster on a CPU in
float32 (architecture section 8, invariant 7): the sampler of each call is seeded as a Ray generator
seeds it. A model it loads computes in float32 (``check_float32`` refuses a lower precision asked
for); on a GPU a Ray trainer rank trains in bf16 by default, so there the two differ by that.
"""
from __future__ import annotations

import os
import time
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from cluster.loop.protocol import Held, StepResult, plan_parts
from primitives.env.rewards import score_rollouts
from primitives.env.tools import hf_turns_generator, multiturn_rollouts
from primitives.hooks import check_arity
from primitives.io.checkpoint import (
    atomic_directory,
    load_checkpoint,
    load_model_weights,
    load_tracking_state,
    save_checkpoint,
    save_model_weights,
    save_tracking_state,
)
from primitives.maths.algorithms import AlgorithmConfig
from primitives.maths.batching import planned_batch, rollout_metrics
from primitives.maths.filters import kept_indices
from primitives.maths.kl import apply_ref_state, create_reference_model, ref_state_from_model
from primitives.model.generation import generate_rollouts
from primitives.model.logprobs import disable_dropout, rollout_logprobs
from primitives.model.training import (
    enable_gradient_checkpointing,
    optim_step,
    sft_eval_loss,
    sft_forward_backward,
    train_on_batch,
)
from primitives.types import BatchPlan, GenerationConfig, ModelConfig, TrainState, planned_rollouts, summarize
from rl_actors.common import load_causal_lm
from rl_actors.deepspeed_rank import adamw
from rl_actors.hf_engine import rollout_sampler
from rl_actors.trainer import TrainerConfig


def loaded_tokenizer(model):
    """The tokenizer of a loaded model's checkpoint directory (``model.name_or_path``); an
    error naming ``tokenizer=`` when there is none."""
    from transformers import AutoTokenizer

    path = getattr(model, "name_or_path", "") or ""
    if not os.path.isdir(path):
        raise ValueError(f"LocalBackend: a loaded model needs its tokenizer (tokenizer=...); the model's "
                         f"name_or_path {path!r} is not a local directory to load one from")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def freeze(model):
    """``model`` frozen in place (no gradients, eval mode, dropout off): a reference."""
    disable_dropout(model)
    return create_reference_model(model, ref_model_fn=lambda m: m)


def check_float32(config: ModelConfig, trainer: TrainerConfig) -> None:
    """A model LocalBackend loads computes in float32 on every device: a job's lower precision
    (``model.dtype``, the generators' and the reference's on Ray; ``TrainerConfig.bf16``, the
    trainer ranks') is refused, naming the field, rather than dropped in silence."""
    wants = [f"model.dtype is {config.dtype!r}"] if config.dtype != "float32" else []
    wants += ["TrainerConfig.bf16 is True"] if trainer.bf16 else []
    if wants:
        raise ValueError(f"LocalBackend: {' and '.join(wants)}, but the local backend loads its policy, reference "
                         f"and critic in float32 (the precision in which it matches a Ray cluster's metrics); set "
                         f"float32, or run the job on Ray, or pass a model you loaded yourself at its own dtype")


class LocalRollouts(NamedTuple):
    """Rollouts computed so far and the seconds each phase took."""

    rollouts: list
    times: dict


class LocalBackend:
    """The RL loop's operations in one process.

    ``model`` is a ``ModelConfig`` or a model directory; ``reward_fn``, ``aggregate_fn`` and
    ``shaping_fn`` score rollouts as a reward worker does; ``with_reference`` keeps a frozen
    copy of the starting policy (``ref_update_fn(ref_state, policy_weights, step, kl)`` moves
    it at each sync); ``critic`` builds a value model from the policy (``"policy"``) or a
    reward-model directory, trained at ``critic_lr`` (default: the trainer's lr). ``trainer``
    holds the optimizer settings (AdamW, clipping, micro batch), as for a Ray trainer group.
    The reference and a critic from the policy are copied when the backend is built: SFT steps on
    it afterwards (``train_sft``) leave them the pre-SFT model (a KL to the base, if that is what is
    wanted), where a job copies them after its SFT stage; to match a job, build the RL backend from
    the SFT's model (``examples/grpo_single_process.py``).

    In a notebook, ``model`` may also be a causal LM already loaded (trained in place, at its
    own dtype and device) with its ``tokenizer`` (default: loaded from the model's
    ``name_or_path``); ``optimizer`` then replaces the AdamW built from ``trainer`` (its own
    learning rate stays unless the run's ``lr_schedule`` sets one), and ``reference_model``
    is the reference to use instead of a frozen copy of the starting policy (it is frozen,
    dropout off, in place); ``reference_state`` (a ``RefState``, with ``ref_update_fn``) the update
    function's state to go on from (its last reset, its float32 weights), instead of the
    reference's weights with no reset yet.
    """

    name = "local"
    remote = False  # everything runs here: nothing has to pickle

    def __init__(self, model, reward_fn: Callable, aggregate_fn: Optional[Callable] = None,
                 shaping_fn: Optional[Callable] = None, with_reference: bool = False,
                 ref_update_fn: Optional[Callable] = None, trainer: TrainerConfig = TrainerConfig(),
                 critic: Optional[str] = None, critic_lr: Optional[float] = None, seed: int = 0,
                 tokenizer=None, optimizer=None, reference_model=None, reference_state=None):
        check_arity(reward_fn, "reward_fn", None)
        if aggregate_fn is not None:
            check_arity(aggregate_fn, "aggregate_fn", [0.0])
        if shaping_fn is not None:
            check_arity(shaping_fn, "shaping_fn", None, 0.0)
        if ref_update_fn is not None:
            check_arity(ref_update_fn, "ref_update_fn", None, {}, 0, None)
        torch.manual_seed(seed)
        self.seed, self.trainer_config = seed, trainer
        if isinstance(model, torch.nn.Module):
            self.config = None
            self.policy, self.tokenizer = model, tokenizer if tokenizer is not None else loaded_tokenizer(model)
            disable_dropout(self.policy)
        else:
            self.config = model if isinstance(model, ModelConfig) else ModelConfig(model)
            if self.config.lora.enabled:
                raise ValueError("LocalBackend: model.lora is for the Ray trainer ranks (adapters alone trained and "
                                 "sent, the reference with the adapters off); here pass a model you wrapped yourself "
                                 "(primitives.model.lora.with_lora(model, LoraConfig(...))) and its tokenizer")
            check_float32(self.config, trainer)
            self.policy, self.tokenizer = load_causal_lm(self.config, "local policy")
        self.optimizer = optimizer if optimizer is not None else adamw(self.policy.parameters(), trainer)
        if trainer.gradient_checkpointing:
            enable_gradient_checkpointing(self.policy, "local policy")
        self.reward_fn, self.aggregate_fn, self.shaping_fn = reward_fn, aggregate_fn, shaping_fn
        self.reward_needs_reference = bool(getattr(shaping_fn, "needs_reference", False))
        self.reference = None
        if reference_model is not None:
            self.reference = freeze(reference_model)
        elif with_reference or self.reward_needs_reference:
            self.reference = create_reference_model(self.policy)
        self.ref_update_fn = ref_update_fn
        self.ref_state = None
        if ref_update_fn is not None:
            self.ref_state = reference_state if reference_state is not None else ref_state_from_model(self.reference)
        self.critic = self.critic_optimizer = None
        if critic is not None:
            from primitives.model.value import value_model_from_policy, value_model_from_reward_model

            self.critic = value_model_from_policy(self.policy) if critic == "policy" \
                else value_model_from_reward_model(critic)
            self.critic_optimizer = adamw(self.critic.parameters(), trainer, critic_lr or trainer.lr)
            if trainer.gradient_checkpointing:
                enable_gradient_checkpointing(self.critic, "local critic")
        self.policy_version, self.restarts = 0, 0
        self._busy = {"generators": 0.0, "trainers": 0.0}

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def has_reference(self) -> bool:
        return self.reference is not None

    @property
    def reference_in_train_step(self) -> bool:
        return False  # the reference scores the rollouts before the batch is made

    @property
    def has_critic(self) -> bool:
        return self.critic is not None

    # ------------------------------------------------------------------ rollouts
    def generate(self, items: Sequence, gen: GenerationConfig, tools=None) -> LocalRollouts:
        t0 = time.perf_counter()
        items = list(items)
        device = next(self.policy.parameters()).device
        sampler = rollout_sampler(self.seed, 0, self.policy_version, items, device)  # as generator rank 0 would
        if tools is None:
            rollouts = generate_rollouts(self.policy, self.tokenizer, items, gen, self.policy_version, sampler)
        else:
            turns = hf_turns_generator(self.policy, self.tokenizer, gen, sampler)
            rollouts = multiturn_rollouts(turns, self.tokenizer, items, gen.n, tools, self.policy_version)
        self._busy["generators"] += time.perf_counter() - t0
        return LocalRollouts(rollouts, {"time/generate": time.perf_counter() - t0})

    def reference_logprobs(self, done: LocalRollouts, temperature: float) -> LocalRollouts:
        t0 = time.perf_counter()
        refs = rollout_logprobs(self.reference, done.rollouts, self.pad_token_id, temperature)
        rollouts = [r._replace(ref_logprobs=lp) for r, lp in zip(done.rollouts, refs)]
        return LocalRollouts(rollouts, {**done.times, "time/ref": time.perf_counter() - t0})

    def score(self, done: LocalRollouts, shaped: bool = True) -> LocalRollouts:
        t0 = time.perf_counter()
        rollouts = score_rollouts(done.rollouts, self.reward_fn, self.aggregate_fn, self.shaping_fn if shaped else None)
        return LocalRollouts(rollouts, {**done.times, "time/reward": time.perf_counter() - t0})

    def score_and_reference(self, done: LocalRollouts, temperature: float) -> LocalRollouts:
        """Rewards and reference logprobs (one after the other here; neither reads the other)."""
        return self.reference_logprobs(self.score(done), temperature)

    def fetch(self, done: LocalRollouts) -> tuple:
        part = (list(done.rollouts), None)  # one chunk, held here
        return [Held(summarize(r), part, i) for i, r in enumerate(part[0])], dict(done.times)

    def select(self, rows: Sequence, filters: Sequence) -> list:
        return [rows[k] for k in kept_indices(self.rollouts(rows), filters)]

    def rollouts(self, rows: Sequence) -> list:
        positions, parts = plan_parts(rows)
        return planned_rollouts(BatchPlan(positions, self.pad_token_id), parts)

    def values(self, plan: BatchPlan, parts: list) -> list:
        from primitives.model.value import rollout_values

        if self.critic is None:
            raise ValueError("this LocalBackend has no critic; pass critic='policy' for an algorithm whose "
                             "advantage function reads values (PPO's GAE)")
        return rollout_values(self.critic, planned_rollouts(plan, parts), self.pad_token_id,
                              self.trainer_config.micro_batch_size)

    # ------------------------------------------------------------------ training
    def train_step(self, plan: BatchPlan, parts: list, values, algo: AlgorithmConfig, temperature: float,
                   lr: Optional[float], with_critic: bool = False) -> StepResult:
        """The planned batch: the policy's updates (and the critic's), as one rank reports them."""
        cfg, t0 = self.trainer_config, time.perf_counter()
        batch = planned_batch(plan, parts, algo, values)
        if batch is None:
            return StepResult([], None, None)
        updates = train_on_batch(self.policy, self.optimizer, batch, algo, temperature, cfg.max_grad_norm,
                                 cfg.micro_batch_size, lr)
        critic_updates = None
        if with_critic:  # the critic's updates (the policy's epochs and mini-batches), at the critic's lr
            from primitives.model.value import train_values_on_batch

            critic_updates = train_values_on_batch(self.critic, self.critic_optimizer, batch, algo,
                                                   cfg.max_grad_norm, cfg.micro_batch_size)
        self._busy["trainers"] += time.perf_counter() - t0
        return StepResult([updates], None if critic_updates is None else [critic_updates],
                          rollout_metrics(batch, plan.component_names))

    def sft_step(self, arrays: tuple, lr: Optional[float]) -> list:
        """One SFT optimizer step on the collated ``(input_ids, attention_mask, loss_mask)``, the
        loss normalised by their target-token count (as one trainer rank reports it)."""
        ids, attn, loss_mask = arrays
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        metrics = sft_forward_backward(self.policy, ids, attn, loss_mask, int(loss_mask[:, 1:].sum()),
                                       self.trainer_config.micro_batch_size)
        grad_norm = optim_step(self.policy, self.optimizer, self.trainer_config.max_grad_norm)
        return [{**metrics, "grad_norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"]}]

    def sft_eval(self, arrays: tuple) -> list:
        ids, attn, loss_mask = arrays
        return [sft_eval_loss(self.policy, ids, attn, loss_mask, int(loss_mask[:, 1:].sum()),
                              self.trainer_config.micro_batch_size)]

    def sync(self, version: int, step: int, kl: Optional[float]) -> dict:
        """The generator already holds the trained weights; a tracking reference moves."""
        t0 = time.perf_counter()
        if self.ref_update_fn is not None:
            policy = {k: v.detach().clone() for k, v in self.policy.named_parameters()}
            self.ref_state = self.ref_update_fn(self.ref_state, policy, step, kl)
            apply_ref_state(self.reference, self.ref_state)
        self.policy_version = version
        return {"time/sync": time.perf_counter() - t0, "sync/version": float(version)}

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, state: TrainState) -> str:
        """``policy/`` (``primitives.io.checkpoint.save_checkpoint``: HF weights, tokenizer,
        optimizer, RNG, ``TrainState``), ``reference/`` and ``critic/`` (with its optimizer),
        all in one atomic rename."""
        def write(tmp: str) -> None:
            save_checkpoint(os.path.join(tmp, "policy"), self.policy, self.tokenizer, self.optimizer, state,
                            extra={"ref_last_reset": self.ref_state.last_reset_step if self.ref_state else 0})
            if self.reference is not None:
                save_model_weights(self.reference, os.path.join(tmp, "reference"))
                if self.ref_state is not None:  # its float32 state where the model is narrower
                    save_tracking_state(os.path.join(tmp, "reference"), self.reference, self.ref_state.weights,
                                        self.ref_state.last_reset_step)
            if self.critic is not None:
                from primitives.model.value import save_value_model

                save_value_model(self.critic, os.path.join(tmp, "critic"))
                assert self.critic_optimizer is not None  # built with the critic
                torch.save(self.critic_optimizer.state_dict(), os.path.join(tmp, "critic_optimizer.pt"))

        return atomic_directory(path, write)

    def load(self, path: str) -> TrainState:
        """Restore what ``save`` wrote; the run goes on as if never stopped."""
        if not os.path.isdir(os.path.join(path, "policy")):
            raise FileNotFoundError(f"{path} is not a local-backend checkpoint (no policy/)")
        state, extra = load_checkpoint(os.path.join(path, "policy"), self.policy, self.optimizer)
        if self.reference is not None:
            load_model_weights(self.reference, os.path.join(path, "reference"))
            if self.ref_state is not None:
                self.ref_state = ref_state_from_model(self.reference, extra["ref_last_reset"])
                saved = load_tracking_state(os.path.join(path, "reference"), next(self.reference.parameters()).device)
                if saved is not None:
                    self.ref_state = self.ref_state._replace(weights={**self.ref_state.weights, **saved[0]})
        if self.critic is not None:
            from primitives.model.value import load_value_model

            self.critic.load_state_dict(load_value_model(os.path.join(path, "critic")).state_dict())
            assert self.critic_optimizer is not None  # built with the critic
            self.critic_optimizer.load_state_dict(torch.load(os.path.join(path, "critic_optimizer.pt")))
        self.policy_version = state.policy_version
        return state

    def busy(self) -> dict:
        """Seconds generating and training since the last call (one process: one clock each)."""
        out, self._busy = self._busy, {"generators": 0.0, "trainers": 0.0}
        return out

    def prefix_cache(self) -> dict:
        """Nothing: the one-process loop generates with HF, which has no prefix cache to read."""
        return {}

    def recover(self, failure, since: int, send_weights: bool = True, lost: float = 0.0) -> Optional[str]:
        raise failure  # one process: nothing to replace

    def prepare_recovery(self) -> None:
        """Nothing to snapshot: one process has no actor to lose."""

    def fault_metrics(self) -> dict:
        return {}  # no recoveries in one process

    can_scale_generators = False  # one process: generation is this process's; nothing to grow or shrink
    generator_count = 1

    def scale_generators(self, n: int, in_flight=()) -> dict:
        raise ValueError("the local backend generates in its own process: there are no generator workers to scale")

    def settle(self, collections) -> None:
        """Nothing is in flight here: generation ran when it was dispatched."""
