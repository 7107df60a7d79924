"""The vLLM engine: vLLM's ``LLM`` on a GPU, or on the CPU (vLLM's CPU build, by name), returning
the same ``Rollout``s as the HF engine. Weights arrive through vLLM's weight-transfer API with our
engine, the trainer's bucketed broadcast over gloo on the CPU and over NCCL on GPUs
(``VLLMWeightTransfer``), or, with LoRA, only the adapters, in the worker's own process, served as a
``LoRARequest`` (``VLLMAdapters``)."""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from primitives.model.generation import pack_rollout
from primitives.model.prompts import encode_prompts
from primitives.model.vllm_generation import PROCESSED, completion_output, sampling_params
from primitives.types import VLLM_CPU_BLOCK, GenerationConfig, LoraConfig, ModelConfig, VLLMConfig
from rl_actors.common import gpu_visible, loaded
from rl_actors.hf_engine import sampler_key
from rl_actors.sync_buckets import bucket_buffer
from rl_actors.weight_sync import (
    SyncAddress,
    TensorMeta,
    broadcast_buckets,
    init_sync_group,
    tensor_checksums,
)


def vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def vllm_available() -> bool:
    """``generator_backend: auto`` picks vLLM where it is installed and a GPU is visible; on a
    CPU the HF engine (vLLM's CPU build runs when asked for by name). The GPU is looked for first:
    importing vLLM costs about 5 s of CPU, and an HF generator worker on a CPU never needs it."""
    return gpu_visible() and vllm_importable()



def vllm_environment(settings: VLLMConfig, num_threads: int, on_gpu: bool) -> dict:
    """What vLLM reads from the environment at start (its engine processes inherit it).

    ``collective_rpc`` with a function of ours (the weight checksums read inside vLLM's worker)
    needs vLLM's pickle serialisation between its processes on this host. On CPU: the KV cache
    size, no core reserved for vLLM's own use and no thread pinning (Ray places the actors;
    vLLM's pinning would stack every engine on the same cores), the actor's thread count, and the
    engine in the actor's own process: by default vLLM spawns an engine-core process and a worker
    process, each importing torch, transformers and vLLM again (a start cost 38 s and 39 CPU-seconds
    against 16 and 17 in one process here, for the tiny model), and a killed actor could leave them
    behind."""
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}  # its INFO lines drown the job's
    if not on_gpu:
        env.update(VLLM_CPU_KVCACHE_SPACE=str(settings.cpu_kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND="nobind",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0", OMP_NUM_THREADS=str(max(1, num_threads)),
                   VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return env


def llm_device_kwargs(settings: VLLMConfig, on_gpu: bool) -> dict:
    """``LLM(...)`` arguments that depend on the device.

    On CPU: no chunked prefill (a seeded request whose prompt is split over two engine steps makes
    vLLM rewind its CPU ``torch.Generator``, which has no offset: "CPU Generator does not use
    offset", and the engine dies once a call's prompts exceed one step's token budget), and KV-cache
    blocks of ``VLLM_CPU_BLOCK`` tokens unless ``settings.block_size`` says otherwise. Requests
    share a prompt's cached KV in whole blocks only, also within one call (the first request's
    prefill writes them). With vLLM's CPU default of 128, a GRPO group's 46-token chat prompts
    filled no block and every sample prefilled its prompt again; with 32, SmolLM2's 32 rollouts of
    4 prompts generated in 2.78-2.95 s instead of 5.04-5.72 (``benchmarks/bench_vllm_blocks.py``;
    docs/benchmarks.md, 2026-11-29). On a GPU vLLM's own default stays."""
    block = {"block_size": settings.block_size} if settings.block_size is not None else {}
    if on_gpu:
        return dict(tensor_parallel_size=settings.tensor_parallel_size,
                    gpu_memory_utilization=settings.gpu_memory_utilization,
                    enable_sleep_mode=settings.enable_sleep_mode, **block)
    return dict(enable_chunked_prefill=False, block_size=settings.block_size or VLLM_CPU_BLOCK)


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of ``x``, how many entries are at least that row's entry of ``values`` (a column): the rank
    vLLM reports with a sampled token's logprob (1 for the likeliest token), as vLLM's
    ``batched_count_greater_than`` counts it."""
    return (x >= values).sum(-1)


def eager_token_ranks() -> bool:
    """On the CPU, count the sampled tokens' ranks eagerly (``count_at_least``) in vLLM's sampler, which runs in
    this process there. vLLM counts them with a function TorchInductor compiles: the first sampling call of
    every vLLM process traced it (2.7 CPU-s here with the kernel in inductor's on-disk cache) and, on a
    machine whose cache lacked it, compiled C++ (the first call took 21 s instead of 0.03 s; 2026-11-30). The
    compile spares a GPU a copy of a large batch's logits; at a CPU's batch sizes the count costs nothing.
    False where this vLLM's sampler has no such function (nothing is replaced)."""
    from vllm.v1.sample import sampler

    if not callable(getattr(sampler, "batched_count_greater_than", None)):
        return False
    sampler.batched_count_greater_than = count_at_least
    return True


def check_transfer_plugin(role: str) -> None:
    """vLLM receives weights through our engine, which vLLM registers in its own processes
    from this project's ``vllm.general_plugins`` entry point: name what is missing before vLLM
    starts (else its worker fails deep inside with an unknown backend)."""
    from importlib.metadata import entry_points

    from rl_actors.vllm_transfer import PLUGIN

    if PLUGIN not in {e.name for e in entry_points(group="vllm.general_plugins")}:
        raise RuntimeError(f"{role}: vLLM's plugin entry point '{PLUGIN}' is not installed; install this project "
                           f"(pip install -e ., as make venv does) so vLLM's processes can receive weights")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN not in allowed.split(","):
        raise RuntimeError(f"{role}: VLLM_PLUGINS={allowed!r} leaves out '{PLUGIN}', which carries the weights "
                           f"into vLLM; add it or unset VLLM_PLUGINS")


def vllm_seeds(base: int, rows: int) -> list:
    """One sampling seed per request of a call: rows of the same prompt (a GRPO group) must not
    share a seed, or vLLM would sample them alike."""
    return [(base + j) % 2 ** 31 for j in range(rows)]


class VLLMEngine:
    """vLLM's offline engine, on a GPU or on the CPU (vLLM's CPU build); sampled-token logprobs
    come from vLLM (``logprobs=0``).

    Those logprobs are vLLM's ``processed_logprobs``: ``log_softmax`` of the logits after
    temperature and after top-k / top-p, i.e. of the distribution it sampled from,
    renormalised over the kept tokens. Without top-k / top-p (``top_p`` 1, ``top_k`` 0) that
    is ``log_softmax(logits / T)``, what the HF engine and the trainer compute; with either,
    each logprob is the full one minus log(the kept mass), so the importance weight against
    the trainer would be that mass, not the policies' gap. The job check
    (``cluster.jobs.checks.behaviour_logprob_errors``) refuses that combination where the weight is
    applied. Sampling happens in vLLM's own processes, one seed per request, derived from the
    same key as the HF engine's sampler (``rollout_sampler``).

    How weights arrive is chosen once, at start (``self.weights``): every weight through vLLM's
    weight-transfer API (``VLLMWeightTransfer``), or with ``model.lora`` only the adapters, served
    as a ``LoRARequest`` on the frozen base (``VLLMAdapters``).
    """

    name = "vllm"

    def __init__(self, config: ModelConfig, role: str, settings: VLLMConfig = VLLMConfig(), num_threads: int = 1):
        from transformers import AutoTokenizer

        from rl_actors.common import check_model_path
        from rl_actors.scratch import process_tempdir

        check_model_path(config.model_name_or_path, role)
        self.on_gpu, self.settings = gpu_visible(), settings
        self.weights = VLLMAdapters(config.lora) if config.lora.enabled else VLLMWeightTransfer(role)
        os.environ.update(vllm_environment(settings, num_threads, self.on_gpu))
        from vllm import LLM

        self.eager_ranks = not self.on_gpu and eager_token_ranks()
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_name_or_path,
                                                       trust_remote_code=config.trust_remote_code)
        device_kwargs = llm_device_kwargs(settings, self.on_gpu)
        # processed logprobs: after temperature (vLLM's default, raw, is before it), which the
        # trainer's importance weight compares with; top-k / top-p renormalise them (see above)
        # vLLM's rendezvous file (a vllm_dist_<id> FileStore in the temporary directory) outlives a killed actor:
        # in a directory of the actor's own, the next sweep removes it (about 20 were left in /tmp a test run)
        with process_tempdir("vllm"):
            self.llm = LLM(model=config.model_name_or_path, dtype=config.dtype, enforce_eager=True,
                           trust_remote_code=config.trust_remote_code, logprobs_mode=PROCESSED,
                           max_model_len=settings.max_model_len, enable_prefix_caching=settings.enable_prefix_caching,
                           **self.weights.llm_kwargs(), **device_kwargs)
        loaded()
        self.block_size = int(self.llm.llm_engine.vllm_config.cache_config.block_size)  # tokens per KV-cache block
        self.prompt_tokens = [0, 0]  # prompt tokens of every call so far, and of those the prefix cache served
        self.device = torch.device("cuda" if self.on_gpu else "cpu")
        self.sleeps = settings.enable_sleep_mode and self.on_gpu  # the job check refuses sleep mode on CPU
        self.asleep = False
        self._sleep()

    def _outputs(self, prompt_ids: Sequence[np.ndarray], gen: GenerationConfig, base_seed: int) -> list:
        prompts = [{"prompt_token_ids": ids.tolist()} for ids in prompt_ids]
        params = [sampling_params(gen, s) for s in vllm_seeds(base_seed, len(prompts))]
        outs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.weights.lora_request)
        self.prompt_tokens[0] += sum(len(ids) for ids in prompt_ids)
        self.prompt_tokens[1] += sum(out.num_cached_tokens or 0 for out in outs)
        return [completion_output(out) for out in outs]

    @contextmanager
    def serving(self):
        """With sleep mode (GPU), the engine's memory is held only while it serves a call."""
        self._wake()
        try:
            yield
        finally:
            self._sleep()

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def _sleep(self) -> None:
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def sampler(self, seed: int, rank: int, version: int, items: Sequence) -> int:
        """The call's base seed: the HF sampler's key (``sampler_key``: the job's seed, the
        generator's rank, the policy version, the first prompt); request ``j`` samples with
        ``base + j`` in vLLM's processes. As on the HF engine, ``GenerationConfig.seed`` is not
        read: the worker's seed is the job's."""
        return sampler_key(seed, rank, version, items)

    def generate(self, items, gen: GenerationConfig, version: int, generator: int) -> list:
        prompt_ids = encode_prompts(self.tokenizer, [it.prompt for it in items], gen.template_kwargs)
        rows = [(it, ids, k) for it, ids in zip(items, prompt_ids) for k in range(gen.n)]
        outs = self._outputs([ids for _, ids, _ in rows], gen, generator)
        return [pack_rollout(it, ids, o, k, version) for (it, ids, k), o in zip(rows, outs)]

    def turns_generator(self, gen: GenerationConfig, generator: int) -> Callable:
        """A round of turns in one engine call; each turn of each conversation samples with the next
        seed of the call's stream (a round of ``k`` conversations takes the next ``k``)."""
        next_seed = [generator]

        def generate_turns(contexts: Sequence[np.ndarray]) -> list:
            base, next_seed[0] = next_seed[0], next_seed[0] + len(contexts)
            return self._outputs(list(contexts), gen, base)

        return generate_turns

    def weight_checksums(self) -> dict:
        """Name -> sha1 of the weights this engine samples with: every weight, read inside vLLM's
        worker; with LoRA the adapters it last received."""
        with self.serving():
            return self.weights.checksums(self.llm)

    def broadcast_probe(self, numel: int, dtype: str) -> float:
        """One raw broadcast in the sync group, received where this engine's weights arrive."""
        return self.weights.probe(self.llm, numel, dtype)

    def init_transfer(self, address: SyncAddress, rank: int, bucket_bytes: int) -> None:
        """Join the sync group as ``rank``."""
        self.weights.join(self.llm, address, rank, bucket_bytes)

    def update(self, meta: Sequence[TensorMeta], bucket_bytes: int, version: int) -> int:
        """One sync of ``meta`` (policy ``version``); returns the bytes received."""
        with self.serving():
            return self.weights.receive(self.llm, meta, bucket_bytes, version)


class VLLMWeightTransfer:
    """Every weight into vLLM's own processes through its weight-transfer API and our engine
    (``rl_actors.vllm_transfer``): the trainer's bucketed broadcast, over gloo on the CPU and over
    NCCL on GPUs, the same wire and bucket plan as every other receiver. After each update the
    prefix cache is reset: cached prompt KV holds the old weights."""

    lora_request = None  # the weights are vLLM's own: requests name no adapter

    def __init__(self, role: str):
        check_transfer_plugin(role)

    def llm_kwargs(self) -> dict:
        from vllm.config import WeightTransferConfig

        from rl_actors.vllm_transfer import BACKEND

        return {"weight_transfer_config": WeightTransferConfig(backend=BACKEND)}

    def join(self, llm, address: SyncAddress, rank: int, bucket_bytes: int) -> None:
        """Join the sync group (its backend, gloo or nccl, is in ``address``) as ``rank``."""
        from rl_actors.vllm_transfer import init_info

        llm.init_weight_transfer_engine({"init_info": init_info(address, rank)})

    def receive(self, llm, meta: Sequence[TensorMeta], bucket_bytes: int, version: int) -> int:
        """vLLM's start / update / finish round, then a prefix-cache reset."""
        from rl_actors.vllm_transfer import update_info

        llm.start_weight_update()
        llm.update_weights({"update_info": update_info(meta, bucket_bytes)})
        llm.finish_weight_update()
        llm.reset_prefix_cache()
        return sum(m.nbytes for m in meta)

    def checksums(self, llm) -> dict:
        """HF name -> sha1 of every weight vLLM's worker computes with (read inside it)."""
        from rl_actors.vllm_transfer import worker_weight_checksums

        return llm.collective_rpc(worker_weight_checksums)[0]

    def probe(self, llm, numel: int, dtype: str) -> float:
        from rl_actors.vllm_transfer import worker_broadcast_probe

        return llm.collective_rpc(worker_broadcast_probe, args=(numel, dtype))[0]


def vllm_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of ``rank``: the smallest value it accepts that holds them."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    accepted = sorted(get_args(MaxLoRARanks))
    fits = [r for r in accepted if r >= rank]
    if not fits:
        raise ValueError(f"model.lora.rank: vLLM serves adapters of rank at most {accepted[-1]}, got {rank}")
    return fits[0]


class VLLMAdapters:
    """LoRA (``model.lora``): vLLM serves the frozen base model with the policy's adapters, which
    arrive in this actor's process, not vLLM's: it joins the trainer's sync group itself (as an HF
    generator does) and receives only the adapters' tensors (``...lora_A.default.weight`` by the
    trainer's PEFT names). Each sync writes them as a PEFT adapter directory (``write_adapter``),
    loads it into vLLM under a new id (``LoRARequest``) and unloads the previous adapter; every
    later request names the new one. vLLM keys its adapter cache by the id (a reused id serves the
    cached, old adapter) and its prefix cache by the adapter's name and path: a new id, name and
    path per sync leave nothing of the previous adapter to serve.

    vLLM would read an adapter's files at the first request that names it; ``add_lora`` reads
    them at the sync instead, so a bad adapter fails the sync, and the directory goes as soon as
    vLLM holds the adapter (a killed actor leaves nothing in shared memory). vLLM reads them
    again only if it evicts the adapter, which ``max_loras=1`` with one adapter never does; were
    it to, it would fail loudly (``LoRAAdapterNotFoundError``), not serve a stale adapter.

    Before the first sync requests name no adapter: the policy's B starts at zero, so the policy
    is the base model."""

    def __init__(self, lora: LoraConfig):
        self.lora = lora
        self.group, self.device = None, torch.device("cpu")  # the group: set by join
        self.rank: Optional[int] = None
        self.tensors: dict = {}  # name -> the adapter tensors last received
        self.lora_request = None
        self.syncs = 0

    def llm_kwargs(self) -> dict:
        return {"enable_lora": True, "max_lora_rank": vllm_lora_rank(self.lora.rank), "max_loras": 1}

    def join(self, llm, address: SyncAddress, rank: int, bucket_bytes: int) -> None:
        """Join the trainer's sync group in this process (a GPU group's buckets land on this
        actor's GPU, then go to host memory for the adapter file)."""
        self.group, self.rank = init_sync_group(address, rank), rank
        self.device = torch.device("cuda" if address.backend == "nccl" else "cpu")

    def receive(self, llm, meta: Sequence[TensorMeta], bucket_bytes: int, version: int) -> int:
        """Receive the adapters, load them into vLLM in place of the previous ones; the bytes received."""
        from vllm.lora.request import LoRARequest

        from primitives.model.lora import write_adapter
        from rl_actors.scratch import scratch

        tensors: dict = {}

        def keep(metas, parts):
            tensors.update((m.name, t.to("cpu", copy=True)) for m, t in zip(metas, parts))

        moved = broadcast_buckets(self.group, meta, bucket_bytes, self.rank, self.device, on_received=keep,
                                  buffer=bucket_buffer(meta, bucket_bytes, self.device))  # keep copies
        self.syncs += 1
        # shared memory where it has room (no disk in a sync's path), as a snapshot's files go
        with scratch("lora", moved) as root:
            path = write_adapter(os.path.join(root, f"policy-v{version}"), tensors, self.lora)
            request = LoRARequest(f"policy-v{version}-sync{self.syncs}", self.syncs, path)
            if self.lora_request is not None:
                llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
            if not llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vLLM did not load the adapter of policy version {version} (id {self.syncs})")
        self.lora_request, self.tensors = request, tensors
        llm.reset_prefix_cache()  # the old adapter's cached prompt KV is unreachable now; free it
        return moved

    def checksums(self, llm) -> dict:
        """Trainer name -> sha1 of the adapter tensors last received (empty before the first sync)."""
        return tensor_checksums(self.tensors.items())

    def probe(self, llm, numel: int, dtype: str) -> float:
        from rl_actors.weight_sync import DTYPES, raw_broadcast

        return raw_broadcast(self.group, numel, DTYPES[dtype], self.rank, self.device)
