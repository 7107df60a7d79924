"""What only a GPU runs, run on one (CI has none: every test here skips without CUDA). The same
checks have CPU twins that CI runs (named in each test); these close the device side:

* captured decoding (``GenerationConfig.decode='captured'``: a static KV cache, the step compiled with
  CUDA graphs) samples the eager loop's tokens from the same seed, logprobs within 1e-5 in fp32
  (twin: ``tests/primitives/test_static_decode.py``, traced with dynamo's ``eager`` backend there), and
  batches of one bucket compile the step once;
* the weight sync from a bf16 trainer rank on the GPU into an HF generator on the GPU: the same
  ``broadcast_buckets`` wire the CPU tests drive, its receive buffers on the GPU. Over gloo on one GPU
  (NCCL refuses two ranks on one device); over NCCL, the generator on a second GPU, where there is one.

``benchmarks/gpu_step.py`` times the same paths; these only check their numbers."""
import copy

import pytest
import torch

pytestmark = [pytest.mark.no_ray, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")]

from tests.primitives.decoding import PROMPTS, SAMPLING_IDS, SAMPLINGS, assert_samples_alike, sample  # noqa: E402


@pytest.fixture(scope="module")
def cuda_model(tiny_model):
    """The tiny model in fp32 on the GPU, matmuls in full fp32 (no TF32), as the CPU twin runs."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield copy.deepcopy(tiny_model).to("cuda")
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_captured_decoding_samples_what_the_eager_loop_samples_on_cuda(cuda_model, tokenizer, sampling):
    eager = sample(cuda_model, tokenizer, "eager", **sampling)
    captured = sample(cuda_model, tokenizer, "captured", **sampling)
    assert_samples_alike(captured, eager, cuda_model, tokenizer, sampling)


def test_captured_decoding_compiles_once_per_bucket_on_cuda(cuda_model, tokenizer):
    """Batches of 3 and 4 rows (one row bucket), prompts of other widths (one position bucket):
    one graph traced by dynamo; 5 rows (the next bucket) one more. (Counted at dynamo's level: the
    CUDA-graph recordings under it are not counted here.)"""
    import torch._dynamo as dynamo

    dynamo.reset()
    dynamo.utils.counters.clear()
    sample(cuda_model, tokenizer, "captured", n=1)
    first = dynamo.utils.counters["stats"]["unique_graphs"]
    assert first >= 1
    sample(cuda_model, tokenizer, "captured", n=1, prompts=PROMPTS[:3])
    sample(cuda_model, tokenizer, "captured", n=1, prompts=["7+7=", "1+1="] * 2)
    assert dynamo.utils.counters["stats"]["unique_graphs"] == first
    sample(cuda_model, tokenizer, "captured", n=1, prompts=PROMPTS + ["5"])
    assert dynamo.utils.counters["stats"]["unique_graphs"] > first
    dynamo.reset()


def _trainer_and_generator(path, generator_device: str):
    from primitives.types import ModelConfig
    from rl_actors.generator import GeneratorWorker
    from rl_actors.trainer import TrainerConfig, TrainerWorker
    from rl_actors.weight_sync import free_port

    trainer = TrainerWorker(ModelConfig(path), 0, 1, TrainerConfig(zero_stage=2, lr=1e-5), seed=0, num_threads=1)
    trainer.setup("127.0.0.1", free_port("127.0.0.1"))
    generator = GeneratorWorker(ModelConfig(path, device=generator_device, dtype="bfloat16"), rank=0, backend="hf")
    return trainer, generator


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_bf16_trainer_rank_on_the_gpu_syncs_an_hf_generator_on_the_gpu(tiny_model_path, backend):
    """The trainer's weights are moved off the generator's first (each weight plus 0.01 * its index: every
    one differs), then one sync: the generator holds the trainer's bf16 weights bit for bit, received in
    buffers on its GPU. Over gloo both sit on GPU 0; NCCL refuses two ranks on one GPU, so over NCCL the
    generator takes GPU 1 (a machine of one GPU skips it)."""
    from cluster.jobs.inputs import side_by_side
    from rl_actors.weight_sync import SyncAddress, free_port

    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL refuses two ranks on one GPU; this machine has one")
    trainer, generator = _trainer_and_generator(tiny_model_path, "cuda:1" if backend == "nccl" else "cuda:0")
    try:
        assert trainer.info()["bf16"] and generator.engine.device.type == "cuda"
        with torch.no_grad():
            for i, p in enumerate(trainer.module.parameters()):
                p.add_(0.01 * (i + 1))
            sent = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
            held = dict(generator.engine.model.named_parameters())
            for name, p in sent.items():
                assert not torch.equal(held[name], p.to(held[name].device, torch.bfloat16)), name
        address = SyncAddress("127.0.0.1", free_port(), 2, backend)
        meta = trainer.weight_meta()
        # the generator, rank 1, in a second thread of this process (side_by_side: its error is raised here)
        joined = []
        assert side_by_side(lambda: generator.init_weight_sync(address, 1),
                            lambda: joined.append(trainer.init_weight_sync(address))) and joined == [True]
        moved = side_by_side(lambda: generator.receive_weights(meta, 1 << 16, 1),
                             lambda: trainer.send_weights(meta, 1 << 16))  # small buckets, one GPU buffer
        assert moved == sum(m.nbytes for m in meta) and len(meta) == len(sent)
        held = dict(generator.engine.model.named_parameters())
        for name, p in sent.items():
            assert held[name].dtype == torch.bfloat16 and held[name].device == generator.engine.device
            assert torch.equal(held[name], p.to(held[name].device, torch.bfloat16)), name
        assert generator.policy_version == 1
    finally:  # the engines, the DeepSpeed group and both sync groups (bare groups: dropped with their owners)
        trainer.release()
        generator.release()
