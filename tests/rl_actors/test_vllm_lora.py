"""LoRA on a vLLM generator worker (vLLM's CPU build): only the policy's adapters cross the wire,
and vLLM serves them as a ``LoRARequest`` on the frozen base model.

A vLLM generator and an HF generator (PEFT, the same ``LoraConfig``) receive the same adapter
tensors from this process over a real gloo sync group of 3 ranks (this process is rank 0, the
trainer's place). vLLM's behaviour logprobs of the tokens it sampled must equal the HF worker's
recomputation with the same adapters, and differ from the base model's; a second sync must
replace the adapter (no stale one served). vLLM must import here: a CI without it fails."""
import os
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import torch
import vllm  # noqa: F401  (no skip: the vLLM path runs in every CI)
from transformers import AutoModelForCausalLM

from primitives.io.data import PromptItem
from primitives.model.logprobs import rollout_logprobs
from primitives.model.lora import adapter_names, adapters_off, with_lora
from primitives.types import GenerationConfig, LoraConfig, ModelConfig
from rl_actors.generator import GeneratorWorker
from rl_actors.vllm_engine import vllm_lora_rank
from rl_actors.weight_sync import (
    SyncAddress,
    TensorMeta,
    broadcast_buckets,
    copy_into_model,
    free_port,
    init_sync_group,
    tensor_checksums,
)

# scale 3 (not the default 2); vLLM serves it with max_lora_rank 8. A subset of the targets: q and v without k,
# which vLLM packs into one qkv_proj (the missing slice must stay zero), and one MLP layer; every linear layer
# goes through vLLM in tests/cluster/test_vllm_jobs.py's LoRA job
LORA = LoraConfig(rank=4, alpha=12.0, target_modules=("q_proj", "v_proj", "down_proj"))
BUCKET_BYTES = 32 * 2 ** 10  # several buckets a sync (the adapters are tens of KiB)
TIMEOUT_S = 300
# measured on this CPU, fp32 (2026-11-26, with every linear layer adapted; this subset passes the same bound):
# vLLM's LoRA logprobs and the HF PEFT model's of the same tokens differ by at most 9.5e-7 (4.8e-7 without an
# adapter); the bound leaves 10x for another CPU.
# These adapters move them 0.75 from the base model's, and the second adapter 0.66 from the first
# (vLLM serving the first adapter again, under a reused id, puts the second sync's gap at 0.55).
PARITY = 1e-5
PROMPTS = [PromptItem(i, text) for i, text in enumerate(["12+34=", "7*8 is ", "Hello, wor", "abc"])]
GEN = GenerationConfig(max_new_tokens=8, n=3, temperature=1.0)


def test_vllm_lora_rank_is_the_smallest_accepted_rank_that_holds_the_adapters():
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError, match="model.lora.rank: vLLM serves adapters of rank at most 512, got 513"):
        vllm_lora_rank(513)


@pytest.fixture(scope="module")
def trainer_side(tiny_model_path):
    """The trainer's view: the tiny model in the policy's adapters (PEFT names, as a sync sends them)."""
    return with_lora(AutoModelForCausalLM.from_pretrained(tiny_model_path), LORA).eval()


def random_adapter(policy, seed: int) -> dict:
    """Adapter tensors by the trainer's names, seeded, B non-zero (so the policy is not the base model)."""
    g = torch.Generator().manual_seed(seed)
    params = dict(policy.named_parameters())
    return {n: 0.1 * torch.randn(params[n].shape, generator=g) for n in adapter_names(params)}


@pytest.fixture(scope="module")
def workers(ray_local, tiny_model_path):
    """A vLLM and an HF generator with ``LORA``, joined with this process in one gloo sync group."""
    model = ModelConfig(tiny_model_path, lora=LORA)
    worker = ray.remote(GeneratorWorker).options(num_cpus=1)
    vllm_gen = worker.remote(model, rank=0, backend="vllm", num_threads=1)
    hf_gen = worker.remote(model, rank=1, backend="hf", num_threads=1)
    address = SyncAddress("127.0.0.1", free_port(), 3, "gloo")
    joined = [vllm_gen.init_weight_sync.remote(address, 1), hf_gen.init_weight_sync.remote(address, 2)]
    group = init_sync_group(address, 0, timeout_s=TIMEOUT_S)
    ray.get(joined, timeout=TIMEOUT_S)
    yield SimpleNamespace(vllm=vllm_gen, hf=hf_gen, group=group)
    for actor in (vllm_gen, hf_gen):
        ray.kill(actor)


def sync(workers, tensors: dict, version: int) -> tuple:
    """One sync of ``tensors`` from this process (rank 0): (bytes sent, bytes each worker received)."""
    meta = [TensorMeta(n, tuple(t.shape), "float32") for n, t in tensors.items()]
    received = [w.receive_weights.remote(meta, BUCKET_BYTES, version) for w in (workers.vllm, workers.hf)]
    sent = broadcast_buckets(workers.group, meta, BUCKET_BYTES, 0, torch.device("cpu"),
                             get_tensors=lambda metas: [tensors[m.name] for m in metas])
    return sent, ray.get(received, timeout=TIMEOUT_S)


def vllm_rollouts(workers) -> list:
    return ray.get(workers.vllm.generate.remote(PROMPTS, GEN), timeout=TIMEOUT_S)


def local_logprobs(policy, rollouts, tensors=None) -> list:
    """Logprobs of ``rollouts`` by this process's PEFT model with ``tensors`` as its adapters (None: adapters off)."""
    if tensors is None:
        with adapters_off(policy):
            return rollout_logprobs(policy, rollouts, 0, GEN.temperature)
    copy_into_model(policy, [TensorMeta(n, tuple(t.shape), "float32") for n, t in tensors.items()],
                    list(tensors.values()))
    return rollout_logprobs(policy, rollouts, 0, GEN.temperature)


def gap(logprobs, rollouts) -> float:
    return max(float(np.abs(lp - r.logprobs).max()) for lp, r in zip(logprobs, rollouts))


def vllm_state(workers) -> tuple:
    """(adapter ids loaded in vLLM, whether the adapter's directory is still on disk) inside the vLLM worker."""
    def read(worker):
        request = worker.engine.weights.lora_request
        return worker.engine.llm.llm_engine.list_loras(), request is not None and os.path.exists(request.lora_path)

    return ray.get(workers.vllm.__ray_call__.remote(read), timeout=TIMEOUT_S)


def test_before_any_sync_vllm_samples_from_the_base_model(workers, trainer_side):
    """Version 0: the policy's B is zero, so vLLM serves the base model, no adapter loaded."""
    rollouts = vllm_rollouts(workers)
    assert gap(local_logprobs(trainer_side, rollouts), rollouts) < PARITY
    assert ray.get(workers.vllm.weight_checksums.remote(), timeout=TIMEOUT_S) == {}
    assert vllm_state(workers) == (set(), False)


def test_synced_adapters_are_what_vllm_samples_with(workers, trainer_side, tiny_model_path):
    """(a) One sync of random adapters: vLLM holds exactly them (checksums) and its behaviour
    logprobs equal the HF PEFT worker's with the same adapters, far from the base model's;
    (c) the bytes moved are the adapters' alone."""
    first = random_adapter(trainer_side, seed=1)
    sent, received = sync(workers, first, version=1)
    adapter_bytes = sum(t.numel() * 4 for t in first.values())
    full_bytes = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(tiny_model_path).parameters())
    assert sent == received[0] == received[1] == adapter_bytes
    assert adapter_bytes * 15 < full_bytes  # rank 4 of 128-wide layers: about 1/20 of the model

    expected = tensor_checksums(first.items())
    assert ray.get(workers.vllm.weight_checksums.remote(), timeout=TIMEOUT_S) == expected
    hf = ray.get(workers.hf.weight_checksums.remote(), timeout=TIMEOUT_S)
    assert {n: hf[n] for n in expected} == expected

    rollouts = vllm_rollouts(workers)
    assert {r.policy_version for r in rollouts} == {1}
    hf_logprobs = ray.get(workers.hf.logprobs.remote(rollouts, GEN.temperature), timeout=TIMEOUT_S)
    print(f"vLLM vs HF with adapters: {gap(hf_logprobs, rollouts):.2e}; "
          f"vs the base: {gap(local_logprobs(trainer_side, rollouts), rollouts):.2e}")
    assert gap(hf_logprobs, rollouts) < PARITY
    assert gap(local_logprobs(trainer_side, rollouts, first), rollouts) < PARITY  # the trainer's own model agrees
    assert gap(local_logprobs(trainer_side, rollouts), rollouts) > 1e4 * PARITY
    assert vllm_state(workers) == ({1}, False)  # loaded at the sync; its files are gone


def test_a_second_sync_replaces_the_adapter(workers, trainer_side):
    """(b) Other adapter values, at the same version number again (a driver may reset versions):
    vLLM samples with the new adapters, not the cached old ones, which it no longer holds."""
    first, second = random_adapter(trainer_side, seed=1), random_adapter(trainer_side, seed=2)
    sync(workers, second, version=1)
    assert ray.get(workers.vllm.weight_checksums.remote(), timeout=TIMEOUT_S) == tensor_checksums(second.items())
    rollouts = vllm_rollouts(workers)
    hf_logprobs = ray.get(workers.hf.logprobs.remote(rollouts, GEN.temperature), timeout=TIMEOUT_S)
    print(f"second adapter, vLLM vs HF: {gap(hf_logprobs, rollouts):.2e}; "
          f"vs the first adapter: {gap(local_logprobs(trainer_side, rollouts, first), rollouts):.2e}")
    assert gap(hf_logprobs, rollouts) < PARITY
    assert gap(local_logprobs(trainer_side, rollouts, first), rollouts) > 1e4 * PARITY
    assert vllm_state(workers) == ({2}, False)
