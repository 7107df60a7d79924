"""The generator's sampler lives on its model's device: torch's random draws refuse a CPU
generator for CUDA probabilities ("Expected a 'cuda' device type for generator"), which crashed
generator workers and generation hosted on trainer ranks on GPUs at the first sampled token.
CI has no GPU: the meta device stands in for CUDA (a model moves there, though it cannot run),
and ``torch.Generator`` is recorded to see which device each sampler is asked for. The seeding
rule stays: the same seed, rank, policy version and prompts give the same stream."""
import copy

import numpy as np
import torch

import rl_actors.generator as generator_module
from primitives.env.tools import ToolConfig
from primitives.io.data import PromptItem
from primitives.model.generation import generate_rollouts
from primitives.types import GenerationConfig
from rl_actors.clock import BusyClock
from rl_actors.generator import GeneratorWorker
from rl_actors.hf_engine import rollout_sampler
from rl_actors.vllm_engine import VLLMEngine

ITEMS = [PromptItem(5, "12+34="), PromptItem(6, "1+2=")]
GEN = GenerationConfig(max_new_tokens=4, n=2, temperature=0.7)


def _hosted(model, tokenizer, rank=1, seed=3):
    return GeneratorWorker.hosted(model, tokenizer, rank=rank, seed=seed, host="trainer 1", host_clock=BusyClock())


def test_generate_and_tool_turns_sample_with_a_generator_on_the_models_device(tiny_model, tokenizer, monkeypatch):
    """A hosted generator whose model is on another device than the CPU (meta, for CUDA) asks
    torch for its sampler on that device, for ``generate`` and for tool-using turns alike, and
    hands the engine that very generator. A sampler hard-coded to the CPU is asked for on cpu."""
    requested, made = [], []
    real_generator = torch.Generator

    def recording_generator(device="cpu"):
        requested.append(torch.device(device))
        made.append(real_generator())  # the meta device has no generator: a CPU one carries the seed
        return made[-1]

    monkeypatch.setattr(torch, "Generator", recording_generator)
    worker = _hosted(copy.deepcopy(tiny_model).to("meta"), tokenizer)
    given = []
    monkeypatch.setattr(worker.engine, "generate", lambda items, gen, version, generator: given.append(generator) or [])
    monkeypatch.setattr(worker.engine, "turns_generator", lambda gen, generator: given.append(generator))
    monkeypatch.setattr(generator_module, "multiturn_rollouts", lambda *args: [])
    worker.generate(ITEMS, GEN)
    worker.generate_multiturn(ITEMS, GEN, ToolConfig(executor=print))
    assert requested == [torch.device("meta"), torch.device("meta")]
    assert len(given) == 2 and given[0] is made[0] and given[1] is made[1]
    assert made[0].initial_seed() == 280600438  # crc32("3/1/0/0/5"): seed 3, rank 1, version 0, epoch 0, index 5


def test_the_sampler_keeps_its_seeding_rule_on_the_models_device(tiny_model, tokenizer):
    """On the CPU the sampler is a CPU generator seeded by (seed, rank, version, first prompt):
    a hosted worker samples exactly what ``generate_rollouts`` samples with ``rollout_sampler``,
    twice the same, and another version draws another stream."""
    worker = _hosted(tiny_model, tokenizer)
    sampler = worker._sampler(ITEMS)
    assert sampler.device == next(tiny_model.parameters()).device == torch.device("cpu")
    assert sampler.initial_seed() == 280600438  # crc32("3/1/0/0/5")
    first, again = worker.generate(ITEMS, GEN), worker.generate(ITEMS, GEN)
    expected = generate_rollouts(tiny_model, tokenizer, ITEMS, GEN, 0,
                                 rollout_sampler(3, 1, 0, ITEMS, device=torch.device("cpu")))
    for a, b, e in zip(first, again, expected):
        assert a.completion_ids.tolist() == b.completion_ids.tolist() == e.completion_ids.tolist()
        assert np.array_equal(a.logprobs, e.logprobs)
    worker.policy_version = 2
    assert worker._sampler(ITEMS).initial_seed() == 1786366998  # crc32("3/1/2/0/5")


def test_vllm_samples_in_its_own_processes_without_a_torch_generator():
    """vLLM seeds its own sampling (``SamplingParams.seed``): its engine asks for no torch
    generator (so a vLLM actor makes none on its GPU), only the integer the HF sampler is seeded
    with, and each request of a call gets a seed of its own (a GRPO group's rows differ)."""
    from rl_actors.hf_engine import rollout_sampler, sampler_key
    from rl_actors.vllm_engine import vllm_seeds

    engine = VLLMEngine.__new__(VLLMEngine)  # no engine started: only the sampler rule is read
    seed = engine.sampler(3, 1, 0, ITEMS)
    assert isinstance(seed, int) and seed == sampler_key(3, 1, 0, ITEMS)
    assert rollout_sampler(3, 1, 0, ITEMS).initial_seed() == seed  # the HF engine's key, the same call
    assert seed != engine.sampler(3, 1, 1, ITEMS) != engine.sampler(3, 2, 0, ITEMS)  # version and rank count
    assert vllm_seeds(seed, 4) == [(seed + j) % 2 ** 31 for j in range(4)] and len(set(vllm_seeds(seed, 8))) == 8


def test_vllm_tool_turns_take_the_next_seeds_a_round_at_a_time(monkeypatch):
    """A round of tool turns is one engine call; its requests take the next seeds of the call's stream, so no
    two turns of a call (two rows of a GRPO group, or a conversation's later turn) share a seed."""
    engine = VLLMEngine.__new__(VLLMEngine)  # no engine started: only the seed rule is read
    bases = []
    monkeypatch.setattr(engine, "_outputs", lambda contexts, gen, base: bases.append((base, len(contexts))) or
                        [None] * len(contexts))
    turns = engine.turns_generator(GEN, 100)
    for round_rows in (4, 3, 1):
        assert turns([np.zeros(2, np.int64)] * round_rows) == [None] * round_rows
    assert bases == [(100, 4), (104, 3), (107, 1)]


def test_vllms_token_ranks_are_counted_eagerly_on_the_cpu(monkeypatch):
    """``count_at_least`` gives the rank vLLM reports with a sampled token (1 for the likeliest, ties counted),
    and ``eager_token_ranks`` puts it in place of vLLM's compiled count in the sampler, where vLLM has one (a
    stand-in vLLM here; the real one in ``test_vllm_generator``: the worker reports it replaced)."""
    import sys
    import types

    from rl_actors.vllm_engine import count_at_least, eager_token_ranks

    logprobs = torch.tensor([[-0.1, -2.0, -0.1, -5.0], [-3.0, -1.0, -0.5, -0.2], [-1.0, -1.5, -2.5, -0.7]])
    sampled = torch.tensor([[-0.1], [-3.0], [-0.7]])
    assert count_at_least(logprobs, sampled).tolist() == [2, 4, 1]  # a tie with the sampled token counts
    assert count_at_least(logprobs, sampled).dtype == torch.int64

    sampler = types.ModuleType("vllm.v1.sample.sampler")
    package = types.ModuleType("vllm.v1.sample")
    package.sampler = sampler
    for name, module in {"vllm": types.ModuleType("vllm"), "vllm.v1": types.ModuleType("vllm.v1"),
                         "vllm.v1.sample": package, "vllm.v1.sample.sampler": sampler}.items():
        monkeypatch.setitem(sys.modules, name, module)
    assert eager_token_ranks() is False and not hasattr(sampler, "batched_count_greater_than")  # nothing to replace
    sampler.batched_count_greater_than = lambda x, values: None
    assert eager_token_ranks() is True and sampler.batched_count_greater_than is count_at_least
