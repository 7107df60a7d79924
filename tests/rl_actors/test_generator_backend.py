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
