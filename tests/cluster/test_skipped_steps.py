"""A step with nothing to train - online DPO where every group's rewards tie (no pair), or
dynamic sampling that keeps no group - is a logged, skipped update on the local backend: the
run goes on, the weights and optimizer are untouched by it, its prompts count as consumed
(never trained, never drawn again), and the run's other steps are those of a run that never
drew the tied prompts."""
import pytest
import torch

from cluster.local import LocalBackend
from cluster.loop.train import Hooks, RLRun, train
from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task
from primitives.io.data import make_prompt_source
from primitives.maths.algorithms import constant_schedule, dapo, online_dpo
from primitives.types import GenerationConfig, TrainState, planned_rollouts
from rl_actors.trainer import TrainerConfig

GEN = GenerationConfig(max_new_tokens=4, n=4, temperature=0.9)
PROMPTS, LR = 3, 1e-3
ITEMS = make_arithmetic_task(ArithmeticTaskSpec(num_train=12, num_heldout=1, seed=3))[0]
TIED = {it.index for it in ITEMS[PROMPTS: 2 * PROMPTS]}  # the prompts of step 1 (drawn in order)


def tie_step_one(rollout) -> float:
    """Every rollout of a step-1 prompt scores 1.0; the others vary with the sampled tokens."""
    if int(rollout.group.rsplit("/i", 1)[1]) in TIED:
        return 1.0
    return float(int(rollout.completion_ids.sum()) % 3)


class Recording(LocalBackend):
    """A local backend that remembers the uids of each trained batch and the policy's weights
    after every sync (when the generators would receive them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained_uids, self.drawn_groups = [], []

    def generate(self, items, gen, tools=None):
        self.drawn_groups.append([f"e{it.epoch}/i{it.index}" for it in items])
        return super().generate(items, gen, tools)

    def train_step(self, plan, parts, *args, **kwargs):
        result = super().train_step(plan, parts, *args, **kwargs)
        if result.batch_metrics is not None:  # the step trained (a pairwise loss may find no pair)
            self.trained_uids.append([r.uid for r in planned_rollouts(plan, parts)])
        return result

    def weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.policy.state_dict().items()}


def _run(model_path, algo, items, steps):
    backend = Recording(model_path, tie_step_one, with_reference=True, trainer=TrainerConfig(lr=LR), seed=0)
    weights = []
    state = train(backend, make_prompt_source(items, shuffle=False), constant_schedule(algo),
                  RLRun(GEN, num_steps=steps, prompts_per_step=PROMPTS, lr_schedule=lambda step: LR,
                        max_resample_rounds=0, progress=False),
                  state=TrainState(), hooks=Hooks(logger=lambda m: weights.append(backend.weights())))
    return backend, state, weights


def _same_weights(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("algo", [online_dpo(), dapo()], ids=["online_dpo_no_pair", "dapo_no_group_kept"])
def test_a_step_whose_groups_all_tie_is_a_skipped_update(tiny_model_path, algo):
    """Step 1's prompts all tie: it logs no update and no sync, keeps the weights, optimizer
    and policy version, consumes its prompts without training them, and steps 0 and 2 equal
    the two steps of a run over the other prompts (metrics 1e-6, weights exactly)."""
    backend, state, weights = _run(tiny_model_path, algo, ITEMS, steps=3)
    metrics = state.metrics_history
    assert [m["step"] for m in metrics] == [0, 1, 2]
    skipped = metrics[1]
    assert skipped["policy/updates"] == 0.0 and skipped["batch/rows"] == 0.0 and skipped["batch/loss_tokens"] == 0.0
    assert skipped["data/prompts_drawn"] == PROMPTS and "reward/mean" not in skipped and "sync/version" not in skipped
    assert metrics[0]["policy/updates"] == metrics[2]["policy/updates"] == 1.0
    assert [m.get("sync/version") for m in metrics] == [1.0, None, 2.0]
    # the skipped step left the weights and the optimizer alone; the next step moved them
    assert _same_weights(weights[0], weights[1]) and not _same_weights(weights[1], weights[2])
    assert backend.optimizer.state[next(backend.policy.parameters())]["step"] == 2
    assert (state.iteration, state.global_step, state.policy_version) == (3, 2, 2)
    # every prompt drawn once, in order; the tied ones consumed, never trained
    drawn = [g for call in backend.drawn_groups for g in call]
    assert drawn == [f"e0/i{it.index}" for it in ITEMS[: 3 * PROMPTS]]
    assert state.data_position == make_prompt_source(ITEMS, shuffle=False)(TrainState().data_position,
                                                                            3 * PROMPTS)[1]
    trained = [u for step in backend.trained_uids for u in step]
    assert len(backend.trained_uids) == 2 and len(trained) == len(set(trained))
    assert not {u.rsplit("/", 1)[0] for u in trained} & {f"e0/i{i}" for i in TIED}

    # the steps around the skipped one are those of a run that never drew the tied prompts
    untied = ITEMS[:PROMPTS] + ITEMS[2 * PROMPTS: 3 * PROMPTS]
    _, straight, straight_weights = _run(tiny_model_path, algo, untied, steps=2)
    for ours, theirs in zip([metrics[0], metrics[2]], straight.metrics_history):
        for key in ("loss/policy", "grad_norm", "reward/mean", "batch/rows"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-6), key
    assert _same_weights(weights[2], straight_weights[1])


def test_the_skipped_step_on_ray_logs_what_it_logs_in_one_process(ray_local, tiny_model_path):
    """The same loop on a 1-generator, 1-trainer cluster: the step with no pair is skipped there
    too, and every step logs the one-process numbers (1e-5)."""
    import numpy as np

    from cluster.ray_wing.backend import RayBackend
    from cluster.ray_wing.config import ClusterConfig
    from cluster.ray_wing.roles import build_rl_cluster, shutdown_cluster

    _, local, _ = _run(tiny_model_path, online_dpo(), ITEMS, steps=3)
    cfg = ClusterConfig(generators=1, trainers=1, reward_workers=1, zero_stage=2, call_timeout_s=300)
    cluster = build_rl_cluster(tiny_model_path, cfg, TrainerConfig(zero_stage=2, lr=LR), tie_step_one,
                               with_reference=True, seed=0)
    try:
        on_ray = train(RayBackend(cluster), make_prompt_source(ITEMS, shuffle=False), constant_schedule(online_dpo()),
                       RLRun(GEN, num_steps=3, prompts_per_step=PROMPTS, lr_schedule=lambda step: LR, progress=False))
    finally:
        shutdown_cluster(cluster)
    assert on_ray.metrics_history[1]["policy/updates"] == 0.0 and on_ray.policy_version == 2
    for a, b in zip(local.metrics_history, on_ray.metrics_history):
        keys = {k for k in a if not k.startswith(("time/", "idle/", "faults/")) and k != "sync/bytes"}
        assert keys == {k for k in b if not k.startswith(("time/", "idle/", "faults/")) and k != "sync/bytes"}
        for k in keys:
            assert a[k] == b[k] if isinstance(a[k], str) else np.isclose(a[k], b[k], rtol=1e-5, atol=1e-5), k


def test_a_pairwise_step_without_a_pair_is_no_batch():
    """``trainable_batch`` gives None for a step with nothing to train; ``make_batch`` still
    names the problem when asked to batch it."""
    import numpy as np

    from primitives.maths.batching import make_batch, trainable_batch
    from primitives.types import Rollout

    def rollout(group, sample, reward):
        return Rollout(uid=f"{group}/s{sample}", group=group, prompt="1+1=", prompt_ids=np.array([1, 2]),
                       completion_ids=np.array([3, 4]), loss_mask=np.ones(2, np.float32),
                       logprobs=np.zeros(2, np.float32), reward=reward)

    tied = [rollout(g, s, 1.0) for g in ("e0/i0", "e0/i1") for s in range(2)]
    assert trainable_batch(tied, online_dpo(), pad_id=0) is None
    assert trainable_batch([], dapo(), pad_id=0, budget=4) is None
    with pytest.raises(ValueError, match="found no pair"):
        make_batch(tied, online_dpo(), pad_id=0)
    with pytest.raises(ValueError, match="no rollouts to batch"):
        make_batch([], dapo(), pad_id=0, budget=4)
    spread = tied[:1] + [tied[1]._replace(reward=0.0)] + tied[2:]
    batch = trainable_batch(spread, online_dpo(), pad_id=0)
    assert [r.uid for r in batch.rollouts] == ["e0/i0/s0", "e0/i0/s1"]
    assert batch.advantages[:, 0].tolist() == [1.0, -1.0]
