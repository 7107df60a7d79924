"""One RL loop, two backends (architecture section 8, invariant 7): the same seed and config give the same
metrics on the local backend (one process, plain torch, no Ray) and on a 1-generator,
1-trainer Ray cluster (DeepSpeed ZeRO-2, gloo)."""
import numpy as np
import pytest

from cluster.local import LocalBackend
from cluster.loop.train import Hooks, RLRun, train
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.config import ClusterConfig
from cluster.ray_wing.groups import fan_out, gather
from cluster.ray_wing.roles import build_rl_cluster, shutdown_cluster
from primitives.fixtures.tasks import ArithmeticTaskSpec, arithmetic_reward, make_arithmetic_task
from primitives.io.data import make_prompt_source
from primitives.maths.algorithms import constant_schedule, grpo
from primitives.types import GenerationConfig, planned_rollouts
from rl_actors.trainer import TrainerConfig
from tests.rewards import spread_plus_exact
from tests.rl_actors.test_cluster_sync import _kill_and_wait as kill_and_wait

GEN = GenerationConfig(max_new_tokens=4, n=4, temperature=0.9)
STEPS, PROMPTS, LR = 3, 4, 1e-3


def _train(backend, steps=STEPS, state=None, algo=None):
    from primitives.types import TrainState

    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=16, num_heldout=1, seed=3))[0]
    return train(backend, make_prompt_source(items, seed=5), constant_schedule(algo or grpo(kl_coef=0.05)),
                 RLRun(GEN, num_steps=steps, prompts_per_step=PROMPTS, lr_schedule=lambda step: LR, progress=False),
                 state=state or TrainState())


def _run(backend, steps=STEPS, algo=None):
    return list(_train(backend, steps, algo=algo).metrics_history)


def _comparable(m: dict) -> dict:
    """Numbers that must agree: not timings or idle shares, not the bytes a Ray sync moved, not the
    Ray backend's recovery figures (its snapshots' cost, seconds lost)."""
    return {k: v for k, v in m.items() if not k.startswith(("time/", "idle/", "faults/")) and k != "sync/bytes"}


@pytest.fixture(scope="module")
def local_metrics(tiny_model_path):
    backend = LocalBackend(tiny_model_path, spread_plus_exact, with_reference=True,
                           trainer=TrainerConfig(lr=LR, max_grad_norm=1.0), seed=0)
    return _run(backend)


def test_local_backend_runs_the_loop(local_metrics):
    assert len(local_metrics) == STEPS and local_metrics[-1]["sync/version"] == STEPS
    assert all(m["batch/rows"] == PROMPTS * GEN.n for m in local_metrics)
    assert local_metrics[0]["kl/ref_k3"] == pytest.approx(0.0, abs=1e-9)  # policy == reference before step 1
    assert local_metrics[-1]["kl/ref_k3"] > 1e-6  # and apart after two updates


def test_local_backend_resumes_exactly(tiny_model_path, tmp_path):
    """PPO with an EMA reference on the local backend: 3 steps straight equal 2 steps, save,
    a fresh backend loading the checkpoint, 1 more step (policy, optimizer, critic,
    reference and RNG all restored)."""
    from primitives.maths.algorithms import ppo
    from primitives.maths.kl import create_ema_updater

    def backend():
        return LocalBackend(tiny_model_path, spread_plus_exact, with_reference=True,
                            ref_update_fn=create_ema_updater(0.5),
                            trainer=TrainerConfig(lr=LR), critic="policy", seed=0)

    algo = ppo(kl_coef=0.05)
    straight = _run(backend(), steps=3, algo=algo)
    first = backend()
    first.save(str(tmp_path / "ckpt"), _train(first, steps=2, algo=algo))
    second = backend()
    resumed = _train(second, steps=3, state=second.load(str(tmp_path / "ckpt")), algo=algo)
    _assert_same(straight, list(resumed.metrics_history))


def test_local_backend_on_adapters_resumes_exactly(tiny_model_path, tmp_path):
    """A LoRA-wrapped policy handed to the local backend (as the README shows), GRPO with an EMA reference:
    3 steps straight equal 2 steps, save, a fresh backend loading the checkpoint, 1 more step. PEFT's own
    ``save_pretrained`` wrote the adapters alone, which the checkpoint's load could not rebuild a model from."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primitives.maths.kl import create_ema_updater
    from primitives.model.lora import with_lora
    from primitives.types import LoraConfig

    def backend():
        torch.manual_seed(0)  # the adapters' A, drawn from torch's generator
        model = with_lora(AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(rank=4))
        return LocalBackend(model, spread_plus_exact, tokenizer=AutoTokenizer.from_pretrained(tiny_model_path),
                            with_reference=True, ref_update_fn=create_ema_updater(0.5),
                            trainer=TrainerConfig(lr=1e-2), seed=0)

    straight = _run(backend(), steps=3)
    first = backend()
    first.save(str(tmp_path / "ckpt"), _train(first, steps=2))
    second = backend()
    resumed = _train(second, steps=3, state=second.load(str(tmp_path / "ckpt")))
    _assert_same(straight, list(resumed.metrics_history))
    assert straight[-1]["kl/ref_k3"] > 1e-6  # the adapters trained and the reference moved


def test_local_backend_resumes_a_narrow_references_float32_state(tiny_model_path, tmp_path):
    """A bf16 model handed to the local backend with an EMA reference: the reference's update state is
    float32 (a 1 % move rounds away in bf16), and a resumed backend takes that state from the checkpoint, not
    the rounded reference weights (1e-4 apart after one move of 0.01, before)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primitives.maths.kl import create_ema_updater
    from primitives.types import TrainState

    def backend():
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
        return LocalBackend(model, spread_plus_exact, tokenizer=AutoTokenizer.from_pretrained(tiny_model_path),
                            with_reference=True, ref_update_fn=create_ema_updater(0.99))

    first = backend()
    with torch.no_grad():
        for p in first.policy.parameters():
            p.add_(0.01)
    first.sync(1, 1, None)
    second = backend()
    second.load(first.save(str(tmp_path / "ckpt"), TrainState(policy_version=1, iteration=1)))
    assert first.ref_state.weights.keys() == second.ref_state.weights.keys()
    for name, weight in first.ref_state.weights.items():
        assert weight.dtype == torch.float32 and torch.equal(weight, second.ref_state.weights[name]), name


def test_the_local_backend_refuses_a_precision_it_would_not_compute_in(tiny_model_path):
    """LocalBackend loads in float32: a job's bf16 (the generators' and reference's ``model.dtype``, the
    trainer ranks' ``TrainerConfig.bf16``) is refused by name before any model loads, not dropped."""
    import torch

    from primitives.types import ModelConfig

    with pytest.raises(ValueError, match=r"LocalBackend: model.dtype is 'bfloat16', but .* float32"):
        LocalBackend(ModelConfig(tiny_model_path, dtype="bfloat16"), spread_plus_exact)
    with pytest.raises(ValueError, match=r"LocalBackend: TrainerConfig.bf16 is True, but"):
        LocalBackend(tiny_model_path, spread_plus_exact, trainer=TrainerConfig(bf16=True))
    with pytest.raises(ValueError, match=r"model.dtype is 'float16' and TrainerConfig.bf16 is True"):
        LocalBackend(ModelConfig(tiny_model_path, dtype="float16"), spread_plus_exact, trainer=TrainerConfig(bf16=True))
    backend = LocalBackend(ModelConfig(tiny_model_path, dtype="float32"), spread_plus_exact,
                           trainer=TrainerConfig(bf16=False))
    assert {p.dtype for p in backend.policy.parameters()} == {torch.float32}


def test_same_seed_same_metrics_on_local_and_ray(ray_local, tiny_model_path, local_metrics):
    cfg = ClusterConfig(generators=1, trainers=1, reward_workers=1, zero_stage=2, call_timeout_s=300)
    cluster = build_rl_cluster(tiny_model_path, cfg, TrainerConfig(zero_stage=2, lr=LR, max_grad_norm=1.0),
                               spread_plus_exact, with_reference=True, seed=0)
    try:
        ray_metrics = _run(RayBackend(cluster))
    finally:
        shutdown_cluster(cluster)
    _assert_same(local_metrics, ray_metrics)
    assert ray_metrics[-1]["reward/mean"] == local_metrics[-1]["reward/mean"]  # the same tokens were sampled


# ----------------------------------------------------------------------------- PPO with a critic
PPO_STEPS = 3


def _run_ppo(backend):
    from primitives.maths.algorithms import ppo

    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=16, num_heldout=1, seed=3))[0]
    state = train(backend, make_prompt_source(items, seed=5), constant_schedule(ppo(kl_coef=0.05)),
                  RLRun(GEN, num_steps=PPO_STEPS, prompts_per_step=PROMPTS, lr_schedule=lambda step: LR,
                        progress=False))
    return list(state.metrics_history)


def _assert_same(first, second):
    for step, (a, b) in enumerate(zip(first, second)):
        a, b = _comparable(a), _comparable(b)
        assert set(a) == set(b), f"step {step}: keys differ {set(a) ^ set(b)}"
        for key in a:
            if isinstance(a[key], str):
                assert a[key] == b[key], (step, key)
            else:
                assert np.isclose(a[key], b[key], rtol=1e-5, atol=1e-5), (step, key, a[key], b[key])


def test_ppo_critic_on_one_process_equals_two_trainer_and_two_critic_ranks(ray_local, tiny_model_path):
    """PPO (GAE on the critic's values, k1 KL in the reward): the local backend (one policy, one
    value model) and a Ray cluster with 2 trainer ranks and 2 critic ranks log the same numbers,
    the critic's included; the Ray ranks recompute their layers in the backward (gradient
    checkpointing), the local ones keep their activations."""
    from cluster.ray_wing.groups import fan_out, gather
    from cluster.ray_wing.roles import add_critics
    from primitives.types import ModelConfig

    local = _run_ppo(LocalBackend(tiny_model_path, spread_plus_exact, with_reference=True,
                                  trainer=TrainerConfig(lr=LR, max_grad_norm=1.0), critic="policy", seed=0))
    assert all(m["critic/value_loss"] > 0 for m in local) and "critic/grad_norm" in local[0]
    cfg = ClusterConfig(generators=1, trainers=2, critics=2, reward_workers=1, zero_stage=2, call_timeout_s=300)
    trainer_cfg = TrainerConfig(zero_stage=2, lr=LR, max_grad_norm=1.0, gradient_checkpointing=True)
    cluster = build_rl_cluster(tiny_model_path, cfg, trainer_cfg, spread_plus_exact, with_reference=True, seed=0)
    try:
        cluster = add_critics(cluster, ModelConfig(tiny_model_path), cfg, trainer_cfg)
        infos = gather([*fan_out(cluster.trainers, "info"), *fan_out(cluster.critics, "info")], cluster.timeout_s)
        assert [i["model"]["gradient_checkpointing"] for i in infos] == [True] * 4
        ray_metrics = _run_ppo(RayBackend(cluster))
    finally:
        shutdown_cluster(cluster)
    _assert_same(local, ray_metrics)


# ----------------------------------------------------------------------------- asynchronous RL
def _train_async(backend, max_staleness, steps=4, items=None):
    from primitives.types import TrainState

    items = items or make_arithmetic_task(ArithmeticTaskSpec(num_train=16, num_heldout=1, seed=3))[0]
    return train(backend, make_prompt_source(items, seed=5), constant_schedule(grpo(kl_coef=0.05)),
                 RLRun(GEN, num_steps=steps, prompts_per_step=PROMPTS, lr_schedule=lambda step: LR,
                       max_staleness=max_staleness, progress=False),
                 state=TrainState())


def _local(tiny_model_path, cls=LocalBackend):
    return cls(tiny_model_path, spread_plus_exact, with_reference=True, trainer=TrainerConfig(lr=LR, max_grad_norm=1.0),
               seed=0)


class RecordingLocal(LocalBackend):
    """A local backend that remembers which rollouts each step trained on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained_uids: list = []

    def train_step(self, plan, parts, *args, **kwargs):
        self.trained_uids.append([r.uid for r in planned_rollouts(plan, parts)])
        return super().train_step(plan, parts, *args, **kwargs)


def _assert_each_prompt_once(trained_uids: list, steps: int):
    """Every step trained PROMPTS whole groups, and no rollout was trained twice."""
    flat = [u for step in trained_uids for u in step]
    assert len(trained_uids) == steps and len(flat) == len(set(flat)) == steps * PROMPTS * GEN.n
    groups = [u.rsplit("/", 1)[0] for u in flat]
    assert all(groups.count(g) == GEN.n for g in set(groups))


def test_staleness_zero_is_the_synchronous_loop(tiny_model_path, local_metrics):
    """Invariant 7: max_staleness=0 gives the synchronous run's metrics (1e-6). The synchronous
    loop is the same code with nothing drawn ahead, so this pins the default, and the
    lag-0 stamps."""
    zero = list(_train_async(_local(tiny_model_path), 0, steps=STEPS).metrics_history)
    for a, b in zip(local_metrics, zero):
        a, b = _comparable(a), _comparable(b)
        assert set(a) == set(b)
        assert all(a[k] == b[k] if isinstance(a[k], str) else abs(a[k] - b[k]) <= 1e-6 for k in a)
    assert all(m["staleness/max"] == 0 and m["staleness/lag_0"] == 1.0 for m in zero)


def test_async_rollouts_lag_one_version_and_each_prompt_trains_once(tiny_model_path, local_metrics):
    """max_staleness=1: step k trains rollouts generated by policy version k-1 (step 0 by
    version 0), stamped so; the capped importance weight then differs from 1; every prompt of
    the stream is trained once, in order."""
    backend = _local(tiny_model_path, RecordingLocal)
    async_metrics = list(_train_async(backend, 1).metrics_history)
    assert async_metrics[0]["staleness/mean"] == 0.0
    assert all(m["staleness/mean"] == 1.0 and m["staleness/max"] == 1.0 and m["staleness/lag_1"] == 1.0
               for m in async_metrics[1:])
    _assert_each_prompt_once(backend.trained_uids, 4)
    sync = RecordingLocal(tiny_model_path, spread_plus_exact, with_reference=True,
                          trainer=TrainerConfig(lr=LR, max_grad_norm=1.0), seed=0)
    _train_async(sync, 0)
    assert [sorted(u.rsplit("/", 1)[0] for u in s) for s in sync.trained_uids] == \
        [sorted(u.rsplit("/", 1)[0] for u in s) for s in backend.trained_uids]  # the same prompts per step
    assert async_metrics[0]["reward/mean"] == local_metrics[0]["reward/mean"]  # step 0 is not stale
    assert async_metrics[1]["mismatch/max_abs_logp_diff"] > 1e-4  # trained by a newer policy than sampled
    # one process: each role waits while the other works, so both idle shares lie strictly inside
    # (0, 1); at the last step nothing is drawn ahead, so the generator did nothing
    assert all(0.0 < m["idle/generators"] < 1.0 and 0.0 < m["idle/trainers"] < 1.0 for m in async_metrics[:-1])
    assert async_metrics[-1]["idle/generators"] == 1.0


class LaggingLocal(RecordingLocal):
    """A generator that stamps its second and third calls three versions old: the collection
    drawn ahead for step 1 is past the bound, and so is its first regeneration."""

    def generate(self, items, gen, tools=None):
        self.calls = getattr(self, "calls", 0) + 1
        out = super().generate(items, gen, tools)
        if self.calls in (2, 3):
            out = out._replace(rollouts=[r._replace(policy_version=r.policy_version - 3) for r in out.rollouts])
        return out


def test_rollouts_past_the_staleness_bound_are_generated_again(tiny_model_path):
    backend = _local(tiny_model_path, LaggingLocal)
    metrics = list(_train_async(backend, 1).metrics_history)
    assert all(m["staleness/max"] <= 1 for m in metrics)  # nothing older than the bound was trained
    assert sum(m["staleness/regenerated"] for m in metrics) == 2 * PROMPTS * GEN.n  # one collection, redone twice
    _assert_each_prompt_once(backend.trained_uids, 4)


def test_async_on_ray_equals_async_on_one_process(ray_local, tiny_model_path):
    """max_staleness=1 on a 1-generator, 1-trainer cluster: the generator really samples step
    k+1 with version k while step k trains, as the one-process loop does (1e-5)."""
    local = list(_train_async(_local(tiny_model_path), 1).metrics_history)
    cfg = ClusterConfig(generators=1, trainers=1, reward_workers=1, zero_stage=2, call_timeout_s=300)
    cluster = build_rl_cluster(tiny_model_path, cfg, TrainerConfig(zero_stage=2, lr=LR, max_grad_norm=1.0),
                               spread_plus_exact, with_reference=True, seed=0)
    try:
        backend = RayBackend(cluster)
        ray_metrics = list(_train_async(backend, 1).metrics_history)
    finally:
        shutdown_cluster(backend.cluster)
    _assert_same(local, ray_metrics)
    assert [m["staleness/mean"] for m in ray_metrics] == [0.0, 1.0, 1.0, 1.0]


class KillingBackend(RayBackend):
    """Kills generator 0 when step ``kill_at`` starts training: in asynchronous mode the next
    step's rollouts are in flight on it then. Records the uids each step trains on."""

    def __init__(self, cluster, ray, kill_at: int):
        super().__init__(cluster)
        self.ray, self.kill_at, self.steps, self.trained_uids = ray, kill_at, 0, []

    def train_step(self, plan, parts, *args, **kwargs):
        if self.steps == self.kill_at:
            kill_and_wait(self.ray, self.cluster.generators.group.actors[0])
        self.steps += 1
        pulled = [tuple(None if x is None else self.ray.get(x) for x in part) for part in parts]
        self.trained_uids.append([r.uid for r in planned_rollouts(plan, pulled)])
        return super().train_step(plan, parts, *args, **kwargs)


def test_async_generator_killed_mid_step_loses_and_repeats_nothing(ray_local, tiny_model_path):
    """Asynchronous mode (max_staleness=1) on a cluster of its own: generator 0 dies while step
    2's rollouts are in flight during step 1's training. It is replaced before the sync, step
    2's prompts are generated again by the new policy, and every prompt is trained exactly
    once per epoch."""
    cfg = ClusterConfig(generators=2, trainers=1, zero_stage=2, call_timeout_s=300)
    first = build_rl_cluster(tiny_model_path, cfg, TrainerConfig(zero_stage=2, lr=1e-3), arithmetic_reward,
                             with_reference=True)
    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=12, num_heldout=1, seed=6))[0]
    backend, logged = KillingBackend(first, ray_local, kill_at=1), []
    try:
        state = train(backend, make_prompt_source(items, seed=3), constant_schedule(grpo(kl_coef=0.05)),
                      RLRun(GenerationConfig(max_new_tokens=4, n=2), num_steps=6, prompts_per_step=4,
                            lr_schedule=lambda s: 1e-3, max_staleness=1, progress=False),
                      hooks=Hooks(logger=logged.append))
        cluster = backend.cluster
        trainer = gather(fan_out(cluster.trainers, "weight_checksums"), cluster.timeout_s)[0]
        generators = gather(fan_out(cluster.generators.group, "weight_checksums"), cluster.timeout_s)
    finally:
        shutdown_cluster(backend.cluster)
    assert state.iteration == 6 and logged[-1]["recovery/actor_restarts"] == 1
    assert cluster.generators.group.actors[0] != first.generators.group.actors[0]
    uids = [u for step in backend.trained_uids for u in step]
    assert len(uids) == len(set(uids)) == 6 * 4 * 2  # nothing trained twice, every step full
    for epoch in (0, 1):
        assert sorted(int(u.split("/")[1][1:]) for u in uids if u.startswith(f"e{epoch}/") and u.endswith("/s0")) \
            == list(range(12))  # each prompt once per epoch
    assert [m["staleness/max"] for m in logged] == [0.0, 1.0, 0.0, 1.0, 1.0, 1.0]  # step 2 regenerated fresh
    assert all(sums == trainer for sums in generators)  # the replacement holds the current weights


class RewardKillingBackend(RayBackend):
    """With ``kill``, kills reward worker 0 just before the first filter run, which takes place
    on it. Records the uids each step trains on."""

    def __init__(self, cluster, ray, kill: bool):
        super().__init__(cluster)
        self.ray, self.killed, self.trained_uids = ray, not kill, []

    def select(self, rows, filters):
        if not self.killed:
            self.killed = True
            kill_and_wait(self.ray, self.cluster.rewards.actors[0])
        return super().select(rows, filters)

    def train_step(self, plan, parts, *args, **kwargs):
        pulled = [tuple(None if x is None else self.ray.get(x) for x in part) for part in parts]
        self.trained_uids.append([r.uid for r in planned_rollouts(plan, pulled)])
        return super().train_step(plan, parts, *args, **kwargs)


def test_a_reward_worker_killed_under_the_filters_is_replaced_and_the_step_goes_on(ray_local, tiny_model_path):
    """DAPO's dynamic sampling runs on reward worker 0; killed there, the worker is replaced and
    the filters run again on the rollouts already scored: the same steps as an undisturbed run
    (the same rollouts trained, metrics 1e-5), one restart, no rollout trained twice."""
    from primitives.maths.algorithms import dapo

    cfg = ClusterConfig(generators=1, trainers=1, reward_workers=1, zero_stage=2, call_timeout_s=300)
    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=16, num_heldout=1, seed=3))[0]
    runs = []
    for killing in (False, True):
        cluster = build_rl_cluster(tiny_model_path, cfg, TrainerConfig(zero_stage=2, lr=LR, max_grad_norm=1.0),
                                   spread_plus_exact, with_reference=False, seed=0)
        backend = RewardKillingBackend(cluster, ray_local, kill=killing)
        try:
            state = train(backend, make_prompt_source(items, seed=5), constant_schedule(dapo()),
                          RLRun(GEN, num_steps=2, prompts_per_step=PROMPTS, lr_schedule=lambda step: LR,
                                progress=False))
        finally:
            shutdown_cluster(backend.cluster)
        runs.append((list(state.metrics_history), backend))
    (calm, undisturbed), (killed, backend) = runs
    assert backend.restarts == 1 and killed[-1]["recovery/actor_restarts"] == 1 and undisturbed.restarts == 0
    _assert_same([{k: v for k, v in m.items() if k != "recovery/actor_restarts"} for m in calm],
                 [{k: v for k, v in m.items() if k != "recovery/actor_restarts"} for m in killed])
    uids = [u for step in backend.trained_uids for u in step]
    assert backend.trained_uids == undisturbed.trained_uids and uids and len(uids) == len(set(uids))


def test_evaluation_scores_the_task_reward_without_the_shaping(tiny_model_path):
    """Every completion is right (reward 1): with a length penalty in the job's shaping the evaluation
    still counts them all right (it counted every one wrong), and with KL shaping, which needs
    reference logprobs an evaluation does not collect, it runs (it raised before step 0)."""
    from cluster.loop.evaluate import evaluate
    from primitives.env.rewards import kl_penalty_shaping, length_penalty

    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=4, num_heldout=4, seed=0))[1]
    greedy = GenerationConfig(max_new_tokens=4, temperature=0.0, n=1)
    for shaping in (length_penalty(0.01, 2), kl_penalty_shaping(0.1)):
        backend = LocalBackend(tiny_model_path, lambda r: 1.0, shaping_fn=shaping)
        metrics = evaluate(backend, items, greedy, k=1)
        assert metrics["eval/accuracy"] == 1.0 and metrics["eval/reward_mean"] == 1.0
