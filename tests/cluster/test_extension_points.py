"""Every extension point of architecture section 5 on Ray: each test shows that the actors ran the
user's function by its effect on what the trainers (or reward and reference workers)
computed, not only that it was called. One cluster serves the module: a vector reward with
a user aggregator, an EMA reference, 1 generator, 2 trainer ranks (so shares are merged)."""
import os
import string
import threading

import numpy as np
import pytest
import torch

from cluster.loop.evaluate import evaluate
from cluster.loop.train import Hooks, RLRun, train
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.config import ClusterConfig
from cluster.ray_wing.groups import call, fan_out, gather
from cluster.ray_wing.roles import build_rl_cluster, shutdown_cluster
from primitives.env.tools import ToolCall, ToolConfig, calculator_tool, create_tool_executor
from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task
from primitives.hooks import with_traits
from primitives.io.data import PromptItem, make_prompt_source
from primitives.maths import advantages as adv
from primitives.maths.algorithms import constant_schedule, grpo, metric_switch_schedule, online_dpo
from primitives.maths.kl import create_ema_updater
from primitives.maths.losses import token_mean
from primitives.maths.objectives import online_dpo_objective, policy_objective
from primitives.types import GenerationConfig
from rl_actors.trainer import TrainerConfig
from tests.rewards import spread_and_exact

GEN = GenerationConfig(max_new_tokens=4, n=4, temperature=1.0)
PROMPTS = 4
EMA_DECAY = 0.5


# ----------------------------------------------------------------------------- the user's functions
def half_and_double(vector):
    """The user's aggregator: 0.5 * first + 2 * second."""
    return 0.5 * vector[0] + 2.0 * vector[1]


def constant_advantage(x, algo):
    """1.5 on every loss token, whatever the rewards."""
    return torch.full_like(x.mask, 1.5) * x.mask, None


def kl_as_advantage(x, algo):
    """The KL the algorithm put in the reward, as the advantage itself."""
    return x.token_kl, None


def quarter_kl(logp, ref_logp, mask):
    return torch.full_like(logp, 0.25) * mask


def half_kl(logp, ref_logp, mask):
    return torch.full_like(logp, 0.5) * mask


def counting_loss(inputs, algo):
    """The policy loss, plus a metric the trainer computes from its own inputs: its loss tokens."""
    loss, metrics = policy_objective(inputs, algo)
    return loss, {**metrics, "custom/loss_tokens": float(inputs.mask.sum())}


def failing_loss(inputs, algo):
    """Fails on real micro-batches (8 rows a rank) but not on the 4-row sample checked before
    the run: the failure happens inside a trainer."""
    if inputs.logp.shape[0] > 4:
        raise RuntimeError("boom in the user's loss")
    return policy_objective(inputs, algo)


def two_pairs(members, rng=None):
    """Two pairs per group whatever the rewards (the default selector makes one): samples
    0 over 1 and 2 over 3."""
    return [(members[0], members[1]), (members[2], members[3])]


def constant_surrogate(logp, old_logp, advantages, mask, algo):
    """A policy loss of 0.7 on every token (nothing clipped)."""
    return torch.full_like(logp, 0.7) * mask + 0.0 * logp, torch.zeros_like(mask, dtype=torch.bool)


def summed(loss, mask, counts):
    """An aggregation that sums over tokens (no normalisation)."""
    return (loss * mask).sum()


def even_prompts(rollouts):
    """A filter that keeps the groups of even dataset indices only."""
    return [r for r in rollouts if int(r.group.split("/i")[1]) % 2 == 0]


@with_traits(pairwise=True, needs_reference=True)
def dpo_loss(inputs, algo):
    return online_dpo_objective(inputs, algo)


def always_calc(text):
    """A parser that reads every turn as one calculator call (a random model writes no calls)."""
    return [ToolCall("calc", {"expression": "2+3"}, id="c0")]


def stop_after_tool(conversation):
    return conversation.last().role == "assistant" and len(conversation.messages) >= 4


# ----------------------------------------------------------------------------- the cluster
@pytest.fixture(scope="module")
def backend(ray_local, tiny_model_path):
    cfg = ClusterConfig(generators=1, trainers=2, reward_workers=1, zero_stage=2, call_timeout_s=300)
    cluster = build_rl_cluster(tiny_model_path, cfg, TrainerConfig(zero_stage=2, lr=1e-3), spread_and_exact,
                               with_reference=True, ref_update_fn=create_ema_updater(EMA_DECAY),
                               aggregate_fn=half_and_double, seed=0)
    yield RayBackend(cluster)
    shutdown_cluster(cluster)


@pytest.fixture(scope="module")
def items():
    return make_arithmetic_task(ArithmeticTaskSpec(num_train=24, num_heldout=1, seed=2))[0]


def run(backend, items, schedule, steps=1, gen=GEN, source=None, logger=None, tools=None, **settings):
    logged = []
    hooks = {k: settings.pop(k) for k in Hooks._fields if k in settings}
    state = train(backend, source or make_prompt_source(items, seed=1), schedule,
                  RLRun(gen, steps, PROMPTS, lambda s: 1e-3, progress=False, **settings),
                  hooks=Hooks(logger=logger or logged.append, **hooks), tools=tools)
    return list(state.metrics_history)


# ----------------------------------------------------------------------------- rewards
def test_reward_and_aggregate_run_on_the_reward_worker(backend, items):
    """The logged reward is the user's aggregate of the logged components."""
    m = run(backend, items, constant_schedule(grpo(kl_coef=0.0)), component_names=["spread", "exact"])[0]
    assert m["reward/mean"] == pytest.approx(0.5 * m["reward/spread"] + 2.0 * m["reward/exact"], abs=1e-6)
    assert 0.0 < m["reward/spread"] < 2.0


# ----------------------------------------------------------------------------- algorithm functions
def test_advantage_fn_reaches_the_trainers(backend, items):
    """A constant advantage of 1.5 gives a token-mean policy loss of -1.5 at ratio 1 (the IS
    weights are 1 within fp32: the generator holds the trainers' weights)."""
    algo = grpo(kl_coef=0.0, aggregation=token_mean)._replace(advantage_fn=constant_advantage)
    m = run(backend, items, constant_schedule(algo))[0]
    assert m["loss/policy"] == pytest.approx(-1.5, abs=1e-4)


def test_loss_fn_runs_on_every_trainer_rank(backend, items):
    """Each rank counts its own loss tokens; the merged count is the batch's."""
    m = run(backend, items, constant_schedule(grpo(kl_coef=0.0, loss_fn=counting_loss)))[0]
    assert m["custom/loss_tokens"] == m["batch/loss_tokens"] > 0


def test_kl_fn_in_the_loss(backend, items):
    m = run(backend, items, constant_schedule(grpo(kl_coef=0.1, aggregation=token_mean, kl_fn=quarter_kl)))[0]
    assert m["loss/kl"] == pytest.approx(0.25, abs=1e-6)


def test_kl_fn_in_the_reward(backend, items):
    """KL in the reward goes through the advantage function: here the advantage is the KL."""
    algo = grpo(kl_coef=0.1, kl_in_reward=True, aggregation=token_mean, kl_fn=half_kl,
                advantage_fn=kl_as_advantage)
    m = run(backend, items, constant_schedule(algo))[0]
    assert m["loss/policy"] == pytest.approx(-0.5, abs=1e-4) and "loss/kl" not in m


def test_pair_selector_picks_the_trainers_rows(backend, items):
    algo = online_dpo(pair_selector=two_pairs)
    m = run(backend, items, constant_schedule(algo))[0]
    assert m["dpo/pairs"] == 2 * PROMPTS and m["batch/rows"] == 4 * PROMPTS


def test_policy_loss_fn_and_aggregation_reach_the_trainers(backend, items):
    """A constant surrogate 0.7, token-mean: the loss is 0.7; summed instead: 0.7 per loss token."""
    m = run(backend, items, constant_schedule(grpo(kl_coef=0.0, aggregation=token_mean,
                                                   policy_loss_fn=constant_surrogate)))[0]
    assert m["loss/policy"] == pytest.approx(0.7, abs=1e-4)
    m = run(backend, items, constant_schedule(grpo(kl_coef=0.0, aggregation=summed,
                                                   policy_loss_fn=constant_surrogate)))[0]
    assert m["loss/policy"] == pytest.approx(0.7 * m["batch/loss_tokens"], rel=1e-4)


def test_filters_drop_groups_and_the_step_is_refilled(backend, items):
    logged = []
    run(backend, items, constant_schedule(grpo(kl_coef=0.0, filters=(even_prompts,))), logger=logged.append,
        max_resample_rounds=8)
    m = logged[0]
    assert m["batch/rows"] == PROMPTS * GEN.n  # refilled to the step's prompts, all of them even
    assert m["data/resample_rounds"] >= 1 and m["data/prompts_drawn"] > PROMPTS


def test_an_algorithm_a_schedule_turns_to_is_checked_before_its_step(backend, items):
    """PPO needs a critic this cluster lacks: the switch fails before the step collects anything."""
    from primitives.maths.algorithms import ppo

    logged = []
    with pytest.raises(ValueError, match="'ppo'.*no critic"):
        run(backend, items, metric_switch_schedule(grpo(kl_coef=0.0), ppo(), "reward/mean", -1.0), steps=3,
            logger=logged.append)
    assert [m["algorithm"] for m in logged] == ["grpo"]


def test_schedule_switches_on_the_last_metrics(backend, items):
    """GRPO until a step's mean reward passes -1 (the first does), then online DPO with the
    user's pairwise loss: the trainers compute DPO metrics from the second step on."""
    dpo = online_dpo(loss_fn=dpo_loss, pair_selector=two_pairs)
    history = run(backend, items, metric_switch_schedule(grpo(kl_coef=0.0), dpo, "reward/mean", -1.0), steps=3)
    assert [m["algorithm"] for m in history] == ["grpo", "online_dpo", "online_dpo"]
    assert "dpo/pairs" not in history[0] and all(m["dpo/pairs"] == 2 * PROMPTS for m in history[1:])


# ----------------------------------------------------------------------------- reference update
def _reference_weights(backend, tmp_path):
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / "ref")
    gather([call(backend.cluster.reference.group, 0, "save_weights", path)], 300)
    return {k: v.detach().numpy().copy() for k, v in AutoModelForCausalLM.from_pretrained(path).named_parameters()}


def test_ema_reference_update_runs_on_the_reference_worker(backend, items, tmp_path):
    """After two steps the reference is 0.25 r0 + 0.25 w1 + 0.5 w2 (EMA, decay 0.5), w_k the
    trainers' weights synced after step k."""
    r0 = _reference_weights(backend, tmp_path)
    policies = []

    def logger(metrics):
        policies.append(gather(fan_out(backend.cluster.trainers, "full_state"), 300)[0])

    run(backend, items, constant_schedule(grpo(kl_coef=0.05)), steps=2, logger=logger)
    ref = _reference_weights(backend, tmp_path)
    for name, r in ref.items():
        expected = 0.25 * r0[name] + 0.25 * policies[0][name] + 0.5 * policies[1][name]
        np.testing.assert_allclose(r, expected, atol=1e-6, err_msg=name)
    assert any(np.abs(policies[1][n] - r0[n]).max() > 1e-4 for n in r0)  # the policy did move


# ----------------------------------------------------------------------------- tools
def test_tool_parser_executor_and_stop_run_in_the_generator(backend, items):
    """Every turn calls the calculator once; tool tokens are masked, so the trainers' logprobs
    on the loss tokens match the generator's (a tool token scored as a policy token would not)."""
    tools = ToolConfig(create_tool_executor({"calc": calculator_tool}), always_calc, stop_after_tool, max_turns=3)
    one_char_turns = GEN._replace(stop=tuple(string.printable[:94]))  # a truncated turn would call no tool
    m = run(backend, items, constant_schedule(grpo(kl_coef=0.0)), gen=one_char_turns, tools=tools)[0]
    assert m["tools/calls_per_rollout"] == 1.0 and m["tools/success_rate"] == 1.0
    assert m["tools/rollouts_with_calls"] == 1.0  # every rollout: one call, "2+3" -> "5", then the stop
    assert m["tools/untrained_tokens"] >= 1  # the tool's "5" (and its template) is in the rollout, not the loss
    assert m["mismatch/max_abs_logp_diff"] < 1e-4


# ----------------------------------------------------------------------------- prompt source, eval, logger, checkpoint
def test_prompt_source_eval_logger_and_checkpoint(backend, items, tmp_path):
    drawn, saved, logged = [], [], []

    def source(position, n):
        got = [PromptItem(i, items[i].prompt, items[i].answer, epoch=0) for i in range(position.offset,
                                                                                       position.offset + n)]
        drawn.append([it.index for it in got])
        return got, position._replace(offset=position.offset + n)

    def eval_fn(b, state):
        greedy = GenerationConfig(max_new_tokens=4, temperature=0.0)
        return {**evaluate(b, items[:4], greedy, k=1), "custom/eval_step": float(state.iteration)}

    def checkpoint_fn(b, state):
        saved.append(b.save(str(tmp_path / f"step_{state.iteration}"), state))

    state_history = run(backend, items, constant_schedule(grpo(kl_coef=0.0)), steps=2, source=source,
                        logger=logged.append,
                        eval_fn=eval_fn, eval_every=2, checkpoint_fn=checkpoint_fn, checkpoint_every=1)
    assert drawn == [[0, 1, 2, 3], [4, 5, 6, 7]] and [m["step"] for m in logged] == [0, 1]
    assert "custom/eval_step" not in logged[0] and logged[1]["custom/eval_step"] == 2.0
    assert 0.0 <= logged[1]["eval/accuracy"] <= 1.0 and state_history == logged
    assert [os.path.basename(p) for p in saved] == ["step_1", "step_2"]
    assert os.path.isfile(os.path.join(saved[-1], "train_state.json"))


# ----------------------------------------------------------------------------- bad hooks
def test_unpicklable_function_is_named_before_any_step(backend, items):
    lock = threading.Lock()

    def locked_kl(logp, ref_logp, mask):
        with lock:
            return (logp - ref_logp) * mask

    def no_prompts(position, n):
        raise AssertionError("no prompt may be drawn")

    with pytest.raises(ValueError, match="kl_fn: .*locked_kl cannot be sent to the Ray actors"):
        train(backend, no_prompts, constant_schedule(grpo()._replace(kl_fn=locked_kl)),
              RLRun(GEN, num_steps=1, prompts_per_step=PROMPTS, lr_schedule=lambda s: 1e-3, progress=False))


def test_wrong_signature_is_named_before_any_step(backend, items):
    with pytest.raises(ValueError, match="algorithm_schedule: .*cannot be called with 2"):
        train(backend, make_prompt_source(items), lambda iteration: grpo(),
              RLRun(GEN, num_steps=1, prompts_per_step=PROMPTS, lr_schedule=lambda s: 1e-3, progress=False))
    with pytest.raises(ValueError, match="reward_fn: .*cannot be called with 1"):
        build_rl_cluster("unused", ClusterConfig(), TrainerConfig(), lambda: 0.0, with_reference=False)


def test_a_raising_loss_names_the_trainer_rank_the_rollouts_and_the_function(backend, items):
    from cluster.ray_wing.groups import ActorFailure

    with pytest.raises(ActorFailure) as e:
        run(backend, items, constant_schedule(grpo(kl_coef=0.0, loss_fn=failing_loss)))
    text = str(e.value)
    for part in ("trainer 0", "loss_fn", "failing_loss", "rollouts e", "boom in the user's loss"):
        assert part in text, (part, text)


def test_advantage_inputs_are_documented_fields():
    assert adv.AdvantageInputs._fields == ("rewards", "groups", "mask", "token_kl", "values")
