"""Our weight-transfer engine inside vLLM (``rl_actors.vllm_transfer``), driven without a vLLM
engine: one wire on both devices. The init info names the group's backend; buckets land on the
CPU for gloo and on the worker's GPU for NCCL, the only difference between the two paths. Over
gloo in this process, the engine receives a sender's buckets (``broadcast_buckets``, as the
trainer sends them) and loads each parameter by its HF name, bucket by bucket. The whole path
into a running vLLM is ``test_vllm_generator.py``'s."""
import threading
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
# vLLM's import alone takes seconds: the full suite's, not the edit-test loop's
pytestmark = [pytest.mark.slow, pytest.mark.no_ray]

from rl_actors.vllm_transfer import (  # noqa: E402
    BACKEND,
    BucketInitInfo,
    BucketWeightTransferEngine,
    init_info,
    receive_device,
    update_info,
)
from rl_actors.weight_sync import SyncAddress, broadcast_buckets, free_port, init_sync_group, model_meta  # noqa: E402


def test_the_backend_decides_where_buckets_land():
    assert receive_device("gloo", torch.device("cuda", 0)) == torch.device("cpu")
    assert receive_device("gloo", torch.device("cpu")) == torch.device("cpu")
    assert receive_device("nccl", torch.device("cuda", 1)) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=f"{BACKEND} weight transfer: an nccl sync group needs a vLLM worker on a GPU"):
        receive_device("nccl", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        receive_device("mpi", torch.device("cpu"))
    for backend in ("gloo", "nccl"):
        info = BucketInitInfo(**init_info(SyncAddress("10.0.0.1", 1234, 3, backend, "a-forming"), 2))
        assert (info.host, info.port, info.world_size, info.rank, info.backend, info.token) == (
            "10.0.0.1", 1234, 3, 2, backend, "a-forming")  # the token names the group's keys in its store


def test_the_engine_joins_the_named_backend_with_buffers_on_the_workers_gpu(monkeypatch):
    """What differs on a GPU, with the group itself faked (NCCL cannot run here): the engine joins an
    nccl group at the init info's address and receives into buffers on its worker's GPU; the same
    engine on a CPU worker refuses nccl by name before joining anything."""
    import rl_actors.vllm_transfer as transfer

    joined = []
    monkeypatch.setattr(transfer, "init_sync_group", lambda address, rank, timeout_s: joined.append((address, rank))
                        or "group")
    config = SimpleNamespace(parallel_config=None, model_config=None)
    gpu = BucketWeightTransferEngine(None, config, torch.device("cuda", 0), Receiver())
    gpu.init_transfer_engine(BucketInitInfo(**init_info(SyncAddress("10.0.0.1", 1234, 3, "nccl", "t"), 2)))
    assert joined == [(SyncAddress("10.0.0.1", 1234, 3, "nccl", "t"), 2)]
    assert (gpu.group, gpu.rank, gpu.buffers) == ("group", 2, torch.device("cuda", 0))
    cpu = BucketWeightTransferEngine(None, config, torch.device("cpu"), Receiver())
    with pytest.raises(ValueError, match="an nccl sync group needs a vLLM worker on a GPU"):
        cpu.init_transfer_engine(BucketInitInfo(**init_info(SyncAddress("10.0.0.1", 1234, 3, "nccl"), 2)))
    assert len(joined) == 1


class Receiver(torch.nn.Module):
    """What the engine needs of vLLM's model: parameters and ``load_weights((name, tensor), ...)``."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 7)
        self.b = torch.nn.Linear(7, 3, bias=False)
        self.loads = []

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        names = []
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            names.append(name)
        self.loads.append(names)


def test_the_engine_receives_the_trainers_buckets_over_gloo():
    torch.manual_seed(0)
    source, receiver = Receiver(), Receiver()
    meta = model_meta(source.named_parameters())
    port = free_port("127.0.0.1")
    address = SyncAddress("127.0.0.1", port, 2, "gloo")
    engine = BucketWeightTransferEngine(None, SimpleNamespace(parallel_config=None, model_config=None),
                                        torch.device("cpu"), receiver)
    sent = {}

    def send():
        group = init_sync_group(address, 0)
        params = dict(source.named_parameters())
        sent["bytes"] = broadcast_buckets(group, meta, 200, 0, torch.device("cpu"),
                                          get_tensors=lambda ms: [params[m.name].data for m in ms])

    sender = threading.Thread(target=send)
    sender.start()
    engine.init_transfer_engine(BucketInitInfo(**init_info(address, 1)))
    engine.receive_weights(engine.parse_update_info(update_info(meta, 200)))
    sender.join(timeout=60)
    assert engine.buffers == torch.device("cpu")
    for name, p in source.named_parameters():
        assert torch.equal(dict(receiver.named_parameters())[name], p), name
    # buckets of at most 200 bytes: a.weight (140 B), a.bias (28 B) together, then b.weight (84 B)
    assert receiver.loads == [["a.weight", "a.bias"], ["b.weight"]]
    assert sent["bytes"] == sum(m.nbytes for m in meta)


def _bare(cls, **attrs):
    """A vLLM layer of ``cls`` without its constructor (which wants vLLM's distributed state)."""
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    for name, value in attrs.items():
        setattr(module, name, value)
    return module


def test_a_tied_head_takes_the_tables_new_kernel_and_packs_its_own_otherwise():
    """``refresh_tied_heads``: a head tied to the embedding takes the kernel the reload packed for the
    table (no second packing of the same tensor); where the table kept its kernel (a sync cut before the
    table's layer, or no kernel start to compare), the head packs its own; an untied head is left alone."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    from rl_actors.vllm_transfer import refresh_tied_heads, table_kernels

    class Packs(UnquantizedEmbeddingMethod):
        def __init__(self, packed):
            self.packed = packed

        def process_weights_after_loading(self, layer):
            self.packed.append(layer)

    def model(tied: bool, bias=None, quant=Packs):
        table = _bare(VocabParallelEmbedding, weight=torch.nn.Parameter(torch.zeros(4, 2)), cpu_linear="old table",
                      quant_method=Packs([]))
        packed: list = []
        head = _bare(ParallelLMHead, weight=table.weight if tied else torch.nn.Parameter(torch.zeros(4, 2)),
                     bias=bias, cpu_linear="old head", quant_method=quant(packed))
        return torch.nn.ModuleDict({"embed": table, "head": head}), table, head, packed

    root, table, head, packed = model(tied=True)
    before = table_kernels(root)
    assert before == {id(table): "old table"}
    table.cpu_linear = "new table"  # the reload packed the table afresh
    refresh_tied_heads(root, before)
    assert head.cpu_linear == "new table" and packed == []
    for kept in (before, None):  # the table's kernel unchanged, or nothing to compare with: the head packs
        root, table, head, packed = model(tied=True)
        refresh_tied_heads(root, kept if kept is None else table_kernels(root))
        assert head.cpu_linear == "old head" and packed == [head]
    root, table, head, packed = model(tied=False)
    before = table_kernels(root)
    table.cpu_linear = "new table"
    refresh_tied_heads(root, before)
    assert head.cpu_linear == "old head" and packed == []

    class Quantized:  # a head whose quantization packs otherwise than the table
        def __init__(self, packed):
            self.process_weights_after_loading = packed.append

    for kind in ({"bias": torch.nn.Parameter(torch.zeros(4))}, {"quant": Quantized}):
        root, table, head, packed = model(tied=True, **kind)
        before = table_kernels(root)
        table.cpu_linear = "new table"
        refresh_tied_heads(root, before)
        assert head.cpu_linear == "old head" and packed == [head]
