"""What a trainer rank hands a weight sync into vLLM (``TrainerWorker.sync_items``, the iterator
vLLM's packed NCCL producer consumes on a GPU), run here on one CPU rank without Ray: every
parameter in ``weight_meta`` order with the values the rank holds; under ZeRO-3 no more than one
bucket's parameters are whole at any item, and a tensor handed out keeps its values after its
bucket's gather ends (the producer may pack several before sending)."""
import pytest
import torch

from primitives.types import ModelConfig
from rl_actors.trainer import TrainerConfig, TrainerWorker
from rl_actors.weight_sync import bucket_plan, free_port

pytestmark = pytest.mark.slow  # DeepSpeed's import and an engine per stage: 10 s


def whole(module) -> set:
    """Names of the parameters that are whole on this rank now (ZeRO-3's status; always, otherwise)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return {n for n, p in module.named_parameters()
            if getattr(p, "ds_status", ZeroParamStatus.AVAILABLE) == ZeroParamStatus.AVAILABLE}


@pytest.mark.parametrize("stage", [2, 3])
def test_sync_items_are_the_weights_a_bucket_at_a_time(tiny_model_path, stage):
    worker = TrainerWorker(ModelConfig(tiny_model_path), 0, 1, TrainerConfig(zero_stage=stage), seed=0)
    worker.setup("127.0.0.1", free_port("127.0.0.1"))
    try:
        meta = worker.weight_meta()
        bucket_bytes = 64 * 1024  # several buckets on the tiny model
        buckets = [[meta[i].name for i in idx] for idx in bucket_plan(meta, bucket_bytes)]
        assert len(buckets) > 3
        held, seen = [], []
        for name, tensor in worker.sync_items(meta, bucket_bytes):
            bucket = next(b for b in buckets if name in b)
            if stage == 3:
                assert whole(worker.module) <= set(bucket), name  # nothing outside this item's bucket is whole
            held.append((name, tensor))
            seen.append(name)
        assert seen == [m.name for m in meta]
        if stage == 3:
            assert whole(worker.module) == set()  # every gather ended
        expected = worker.ds.full_state()
        for name, tensor in held:  # still the weights, after their gathers ended
            assert torch.equal(tensor, torch.from_numpy(expected[name])), name
    finally:
        worker.release()
