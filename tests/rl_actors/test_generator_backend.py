"""Which engine a generator worker builds (``generator_backend``), and what choosing costs: on a
machine without a GPU, ``auto`` builds the HF engine without importing vLLM (about 5 s of CPU in
every generator process)."""
import pytest

import rl_actors.generator as generator_module
import rl_actors.vllm_engine as vllm_engine
from primitives.types import ModelConfig


def _no_vllm_import():
    raise AssertionError("vLLM was imported to choose the engine on a machine without a GPU")


@pytest.mark.parametrize("gpu", [False, True])
def test_auto_imports_vllm_only_where_a_gpu_is_visible(monkeypatch, gpu):
    imported = []
    monkeypatch.setattr(vllm_engine, "gpu_visible", lambda: gpu)
    monkeypatch.setattr(vllm_engine, "vllm_importable", (lambda: imported.append(1) or True) if gpu
                        else _no_vllm_import)
    assert vllm_engine.vllm_available() is gpu
    assert imported == ([1] if gpu else [])


def test_an_auto_generator_on_the_cpu_builds_the_hf_engine_without_vllm(monkeypatch, tiny_model_path):
    monkeypatch.setattr(vllm_engine, "gpu_visible", lambda: False)
    monkeypatch.setattr(vllm_engine, "vllm_importable", _no_vllm_import)
    monkeypatch.setattr(generator_module, "vllm_importable", _no_vllm_import)
    worker = generator_module.GeneratorWorker(ModelConfig(tiny_model_path), backend="auto")
    assert type(worker.engine).__name__ == "HFEngine"


@pytest.mark.parametrize("on_gpu, block_size, expected", [
    (False, None, {"enable_chunked_prefill": False, "block_size": 32}),  # vLLM's CPU default 128 shares no chat prompt
    (False, 64, {"enable_chunked_prefill": False, "block_size": 64}),
    (True, None, {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.9, "enable_sleep_mode": False}),
    (True, 16, {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.9, "enable_sleep_mode": False,
                "block_size": 16}),
], ids=["cpu-default", "cpu-set", "gpu-vllm-default", "gpu-set"])
def test_the_engines_device_arguments(on_gpu, block_size, expected):
    """On CPU: no chunked prefill (a seeded prompt split over two steps kills vLLM's CPU engine)
    and KV blocks of 32 tokens unless set; on a GPU vLLM's own block size unless set."""
    from primitives.types import VLLMConfig

    assert vllm_engine.llm_device_kwargs(VLLMConfig(block_size=block_size), on_gpu) == expected
