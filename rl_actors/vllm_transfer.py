"""Weights into vLLM's own processes: our weight-transfer engine for vLLM, on the CPU and on GPUs.

vLLM builds the engine named by ``WeightTransferConfig(backend=...)`` inside each of its
worker processes, through ``WeightTransferEngineFactory``. vLLM calls the
``vllm.general_plugins`` entry points in every process it starts; ours (pyproject.toml) is
``register``, which adds this engine as ``rayrl``. The wire is the one every other
receiver of the trainer's sync reads (``rl_actors.weight_sync.broadcast_buckets``): same-dtype
buckets broadcast from rank 0 of a process group of our own, the bucket plan computed on both
sides from the same metadata. So one sender on trainer rank 0 serves HF generator workers, a
policy-tracking reference and vLLM alike, and on both devices: the group is gloo with CPU
buffers on the CPU and NCCL with buffers on the worker's GPU on GPUs (``BucketInitInfo.backend``);
nothing else differs, so the CPU tests run the GPU path's logic. vLLM's own NCCL engine (its
packed buffers, a second wire) is not used.

Received tensors go through the model's ``load_weights`` inside vLLM's layerwise reload
(``start_weight_update`` / ``finish_weight_update``), which maps HF names onto vLLM's fused
parameters (``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj``) and restores the loaders a
plain ``load_weights`` call after start-up would miss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rl_actors.weight_sync import SyncAddress, TensorMeta, broadcast_buckets, init_sync_group

BACKEND = "rayrl"
PLUGIN = "rayrl"  # the entry point's name in pyproject.toml


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``rayrl`` a weight-transfer backend.
    vLLM may call it more than once in a process; the second call changes nothing."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "BucketWeightTransferEngine")


@dataclass
class BucketInitInfo(WeightTransferInitInfo):
    """Where the sync group's store is (trainer rank 0 hosts it), its size, this worker's rank in
    it and its backend (gloo: CPU buffers; nccl: on the worker's GPU)."""

    host: str
    port: int
    world_size: int
    rank: int
    backend: str = "gloo"
    timeout_s: float = 300.0
    token: str = ""  # the forming of the group (SyncAddress.token): its keys in the store


@dataclass
class BucketUpdateInfo(WeightTransferUpdateInfo):
    """One sync's parameters in the sender's order (HF names, ``rl_actors.weight_sync.DTYPES``
    keys, full shapes) and the bucket size both sides plan with."""

    names: list
    dtype_names: list
    shapes: list
    bucket_bytes: int

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"weight update: {len(self.names)} names, {len(self.dtype_names)} dtypes and "
                             f"{len(self.shapes)} shapes must match")


def update_info(meta, bucket_bytes: int) -> dict:
    """The ``update_info`` dict of one sync of ``meta`` (``TensorMeta``s), as vLLM's
    ``LLM.update_weights`` passes it to every worker."""
    return {"names": [m.name for m in meta], "dtype_names": [m.dtype for m in meta],
            "shapes": [list(m.shape) for m in meta], "bucket_bytes": int(bucket_bytes)}


def init_info(address: SyncAddress, rank: int, timeout_s: float = 300.0) -> dict:
    return {"host": address.host, "port": address.port, "world_size": address.world_size, "rank": rank,
            "backend": address.backend, "timeout_s": timeout_s, "token": address.token}


class BucketWeightTransferEngine(WeightTransferEngine[BucketInitInfo, BucketUpdateInfo]):
    """Receives the trainer's bucketed broadcast in a vLLM worker process and loads it."""

    init_info_cls = BucketInitInfo
    update_info_cls = BucketUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None  # set by init_transfer_engine
        self.rank: Optional[int] = None
        self.buffers = torch.device("cpu")  # where received buckets land: the group's device
        self.kernels: dict = {}  # table_kernels at the start of the update under way

    def init_transfer_engine(self, info: BucketInitInfo) -> None:
        address = SyncAddress(info.host, info.port, info.world_size, info.backend, info.token)
        self.buffers = receive_device(info.backend, torch.device(self.device))
        self.group, self.rank = init_sync_group(address, info.rank, info.timeout_s), info.rank

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.kernels = table_kernels(self.model)  # the tables' kernels before the reload (refresh_tied_heads)
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_heads(self.model, self.kernels)
        self.kernels = {}  # the old kernels go (the table's 113 MB on SmolLM2)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive and load one sync (synchronous on gloo: nothing to wait for afterwards)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: BucketUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError(f"{BACKEND} weight transfer: init_weight_transfer_engine was not called")
        meta = [TensorMeta(n, tuple(s), d) for n, d, s in zip(info.names, info.dtype_names, info.shapes)]

        def load(metas, tensors):
            self.model.load_weights([(m.name, t) for m, t in zip(metas, tensors)])

        try:
            broadcast_buckets(self.group, meta, info.bucket_bytes, self.rank, self.buffers, on_received=load)
        except BaseException:
            # the sender died mid-sync: a layer may be half-buffered in vLLM's layerwise reload, and vLLM's worker
            # does not finish the reload when a receive fails, so the next start_weight_update would skip that
            # layer's set-up and fail in it ('Parameter' object has no attribute 'weight_loader'). Finish it now:
            # a half-loaded layer is processed with what arrived, the others keep their weights; the sync made
            # again after the recovery overwrites every weight (the version is stamped only after a whole sync)
            self.finish_weight_update()
            raise

    def shutdown(self) -> None:
        self.group = None


def receive_device(backend: str, worker_device: torch.device) -> torch.device:
    """Where a bucket lands: CPU buffers for gloo, the vLLM worker's GPU for NCCL."""
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        if worker_device.type != "cuda":
            raise ValueError(f"{BACKEND} weight transfer: an nccl sync group needs a vLLM worker on a GPU, this "
                             f"one is on {worker_device}")
        return worker_device
    raise ValueError(f"{BACKEND} weight transfer: unknown backend {backend!r} (gloo, nccl)")


def table_kernels(model: torch.nn.Module) -> dict:
    """id of each embedding table's module -> its GEMM kernel now (``cpu_linear``; None where it has
    none): ``refresh_tied_heads`` tells by it which tables the reload packed afresh."""
    return {id(m): getattr(m, "cpu_linear", None) for m in _tables(model).values()}


def refresh_tied_heads(model: torch.nn.Module, before: Optional[dict] = None) -> None:
    """Point the GEMM kernel of an output head tied to the embedding at the new table. vLLM's CPU
    build packs the head's weight into its kernel at load; the layerwise reload processes a shared
    weight for one of its layers only (the embedding), so the tied head would keep sampling from the
    old table (the HF logprobs of the new weights then differ; the test of the weight sync reads the
    head through its kernel and catches it). That processing packed the table for the embedding
    (which only looks rows up), from the very tensor the head multiplies by: where the table's kernel
    is new since ``before`` (``table_kernels`` at the reload's start) and both pack alike (unquantized,
    the head without a bias), the head takes it instead of packing the table again (113 MB on SmolLM2
    at every sync); otherwise the head's own processing packs it."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    tables = _tables(model)
    for module in model.modules():
        if isinstance(module, ParallelLMHead) and id(module.weight) in tables:
            table = tables[id(module.weight)]
            kernel = getattr(table, "cpu_linear", None)
            fresh = kernel is not None and before is not None and kernel is not before.get(id(table))
            alike = all(isinstance(m.quant_method, UnquantizedEmbeddingMethod) for m in (table, module))
            if fresh and alike and getattr(module, "bias", None) is None:
                module.cpu_linear = kernel
            else:
                module.quant_method.process_weights_after_loading(module)


def _tables(model: torch.nn.Module) -> dict:
    """id of each input embedding's weight -> the embedding module (output heads left out)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    return {id(m.weight): m for m in model.modules()
            if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}


def model_weights(model: torch.nn.Module) -> dict:
    """HF name -> the weight vLLM's kernels compute with, read inside a vLLM worker.

    vLLM's CPU build repacks each linear layer's weight (and the output head's) for its GEMM
    kernel, and frees the linear layers' parameters, so those weights are read back through
    the layer itself: ``x @ W.T`` with ``x`` the identity (exact: one product by 1 and
    additions of exact zeros). Fused layers (``qkv_proj``, ``gate_up_proj``: the model's
    ``packed_modules_mapping``) are split back into the HF parameters by the layer's
    ``output_sizes``, their biases alike. Vocabulary tables lose the rows vLLM pads them with.
    An output head tied to the embedding is no parameter of its own (as in HF): where its
    kernel and the table disagree, the kernel's copy is what this returns for the table."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())  # a tied head's weight appears once, under the embedding
    out, heads = {}, {}
    with torch.no_grad():
        for name, module in modules.items():
            if isinstance(module, LinearBase):
                weight = _through_kernel(module, module.input_size)
                for part, (w, b) in _split_fused(name, module, packed, weight, getattr(module, "bias", None)).items():
                    out[f"{part}.weight"] = w
                    if b is not None:  # vLLM's small-GEMM path may hold the bias in fp32
                        out[f"{part}.bias"] = b.detach().to(module.params_dtype).contiguous()
            elif isinstance(module, ParallelLMHead):
                heads[name] = _through_kernel(module, module.embedding_dim)[: module.org_vocab_size]
        for name, p in params.items():
            owner = modules[name.rpartition(".")[0]]
            if isinstance(owner, VocabParallelEmbedding):
                out[name] = p.detach()[: owner.org_vocab_size]
            elif not isinstance(owner, LinearBase):
                out[name] = p.detach()
        for name, weight in heads.items():
            if f"{name}.weight" in params:
                out[f"{name}.weight"] = weight
                continue
            table = next(n for n, p in params.items() if p is modules[name].weight)
            if not torch.equal(weight, out[table]):
                out[table] = weight
    return out


def _through_kernel(module: torch.nn.Module, input_size: int) -> torch.Tensor:
    """The (out, in) weight a linear-like vLLM layer multiplies by, read as ``I @ W.T``."""
    eye = torch.eye(input_size, dtype=module.params_dtype, device=_device(module))
    return module.quant_method.apply(module, eye).t().contiguous()


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def _split_fused(name: str, module, packed: dict, weight: torch.Tensor, bias) -> dict:
    """{HF module name: (weight, bias)} of one vLLM linear layer."""
    prefix, _, leaf = name.rpartition(".")
    if leaf not in packed:
        return {name: (weight, bias)}
    parts = [f"{prefix}.{p}" if prefix else p for p in packed[leaf]]
    sizes = list(module.output_sizes)
    if len(parts) != len(sizes):  # a fused layer that HF also fuses (one name for all parts)
        return {name: (weight, bias)}
    weights = [w.contiguous() for w in weight.split(sizes)]
    biases = bias.detach().split(sizes) if bias is not None else [None] * len(parts)
    return {p: (w, b) for p, w, b in zip(parts, weights, biases)}


def worker_weight_checksums(worker) -> dict:
    """``collective_rpc`` target: HF name -> sha1 of the weight's bytes, as ``tensor_checksums``
    hashes a trainer's or an HF generator's parameters."""
    from rl_actors.weight_sync import tensor_checksums

    return tensor_checksums(model_weights(worker.model_runner.get_model()).items())


def worker_broadcast_probe(worker, numel: int, dtype: str) -> float:
    """``collective_rpc`` target: seconds of one raw broadcast of ``numel`` elements in this
    worker's sync group (the baseline a weight sync into vLLM is measured against)."""
    from rl_actors.weight_sync import DTYPES, raw_broadcast

    engine = worker.weight_transfer_engine
    if not isinstance(engine, BucketWeightTransferEngine):
        raise RuntimeError(f"the raw-broadcast probe measures the {BACKEND} engine, not {type(engine).__name__}")
    return raw_broadcast(engine.group, numel, DTYPES[dtype], engine.rank, engine.buffers)
