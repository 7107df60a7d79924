"""The RL cluster end to end on a local Ray: SFT and RL steps, weight sync, and the
invariants after a sync (exact weights on every generator, logprob parity)."""
import numpy as np
import pytest

from cluster.loop.evaluate import evaluate_accuracy
from cluster.loop.sft import SFTRun, train_sft
from cluster.loop.train import Hooks, RLRun, train
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.config import ClusterConfig
from cluster.ray_wing.groups import ActorFailure, call, fan_out, gather
from cluster.ray_wing.roles import build_rl_cluster, shutdown_cluster
from cluster.ray_wing.weights import sync_weights
from primitives.fixtures.tasks import ArithmeticTaskSpec, arithmetic_reward, make_arithmetic_task, sft_demonstrations
from primitives.io.data import make_prompt_source, prepare_sft_text
from primitives.maths.algorithms import constant_schedule, grpo
from primitives.maths.kl import create_periodic_updater
from primitives.types import GenerationConfig
from rl_actors.trainer import TrainerConfig

# every test here is on a Ray, and the module spends most of its time waiting (kills waited out, a stuck call, dead
# generators): under make test it runs apart, on its tier's own Ray beside the Ray tests (tests/suite.py)
pytestmark = pytest.mark.apart


@pytest.fixture(scope="module")
def rl_cluster(ray_local, tiny_model_path):
    cfg = ClusterConfig(generators=2, trainers=2, zero_stage=3, call_timeout_s=300)
    cluster = build_rl_cluster(tiny_model_path, cfg, TrainerConfig(zero_stage=3, lr=1e-3, micro_batch_size=16),
                               arithmetic_reward, with_reference=True, ref_update_fn=create_periodic_updater(1),
                               bucket_mb=0.5)  # small buckets: several collectives per sync
    yield cluster
    shutdown_cluster(cluster)


@pytest.fixture(scope="module")
def trained(rl_cluster, tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    spec = ArithmeticTaskSpec(num_train=64, num_heldout=16)
    items, heldout = make_arithmetic_task(spec)
    samples = [prepare_sft_text(tok, p, c) for p, c in sft_demonstrations(items, spec)[0]]
    sft = train_sft(RayBackend(rl_cluster), samples, SFTRun(3, 16, lambda s: 1e-3, progress=False))
    sync_weights(rl_cluster, version=0)
    logged = []
    state = train(RayBackend(rl_cluster), make_prompt_source(items), constant_schedule(grpo(kl_coef=0.05)),
                  RLRun(GenerationConfig(max_new_tokens=4, n=4), num_steps=2, prompts_per_step=4,
                        lr_schedule=lambda s: 1e-3, progress=False),
                  hooks=Hooks(logger=logged.append,
                              eval_fn=lambda c, s: {"eval/accuracy": evaluate_accuracy(c, heldout, 4)}, eval_every=2))
    return sft, state, logged, items


def test_sft_and_rl_steps_run_and_report(trained):
    sft, state, logged, _ = trained
    assert sft["loss/sft"] > 0 and np.isfinite(sft["grad_norm"])
    assert state.iteration == 2 and state.policy_version == 2
    assert [m["step"] for m in logged] == [0, 1]
    for key in ("time/generate", "time/reward", "time/ref", "time/train", "time/sync", "reward/mean",
                "loss/policy", "kl/ref_k3", "sync/bytes"):
        assert key in logged[0], key
    assert "eval/accuracy" in logged[1] and 0.0 <= logged[1]["eval/accuracy"] <= 1.0
    assert logged[1]["kl/ref_k3"] >= 0


def test_generators_hold_exactly_the_trainer_weights(rl_cluster, trained):
    """Invariant 1a: per-tensor checksums after a sync (ZeRO-3 gathered at the source)."""
    trainer = gather(fan_out(rl_cluster.trainers, "weight_checksums"), rl_cluster.timeout_s)
    assert trainer[0] == trainer[1]
    for sums in gather(fan_out(rl_cluster.generators.group, "weight_checksums"), rl_cluster.timeout_s):
        assert sums == trainer[0]
    # the reference tracks the policy (reset every step): it holds the same weights too
    assert gather(fan_out(rl_cluster.reference.group, "weight_checksums"), rl_cluster.timeout_s)[0] == trainer[0]


def test_generator_logprobs_equal_trainer_logprobs(rl_cluster, trained):
    """Invariant 1b: behaviour logprobs of fresh rollouts == trainer's recomputation (fp32)."""
    items = trained[3][:6]
    gen = GenerationConfig(max_new_tokens=5, n=2)
    rollouts = _flat(gather(fan_out(rl_cluster.generators.group, "generate", items, gen), rl_cluster.timeout_s))
    assert {r.policy_version for r in rollouts} == {2}
    # collective under ZeRO-3: every rank scores, rank 0's answer is read
    trainer = gather(fan_out(rl_cluster.trainers, "logprobs", rollouts, 1.0), rl_cluster.timeout_s)[0]
    diff = max(float(np.abs(t - r.logprobs).max()) for t, r in zip(trainer, rollouts))
    assert diff < 1e-4


def test_multiturn_generation_on_a_generator(rl_cluster, trained):
    """The tool loop runs inside a generator actor; tool-output tokens stay out of the loss."""
    from primitives.env.tools import ToolConfig, calculator_tool, create_tool_executor, parse_xml_tool_calls
    from primitives.io.data import PromptItem

    items = [PromptItem(0, "What is 12*3? Use the calculator.", answer="36")]
    gen = GenerationConfig(max_new_tokens=6, n=2, stop=("</tool_call>",))
    tools = ToolConfig(create_tool_executor({"calc": calculator_tool}), parse_xml_tool_calls, max_turns=3)
    rollouts = gather([call(rl_cluster.generators.group, 0, "generate_multiturn", items, gen, tools)],
                      rl_cluster.timeout_s)[0]
    assert [r.uid for r in rollouts] == ["e0/i0/s0", "e0/i0/s1"]
    for r in rollouts:
        assert len(r.completion_ids) == len(r.loss_mask) == len(r.logprobs) > 0
        assert r.policy_version == 2 and (r.logprobs[r.loss_mask == 0] == 0).all()
    # the trainers (same weights after the sync) score the policy tokens as the generator did
    trainer = gather(fan_out(rl_cluster.trainers, "logprobs", rollouts, 1.0), rl_cluster.timeout_s)[0]
    for t, r in zip(trainer, rollouts):
        policy = r.loss_mask == 1
        assert policy.any() and np.abs(t[policy] - r.logprobs[policy]).max() < 1e-4


def test_reference_copy_goes_by_ref(rl_cluster, trained):
    from cluster.ray_wing.weights import copy_policy_to_reference

    copy_policy_to_reference(rl_cluster)
    trainer = gather(fan_out(rl_cluster.trainers, "weight_checksums"), rl_cluster.timeout_s)[0]
    assert gather(fan_out(rl_cluster.reference.group, "weight_checksums"), rl_cluster.timeout_s)[0] == trainer


def test_dapo_dynamic_sampling_keeps_only_informative_groups(ray_local, rl_cluster, trained):
    """DAPO on the cluster: groups whose rewards are all equal are dropped and more prompts are
    drawn until the step has its quota of informative groups (or the rounds run out)."""
    from cluster.ray_wing.groups import WorkerGroup
    from primitives.maths.algorithms import dapo
    from rl_actors.reward import RewardWorker

    def parity_reward(rollout):  # even prompts: all 0 (flat group); odd prompts: 0/1 by sample index
        index, sample = int(rollout.group.split("/i")[1]), int(rollout.uid.rsplit("/s", 1)[1])
        return float(sample % 2) if index % 2 else 0.0

    reward = ray_local.remote(RewardWorker).remote(parity_reward)
    cluster = rl_cluster._replace(rewards=WorkerGroup("reward", (reward,)))
    items = trained[3]
    served = []

    def recording_source(position, n):
        got, nxt = make_prompt_source(items)(position, n)
        served.append([it.index for it in got])
        return got, nxt

    logged = []
    train(RayBackend(cluster), recording_source, constant_schedule(dapo(overlong_buffer_frac=0.5)),
          RLRun(GenerationConfig(max_new_tokens=4, n=3), num_steps=1, prompts_per_step=6, lr_schedule=lambda s: 1e-3,
                max_resample_rounds=3, progress=False),
          hooks=Hooks(logger=logged.append))
    m = logged[0]
    drawn = [i for draw in served for i in draw]
    assert m["data/prompts_drawn"] == len(drawn) and len(served[0]) == 6
    assert m["data/resample_rounds"] == len(served) - 1 >= 1  # flat groups forced more draws
    # exactly the informative (odd-index) groups were trained, 3 samples each
    assert m["batch/rows"] == 3 * sum(i % 2 for i in drawn) > 0
    assert m["reward/std"] > 0
    ray_local.kill(reward)


def test_raising_reward_names_rollout_and_function(ray_local, rl_cluster, trained):
    from rl_actors.reward import RewardWorker

    def broken_reward(rollout):
        raise ZeroDivisionError("oops")

    items = trained[3][:1]
    rollouts = gather([rl_cluster.generators.generate(0, items, GenerationConfig(max_new_tokens=3))], 60)[0]
    worker = ray_local.remote(RewardWorker).remote(broken_reward)
    from cluster.ray_wing.groups import Call
    with pytest.raises(ActorFailure) as e:
        gather([Call(worker.score.remote(rollouts), "reward", 3, "score")], 60)
    assert "reward 3 failed in score" in str(e.value)
    assert f"broken_reward raised on rollout {rollouts[0].uid}" in str(e.value)
    ray_local.kill(worker)


def test_stuck_actor_is_a_bounded_wait(ray_local):
    import time

    from cluster.ray_wing.groups import Call
    from rl_actors.reward import RewardWorker

    def slow_reward(rollout):
        time.sleep(30)
        return 0.0

    worker = ray_local.remote(RewardWorker).remote(slow_reward)
    ref = worker.score.remote([_dummy_rollout()])
    t0 = time.time()
    with pytest.raises(ActorFailure, match=r"no answer within 2s from: reward 0.score"):
        gather([Call(ref, "reward", 0, "score")], 2.0)
    assert time.time() - t0 < 10
    ray_local.kill(worker)


def test_missing_model_path_names_role(ray_local):
    from cluster.ray_wing.groups import Call
    from primitives.types import ModelConfig
    from rl_actors.generator import GeneratorWorker

    worker = ray_local.remote(GeneratorWorker).remote(ModelConfig("/no/such/model"), 5, "hf")
    with pytest.raises(ActorFailure, match=r"generator 5.*model path '/no/such/model' is not a directory"):
        gather([Call(worker.info.remote(), "generator", 5, "info")], 60)


def test_dead_workers_are_replaced_and_no_prompt_is_lost(ray_local, rl_cluster, trained):
    """Invariant 3: generator 0 dies after step 1 and reward worker 0 after step 3; both are
    replaced, their steps collected again, and every prompt is trained exactly once per epoch."""
    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=12, num_heldout=1, seed=5))[0]
    source, served, calls = make_prompt_source(items, seed=2), {}, []

    def recording_source(position, n):
        got, nxt = source(position, n)
        calls.append(position)
        served[position] = [(it.epoch, it.index) for it in got]  # a retried step asks for the same position
        return got, nxt

    kills = {1: rl_cluster.generators.group.actors[0], 3: rl_cluster.rewards.actors[0]}
    logged = []

    def killing_logger(metrics):
        logged.append(metrics)
        if metrics["step"] in kills:
            _kill_and_wait(ray_local, kills[metrics["step"]])

    backend = RayBackend(rl_cluster)
    state = train(backend, recording_source, constant_schedule(grpo(kl_coef=0.05)),
                  RLRun(GenerationConfig(max_new_tokens=4, n=2), num_steps=6, prompts_per_step=4,
                        lr_schedule=lambda s: 1e-3, progress=False),
                  hooks=Hooks(logger=killing_logger))
    cluster = backend.cluster
    assert state.iteration == 6 and logged[-1]["recovery/actor_restarts"] == 2
    assert len(calls) == len(served) == 6  # each position drawn once; a lost collection is generated again
    trained = [key for pos in sorted(served) for key in served[pos]]
    for epoch in (0, 1):
        assert sorted(i for e, i in trained if e == epoch) == list(range(12))  # each prompt once per epoch
    assert all(m["batch/rows"] == 8 for m in logged)  # every step trained all 4 prompts x 2 samples
    assert cluster.generators.group.actors[0] != rl_cluster.generators.group.actors[0]
    trainer = gather(fan_out(cluster.trainers, "weight_checksums"), cluster.timeout_s)[0]
    for sums in gather(fan_out(cluster.generators.group, "weight_checksums"), cluster.timeout_s):
        assert sums == trainer  # the replacement generator holds the current weights


def test_dead_generator_surfaces_as_named_error(ray_local, rl_cluster, trained):
    """Last in this module: it kills generator 1, and generator 0 (the test above killed it already,
    when it ran). With both dead, a recovery of generator 1 has its replacement's join cut by
    generator 0, recovers that one, and goes on with its own replacement: two restarts, not three,
    and both new workers hold the trainer's weights."""
    _kill_and_wait(ray_local, rl_cluster.generators.group.actors[1])
    _kill_and_wait(ray_local, rl_cluster.generators.group.actors[0])
    with pytest.raises(ActorFailure, match=r"generator 1 died during info") as e:
        gather([call(rl_cluster.generators.group, 1, "info")], 60)
    assert e.value.replaceable and (e.value.role, e.value.rank) == ("generator", 1)

    backend = RayBackend(rl_cluster)
    try:
        backend.recover(e.value, since=0)
        assert backend.restarts == 2 and [f["rank"] for f in backend.faults] == [1, 0]
        assert "generator 0 died" in backend.faults[0]["cut"] and "failed" not in backend.faults[1]
        cluster = backend.cluster
        trainer = gather(fan_out(cluster.trainers, "weight_checksums"), cluster.timeout_s)[0]
        assert gather(fan_out(cluster.generators.group, "weight_checksums"), cluster.timeout_s) == [trainer] * 2
    finally:
        for actor in backend.cluster.generators.group.actors:
            ray_local.kill(actor, no_restart=True)  # the fixture's shutdown holds the dead ones, not these


def _kill_and_wait(ray, actor, timeout_s=60.0):
    """``ray.kill`` is asynchronous: return only once calls on the actor fail."""
    import time

    from ray.exceptions import RayActorError

    ray.kill(actor, no_restart=True)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            ray.get(actor.info.remote(), timeout=10)
        except RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("actor still answers after ray.kill")


def _flat(lists):
    return [x for chunk in lists for x in chunk]


def _dummy_rollout():
    from primitives.types import Rollout

    return Rollout("e0/i0/s0", "e0/i0", "p", np.array([1]), np.array([2]), np.ones(1, np.float32),
                   np.zeros(1, np.float32))
