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
from tests.rewards import spread_reward

T = 0.7
GEN = GenerationConfig(max_new_tokens=4, n=4, temperature=T)
LORA = LoraConfig(rank=4, alpha=16.0)  # all-linear


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


def test_rl_starts_from_the_sft_stage_adapters_and_a_restore_keeps_them(ray_local, tiny_model_path):
    """The RL job's SFT stage on the adapters (``cluster.jobs.rl.sft_stage``, as the job runs it), then
    the places where the SFT'd adapters could be lost: the sync to the generator worker holds them,
    the reference becomes them (not the base model), the optimizer's reset keeps them, and the
    snapshot taken right after the stage restores them, when a trainer rank is killed in the first RL
    step (at learning rate 0, so the step leaves every weight where the stage left it)."""
    import signal

    from transformers import AutoTokenizer

    from cluster.jobs.config import RLConfig, RLJob, SFTConfig
    from cluster.jobs.inputs import RLInputs, sft_samples
    from cluster.jobs.rl import sft_stage
    from cluster.ray_wing.config import ClusterConfig
    from primitives.fixtures.tasks import arithmetic_task
    from tests.chaos import signal_when

    job = RLJob(sft=SFTConfig(steps=3, batch=8, lr=3e-2), algorithm=RLConfig(lr=0.0))
    samples, _ = sft_samples(job.sft, AutoTokenizer.from_pretrained(tiny_model_path),
                             arithmetic_task(num_train=32, num_heldout=1))
    inputs = RLInputs(job, [], [], samples, [], None, None, (), None, {}, None)
    cfg = ClusterConfig(generators=1, trainers=2, reward_workers=1, call_timeout_s=300)
    cluster = build_rl_cluster(ModelConfig(tiny_model_path, lora=LORA), cfg, TrainerConfig(zero_stage=2, lr=3e-2),
                               spread_reward, with_reference=True, bucket_mb=0.5)
    backend = RayBackend(cluster, max_actor_restarts=2, snapshot_every=1)
    try:
        start = gather([call(cluster.trainers, 0, "weight_checksums")], 300)[0]
        logged = []
        sft_stage(backend, inputs, logged.append)
        assert [m["step"] for m in logged if "loss/sft" in m] == [0, 1, 2]
        sft = gather([call(cluster.trainers, 0, "weight_checksums")], 300)[0]
        moved = {n for n in sft if sft[n] != start[n]}
        assert {n for n in moved if ".lora_A." in n} and {n for n in moved if ".lora_B." in n}  # both moved
        held = gather(fan_out(cluster.generators.group, "weight_checksums"), 300)[0]
        assert {n: held[n] for n in sft} == sft  # the generator worker samples with the SFT'd adapters
        assert gather([call(cluster.trainers, 1, "reference_checksums")], 300)[0] == sft
        backend.prepare_recovery()  # the snapshot: right after the stage, as the job takes it
        killed = signal_when("TrainerWorker", "train_planned", signal.SIGKILL)
        state = train(backend, make_prompt_source(_items(), seed=1), constant_schedule(grpo(kl_coef=0.05)),
                      RLRun(GEN, num_steps=1, prompts_per_step=4, lr_schedule=lambda s: 0.0, progress=False))
        assert killed and [f["role"] for f in backend.faults] == ["trainer"]
        c = backend.cluster
        assert gather([call(c.trainers, r, "weight_checksums") for r in range(2)], 300) == [sft, sft]
        assert gather([call(c.trainers, r, "reference_checksums") for r in range(2)], 300) == [sft, sft]
        first = state.metrics_history[0]
        assert abs(first["kl/ref_k3"]) < 1e-7 and first["mismatch/max_abs_logp_diff"] < 1e-5, first
    finally:
        shutdown_cluster(backend.cluster)
