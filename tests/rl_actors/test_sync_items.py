"""What a trainer rank hands a weight sync (``TrainerWorker.weight_buckets``, which ``send_weights``
broadcasts to every receiver: HF generators, a tracking reference, vLLM on either device), run here
on one CPU rank without Ray: every parameter in ``weight_meta`` order, bucket by bucket as
``bucket_plan`` cuts them, with the values the rank holds; under ZeRO-3 no more than one bucket's
parameters are whole at a time, and every gather has ended afterwards."""
import pytest
import torch

from primitives.types import ModelConfig
from rl_actors.sync_buckets import bucket_plan
from rl_actors.trainer import TrainerConfig, TrainerWorker
from rl_actors.weight_sync import free_port

pytestmark = [pytest.mark.slow, pytest.mark.no_ray]  # DeepSpeed's import and an engine per stage: 10 s


def whole(module) -> set:
    """Names of the parameters that are whole on this rank now (ZeRO-3's status; always, otherwise)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return {n for n, p in module.named_parameters()
            if getattr(p, "ds_status", ZeroParamStatus.AVAILABLE) == ZeroParamStatus.AVAILABLE}


@pytest.mark.parametrize("stage", [2, 3])
def test_weight_buckets_are_the_weights_a_bucket_at_a_time(tiny_model_path, stage):
    worker = TrainerWorker(ModelConfig(tiny_model_path), 0, 1, TrainerConfig(zero_stage=stage), seed=0)
    worker.setup("127.0.0.1", free_port("127.0.0.1"))
    try:
        expected = worker.ds.full_state()
        meta = worker.weight_meta()
        bucket_bytes = 64 * 1024  # several buckets on the tiny model
        buckets = [[meta[i].name for i in idx] for idx in bucket_plan(meta, bucket_bytes)]
        assert len(buckets) > 3
        seen = []
        for metas, tensors in worker.weight_buckets(meta, bucket_bytes):
            names = [m.name for m in metas]
            assert names == buckets[len(seen)]
            if stage == 3:
                assert whole(worker.module) == set(names)  # this bucket whole, nothing else
            for name, tensor in zip(names, tensors):
                assert torch.equal(tensor, torch.from_numpy(expected[name])), name
            seen.append(names)
        assert seen == buckets
        if stage == 3:
            assert whole(worker.module) == set()  # every gather ended
    finally:
        worker.release()
