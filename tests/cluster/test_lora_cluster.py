"""LoRA on the cluster (``model.lora``): the trainer ranks send only the adapters, so generator
workers (which wrap the same base in the same adapters) sample exactly what generation on the
trainer ranks samples; the reference (an EMA of the adapters) lives in the trainer ranks' module,
never in a worker; a sync moves the adapters' bytes, a small share of the model's."""
import numpy as np
import pytest

from cluster.loop.train import RLRun, train
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.groups import call, fan_out, gather
from cluster.ray_wing.handles import ReferenceOnTrainers
from cluster.ray_wing.roles import build_rl_cluster, shutdown_cluster
from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task
from primitives.io.data import make_prompt_source
from primitives.maths.algorithms import constant_schedule, grpo
from primitives.maths.kl import create_ema_updater
from primitives.model.lora import adapter_names
from primitives.types import GenerationConfig, LoraConfig, ModelConfig
from rl_actors.trainer import TrainerConfig

T = 0.7
GEN = GenerationConfig(max_new_tokens=4, n=4, temperature=T)
LORA = LoraConfig(rank=4, alpha=16.0)  # all-linear


def spread_reward(rollout) -> float:
    """Rewards that vary with the sampled tokens, so that groups have spread and the policy moves."""
    return float(int(rollout.completion_ids.sum()) % 3)


def _items():
    return make_arithmetic_task(ArithmeticTaskSpec(num_train=16, num_heldout=1, seed=3))[0]


def _run(path, hosted: bool) -> dict:
    from cluster.ray_wing.config import ClusterConfig

    cfg = ClusterConfig(generators=2, trainers=2, reward_workers=1, generate_on_trainers=hosted, call_timeout_s=300)
    cluster = build_rl_cluster(ModelConfig(path, lora=LORA), cfg, TrainerConfig(zero_stage=2, lr=1e-2),
                               spread_reward, with_reference=True, ref_update_fn=create_ema_updater(0.5),
                               bucket_mb=0.5)
    try:
        state = train(RayBackend(cluster), make_prompt_source(_items(), seed=1),
                      constant_schedule(grpo(kl_coef=0.05)),
                      RLRun(GEN, num_steps=3, prompts_per_step=4, lr_schedule=lambda s: 1e-2, progress=False))
        weights = gather([fan_out(cluster.trainers, "full_state")[0]], 300)[0]
        tokens = [r.completion_ids.tolist()
                  for r in gather([cluster.generators.generate(1, _items()[:2], GEN)], 300)[0]]
        return {"metrics": state.metrics_history, "weights": weights, "tokens": tokens, "cluster": cluster,
                "reference": gather([call(cluster.trainers, 0, "reference_checksums")], 300)[0],
                "generators": None if hosted else gather(fan_out(cluster.generators.group, "weight_checksums"), 300),
                "trainer_sums": gather([call(cluster.trainers, 0, "weight_checksums")], 300)[0]}
    finally:
        shutdown_cluster(cluster)


@pytest.fixture(scope="module")
def worker_run(ray_local, tiny_model_path):
    return _run(tiny_model_path, hosted=False)


@pytest.fixture(scope="module")
def hosted_run(ray_local, tiny_model_path, worker_run):
    return _run(tiny_model_path, hosted=True)


def test_the_reference_is_on_the_trainers_and_a_sync_sends_the_adapters_alone(worker_run, tiny_model_path):
    from transformers import AutoModelForCausalLM

    cluster = worker_run["cluster"]
    assert isinstance(cluster.reference, ReferenceOnTrainers)  # no reference worker, though none was asked for
    adapters = adapter_names(worker_run["weights"])
    assert sorted(m.name for m in cluster.weight_meta) == sorted(adapters)
    adapter_bytes = sum(worker_run["weights"][n].size * 4 for n in adapters)
    full = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(tiny_model_path).parameters())
    for m in worker_run["metrics"]:
        assert m["sync/bytes"] == adapter_bytes
    assert adapter_bytes < 0.25 * full
    # each generator holds exactly the trainer's adapters after the last sync
    for sums in worker_run["generators"]:
        assert {n: sums[n] for n in adapters} == worker_run["trainer_sums"]


def test_generator_workers_sample_what_the_trainer_ranks_sample(worker_run, hosted_run):
    keys = ("reward/mean", "reward/std", "loss/total", "loss/kl", "kl/ref_k3", "grad_norm", "policy/entropy")
    for ours, theirs in zip(hosted_run["metrics"], worker_run["metrics"], strict=True):
        for key in keys:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-8), key
    assert worker_run["metrics"][2]["kl/ref_k3"] > 0  # the adapters moved away from the EMA reference
    assert max(float(np.abs(hosted_run["weights"][k] - worker_run["weights"][k]).max())
               for k in hosted_run["weights"]) < 1e-6
    assert hosted_run["reference"] == worker_run["reference"]  # the EMA adapter moved alike
    assert hosted_run["tokens"] == worker_run["tokens"]  # generator rank 1 after 3 steps: the same tokens
    assert len({tuple(t) for t in hosted_run["tokens"]}) > 1
