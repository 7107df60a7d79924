"""Shared fixtures: the embedded tiny tokenizer and a randomly initialised tiny Qwen2."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("TQDM_DISABLE", "1")
# Ray reads this when imported: a local Ray then binds 127.0.0.1 (tests stay on loopback)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("WANDB_SILENT", "true")


def run_job(args: list):
    """``rayrl <args>`` (e.g. ``["rl", "job.yaml", "--algorithm.steps", "2"]``) through the
    command-line entry point, on a Ray of its own that is shut down after it; its summary."""
    import ray

    from cluster.jobs.cli import run

    ray.shutdown()
    try:
        return run(list(args))
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def tokenizer():
    from primitives.fixtures.tiny import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    from primitives.fixtures.tiny import TinyModelSpec, build_tiny_model

    model = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2),
                             seed=1)
    model.eval()
    return model


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for one test module (loopback, 8 logical CPUs), shut down after it."""
    import ray

    ray.shutdown()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "TQDM_DISABLE": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """The embedded tiny model saved in HF format (random init)."""
    from primitives.fixtures.tiny import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"), seed=0)


def scored_rollouts(path, num_prompts=4, n=4, seed=0):
    """Rollouts of the tiny model on arithmetic prompts, scored by exact match."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primitives.env.rewards import score_rollouts
    from primitives.fixtures.tasks import ArithmeticTaskSpec, arithmetic_reward, make_arithmetic_task
    from primitives.model.generation import generate_rollouts
    from primitives.types import GenerationConfig

    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=num_prompts, num_heldout=1, seed=seed))[0]
    rs = generate_rollouts(model, tok, items, GenerationConfig(max_new_tokens=4, n=n),
                           generator=torch.Generator().manual_seed(seed))
    # a reward that varies with the sampled tokens, so groups have spread (a random model
    # never gets a sum right, and always fills max_new_tokens)
    return score_rollouts(rs, lambda r: float(int(r.completion_ids.sum()) % 3) + arithmetic_reward(r)), tok


def lora_numel(path, rank):
    """Parameters of rank-``rank`` adapters on every linear layer but the output head of the model at
    ``path``, counted by hand: ``rank * (in + out)`` each (a second computation of what PEFT builds)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    head = model.get_output_embeddings()
    return sum(rank * (m.in_features + m.out_features) for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m is not head)
