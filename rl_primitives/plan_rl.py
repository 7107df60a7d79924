"""The seeds' plan's RL loop (seeds/004, Phase 3) as printed: a ``DataBuffer`` whose position is
explicit, rollout batches from a ``generate_fn`` of the reader's (``generate_rollout_batches``,
``AsyncRolloutManager``), inference engines that take the trainers' weights every
``sync_every`` steps from a checkpoint (``sync_weights_to_engines``), advantages ``reward -
baseline`` (``compute_advantages``, ``prepare_grpo_batch``) and ``run_rl_training`` over either
training backend of ``rl_primitives.plan`` (one process, or the Ray trainer group).

``HFInferenceEngine`` is an engine in this process: the policy's weights as of its last sync,
sampling with the project's HF sampler; its ``generate(prompts)`` is a ``generate_fn``. The plan's
engines are SGLang servers; any object with ``update_weights_from_checkpoint(path)`` serves.

Between syncs the engines sample an older policy than the one trained: the plan's loss (a plain
policy gradient) has no importance weight for that, so keep ``sync_every`` small, or use the jobs'
loop (``cluster.loop.train``), which syncs every step and corrects the gap it measures.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Generator, NamedTuple, Optional, Sequence

import numpy as np
import torch

from primitives.hooks import call_hook, fn_name
from primitives.types import DataPosition, GenerationConfig, PromptItem
from rl_primitives.plan import PlanBackend, Sample, prepare_sft_batch


class DataBuffer:
    """Prompts served in order, epoch after epoch (the plan's one stateful data class): its
    position (``epoch_id``, ``sample_offset``) is plain data, given to start from one. With
    ``shuffle``, each epoch's order is a permutation drawn from ``(seed, epoch)``: a buffer made
    at a saved position serves what the first would have served."""

    def __init__(self, prompts: Sequence, shuffle: bool = False, seed: int = 0, epoch_id: int = 0,
                 sample_offset: int = 0):
        if len(prompts) == 0:
            raise ValueError("DataBuffer: no prompts")
        if not 0 <= sample_offset < len(prompts) or epoch_id < 0:
            raise ValueError(f"DataBuffer: position (epoch {epoch_id}, offset {sample_offset}) is outside "
                             f"{len(prompts)} prompts")
        self.prompts, self.shuffle, self.seed = list(prompts), shuffle, seed
        self.epoch_id, self.sample_offset = epoch_id, sample_offset

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.prompts)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    @property
    def position(self) -> DataPosition:
        return DataPosition(self.epoch_id, self.sample_offset)

    def get_prompts(self, n: int) -> list:
        """The next ``n`` prompts, into the next epoch where this one runs out."""
        if n < 1:
            raise ValueError(f"DataBuffer.get_prompts: n must be >= 1, got {n}")
        out: list = []
        while len(out) < n:
            order = self._order(self.epoch_id)
            take = order[self.sample_offset: self.sample_offset + n - len(out)]
            out += [self.prompts[i] for i in take]
            self.sample_offset += len(take)
            if self.sample_offset == len(self.prompts):
                self.epoch_id, self.sample_offset = self.epoch_id + 1, 0
        return out


class RolloutConfig(NamedTuple):
    """``batch_size`` prompts per batch; ``generate_fn(prompts, **rollout_kwargs) -> [Sample]``."""

    batch_size: int = 4
    generate_fn: Optional[Callable] = None


class SampleBatch(NamedTuple):
    """The plan's ``RolloutBatch`` (its samples, the epoch and step that made them). The name
    ``RolloutBatch`` is the seeds' batch of ``Rollout`` records here."""

    samples: tuple
    epoch_id: int
    step_id: int


def generate_rollout_batches(data_buffer: DataBuffer, config: RolloutConfig,
                             **rollout_kwargs) -> Generator[SampleBatch, None, None]:
    """The plan's generator: batch after batch of ``config.generate_fn``'s samples of the buffer's
    next ``config.batch_size`` prompts, numbered from 0 (the step is a local variable)."""
    if config.generate_fn is None or config.batch_size < 1:
        raise ValueError(f"RolloutConfig needs a generate_fn and batch_size >= 1, got {config}")
    step = 0
    while True:
        epoch = data_buffer.epoch_id
        prompts = data_buffer.get_prompts(config.batch_size)
        generate = functools.partial(config.generate_fn, **rollout_kwargs) if rollout_kwargs else config.generate_fn
        samples = call_hook(generate, "generate_fn", prompts)
        if not samples or not all(isinstance(s, Sample) for s in samples):
            raise ValueError(f"generate_fn {fn_name(config.generate_fn)} must return a non-empty list of "
                             f"rl_primitives.Sample(input_ids, labels, loss_mask, metadata)")
        yield SampleBatch(tuple(samples), epoch, step)
        step += 1


class AsyncRolloutManager:
    """``await generate_batch()``: the next batch of ``generate_rollout_batches``; an async
    context manager (the plan's ``async with rollout_manager:``)."""

    def __init__(self, data_buffer: DataBuffer, config: RolloutConfig, **rollout_kwargs):
        self.batches = generate_rollout_batches(data_buffer, config, **rollout_kwargs)

    async def generate_batch(self) -> SampleBatch:
        return next(self.batches)

    async def __aenter__(self) -> "AsyncRolloutManager":
        return self

    async def __aexit__(self, *exc) -> None:
        self.batches.close()


def hf_directory(path: str) -> str:
    """A checkpoint's Hugging Face directory: ``path/hf`` where a Ray trainer checkpoint keeps it,
    else ``path`` (a one-process checkpoint)."""
    return os.path.join(path, "hf") if os.path.isfile(os.path.join(path, "hf", "config.json")) else path


class HFInferenceEngine:
    """An inference engine in this process: a copy of the policy (``model_path``) sampling at
    ``gen_config`` (one completion per prompt unless ``gen_config.n`` says more), rewarded by
    ``reward_fn(rollout)``, its weights replaced at each sync. ``generate(prompts)`` returns
    ``Sample``s: prompt and completion ids, the loss on the completion, and in ``metadata`` the
    prompt, the text, the ``reward`` and the ``weight_version`` that sampled it."""

    def __init__(self, model_path: str, gen_config: GenerationConfig, reward_fn: Optional[Callable] = None,
                 seed: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.gen_config, self.reward_fn = gen_config, reward_fn
        self.generator = torch.Generator().manual_seed(seed)
        self.weight_version, self.served = 0, 0

    def generate(self, prompts: Sequence) -> list:
        from primitives.env.rewards import score_rollouts
        from primitives.model.generation import generate_rollouts

        items = [PromptItem(index=self.served + k, prompt=p) for k, p in enumerate(prompts)]
        self.served += len(prompts)
        rollouts = generate_rollouts(self.model, self.tokenizer, items, self.gen_config, self.weight_version,
                                     self.generator)
        if self.reward_fn is not None:
            rollouts = score_rollouts(rollouts, self.reward_fn)
        out = []
        for r in rollouts:
            ids = np.concatenate([r.prompt_ids, r.completion_ids])
            mask = np.concatenate([np.zeros(len(r.prompt_ids), np.float32), r.loss_mask])
            out.append(Sample(ids, ids, mask, {"prompt": r.prompt, "text": r.text, "reward": r.reward,
                                               "weight_version": self.weight_version}))
        return out

    def update_weights_from_checkpoint(self, path: str) -> int:
        """The weights of the HF model at ``path`` (or its ``hf/``: a Ray trainer's checkpoint)."""
        from transformers import AutoModelForCausalLM

        hf = hf_directory(path)
        state = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).state_dict()
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:  # a tied head is saved once
            raise ValueError(f"checkpoint {hf} does not fit this engine's model (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
        self.weight_version += 1
        return self.weight_version


class SGLangEngine:
    """An SGLang server the plan syncs (seeds/004: ``SGLangEngine(base_url="http://localhost:30000")``):
    at each sync it is told to reload its weights from the checkpoint directory, through SGLang's
    ``POST /update_weights_from_disk``. The directory is sent as an absolute path and must be
    readable on the server's machine (a shared filesystem on several nodes); ``api_key`` is the
    server's ``--api-key``. A refusal (SGLang answers 400 with its message), a reply that is not
    SGLang's, a timeout or an unreachable server raises naming the URL; nothing is retried, so a
    sync that did not happen is never counted."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, api_key: Optional[str] = None):
        if not str(base_url).startswith(("http://", "https://")):
            raise ValueError(f"SGLangEngine(base_url={base_url!r}): an http(s) URL of the server, e.g. "
                             "http://localhost:30000")
        self.base_url, self.timeout_s, self.api_key = str(base_url).rstrip("/"), timeout_s, api_key
        self.weight_version = 0

    def update_weights_from_checkpoint(self, path: str) -> int:
        import json
        import socket
        import urllib.error
        import urllib.request

        hf = hf_directory(path)
        hf = os.path.abspath(hf)  # the server resolves a relative path against its own directory
        url = f"{self.base_url}/update_weights_from_disk"
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url, json.dumps({"model_path": hf}).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as e:  # SGLang answers a failed load with 400 and its message
            raise RuntimeError(f"SGLang at {url} did not load {hf}: HTTP {e.code} "
                               f"{e.read().decode(errors='replace')[:300]}") from None
        except (socket.timeout, TimeoutError):
            raise RuntimeError(f"SGLang at {url} gave no answer within {self.timeout_s} s while loading {hf}; it "
                               "may still be loading: raise timeout_s") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise RuntimeError(f"SGLang at {url} did not answer ({reason}); is the server up?") from None
        try:
            answer = json.loads(body or b"{}")
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise RuntimeError(f"SGLang at {url} answered {body[:200]!r}, not SGLang's JSON: is it an SGLang server?")
        if not answer.get("success", False):
            raise RuntimeError(f"SGLang at {url} did not load {hf}: {answer.get('message', answer)}")
        self.weight_version += 1
        return self.weight_version


async def sync_weights_to_engines(engines: Sequence[Any], checkpoint_path: str) -> int:
    """Every engine takes the weights of ``checkpoint_path``; how many did."""
    for engine in engines:
        engine.update_weights_from_checkpoint(str(checkpoint_path))
    return len(engines)


class RLTrainingConfig(NamedTuple):
    num_steps: int = 1000
    sync_every: int = 10
    baseline: float = 0.0
    log_every: int = 10
    checkpoint_every: int = 100


def compute_reward(sample, reward_fn: Optional[Callable] = None) -> float:
    """The plan's grading of a ``Sample``: its ``metadata["reward"]``, or 1.0 when
    ``metadata["correct"]``. With a ``reward_fn`` (seeds/003's ``compute_reward(rollout,
    reward_fn)``), ``reward_fn(rollout)`` checked as a scalar reward."""
    if reward_fn is not None:
        from primitives.env.rewards import compute_scalar_reward

        return compute_scalar_reward(sample, reward_fn)
    if not isinstance(sample, Sample):
        raise ValueError(f"compute_reward({type(sample).__name__}): without a reward_fn it grades the plan's Sample "
                         f"(metadata 'reward' or 'correct'); for a rollout pass compute_reward(rollout, reward_fn)")
    meta = sample.metadata or {}
    if meta.get("reward") is not None:
        return float(meta["reward"])
    return 1.0 if meta.get("correct", False) else 0.0


def compute_advantages(rewards: Sequence[float], baseline: float = 0.0, normalize: Optional[bool] = None,
                       advantage_fn: Optional[Callable] = None) -> list:
    """``reward - baseline`` for each (the plan's REINFORCE baseline). seeds/001's
    ``compute_advantages(rollouts, normalize, advantage_fn)`` is refused, with its keywords or
    with rollouts: one mean over the whole batch, normalised over padded positions (seeds README 8)."""
    seeds_001 = normalize is not None or advantage_fn is not None
    if seeds_001 or any(not isinstance(r, (int, float, np.floating, np.integer)) or isinstance(r, bool)
                        for r in rewards):
        raise ValueError("compute_advantages(rewards, baseline) takes numbers. seeds/001's compute_advantages("
                         "rollouts, normalize=...) subtracts one mean over the whole batch and normalises over padded "
                         "positions (seeds README 8): use compute_grpo_advantages(batch) (within each prompt's group), "
                         "or an algorithm's advantage_fn on the loop (create_algorithm_config(...))")
    return [float(r) - baseline for r in rewards]


def prepare_grpo_batch(batch: SampleBatch, rewards: Sequence[float], config: RLTrainingConfig) -> dict:
    """The samples padded into one batch, with ``advantages`` (B,) from the rewards and baseline."""
    if len(rewards) != len(batch.samples):
        raise ValueError(f"prepare_grpo_batch: {len(rewards)} rewards for {len(batch.samples)} samples")
    out = prepare_sft_batch(batch.samples)
    out["advantages"] = np.asarray(compute_advantages(rewards, config.baseline), np.float32)
    return out


async def run_rl_training(backend: PlanBackend, data_buffer: DataBuffer, rollout_manager: AsyncRolloutManager,
                          inference_engines: Sequence[Any], config: RLTrainingConfig) -> list:
    """The plan's loop as printed: generate, reward, prepare, ``forward_backward`` and
    ``optim_step``, and every ``sync_every`` steps (not step 0) a checkpoint the engines load.
    Returns one dict per step (``loss``, ``grad_norm``, ``lr``, ``mean_reward``, ...)."""
    if config.num_steps <= 0 or config.sync_every <= 0:
        raise ValueError(f"run_rl_training: num_steps and sync_every must be > 0, got {config}")
    if getattr(backend, "checkpoint_dir", None) is None:
        raise ValueError("run_rl_training: the backend needs a checkpoint_dir: the engines take the weights from "
                         "the checkpoint written every sync_every steps")
    history = []
    print(f"Starting RL training...\n  Steps: {config.num_steps}\n  Weight sync every: {config.sync_every} steps")
    async with rollout_manager:
        for step in range(config.num_steps):
            batch = await rollout_manager.generate_batch()
            rewards = [compute_reward(s) for s in batch.samples]
            fwd = await backend.forward_backward(prepare_grpo_batch(batch, rewards, config)).result()
            opt = await backend.optim_step().result()
            metrics = {**fwd, **opt, "mean_reward": sum(rewards) / len(rewards), "max_reward": max(rewards),
                       "min_reward": min(rewards), "data_epoch": batch.epoch_id, "step": step}
            history.append(metrics)
            if step % config.sync_every == 0 and step > 0:
                path = await backend.save_checkpoint(step, metrics)
                await sync_weights_to_engines(inference_engines, str(path))
                print(f"  Synced weights to {len(inference_engines)} engines")
            if step % config.log_every == 0:
                print(f"Step {step}: reward={metrics['mean_reward']:.2f}, loss={fwd['loss']:.4f}, "
                      f"grad_norm={opt['grad_norm']:.4f}")
            if config.checkpoint_every and step % config.checkpoint_every == 0 and step > 0 \
                    and step % config.sync_every != 0:
                print(f"  Saved checkpoint to {await backend.save_checkpoint(step, metrics)}")
    print("RL training complete!")
    return history
