"""Checkpoints by time as well as by step count (``Hooks.checkpoint_minutes``), in the RL
loop and the SFT loop on the local backend, under a clock the test moves."""
import types

import numpy as np
import pytest

import cluster.loop.sft as sft_loop
import cluster.loop.train as rl_loop
from cluster.local import LocalBackend
from cluster.loop.sft import SFTRun, train_sft
from cluster.loop.train import Hooks, RLRun, checkpoint_due, train
from primitives.fixtures.tasks import ArithmeticTaskSpec, arithmetic_reward, make_arithmetic_task
from primitives.io.data import SFTSample, make_prompt_source
from primitives.maths.algorithms import constant_schedule, grpo
from primitives.types import GenerationConfig, TrainState
from rl_actors.trainer import TrainerConfig

STEP_S = 40.0  # each step of the fake clock takes 40 s


class StepClock:
    """``time.perf_counter`` of the loops: each step ends ``STEP_S`` seconds after the last
    (the logger moves it to ``(step + 1) * STEP_S``); between, every reading adds a microsecond,
    so the clock only goes forward."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-6
        return self.now

    def step_ended(self, metrics: dict) -> None:
        self.now = (metrics["step"] + 1) * STEP_S


@pytest.fixture
def clock(monkeypatch):
    clock = StepClock()
    fake = types.SimpleNamespace(perf_counter=clock.perf_counter)
    monkeypatch.setattr(rl_loop, "time", fake)
    monkeypatch.setattr(sft_loop, "time", fake)
    return clock


def test_checkpoint_due_by_steps_or_by_minutes(clock):
    clock.now = 100.0
    assert checkpoint_due(4, every=2, minutes=0.0, since=99.0)
    assert not checkpoint_due(3, every=2, minutes=0.0, since=0.0)  # time is off
    assert not checkpoint_due(3, every=0, minutes=1.0, since=50.0)  # 50 s < 60 s
    assert checkpoint_due(3, every=0, minutes=1.0, since=40.0)  # 60 s
    assert checkpoint_due(3, every=5, minutes=0.5, since=60.0)  # 40 s >= 30 s
    assert not checkpoint_due(3, every=0, minutes=0.0, since=-1e9)


def _rl(backend, steps: int, hooks: Hooks, state: TrainState = TrainState()):
    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=24, num_heldout=1, seed=1))[0]
    gen = GenerationConfig(max_new_tokens=3, n=2, temperature=1.0)
    return train(backend, make_prompt_source(items, seed=0), constant_schedule(grpo(kl_coef=0.0)),
                 RLRun(gen, num_steps=steps, prompts_per_step=2, lr_schedule=lambda step: 1e-3, progress=False),
                 state=state, hooks=hooks)


@pytest.mark.parametrize("every,minutes,saved", [
    (0, 1.5, [3, 6]),  # 120 s since the start at step 3 (90 s is due), then 120 s since that save
    (4, 1.5, [3, 4, 7]),  # a save by count restarts the time rule too
    (0, 0.0, []),  # both off
    (3, 0.0, [3, 6]),  # by count alone
])
def test_the_rl_loop_checkpoints_by_time(tiny_model_path, clock, every, minutes, saved):
    """Steps of 40 s on the local backend: with ``checkpoint_minutes`` 1.5 the loop saves after
    the first step that ends 90 s or more after its start or its last save."""
    backend = LocalBackend(tiny_model_path, arithmetic_reward, trainer=TrainerConfig(lr=1e-3), seed=0)
    saves = []
    hooks = Hooks(logger=clock.step_ended, checkpoint_fn=lambda b, state: saves.append(state.iteration),
                  checkpoint_every=every, checkpoint_minutes=minutes)
    state = _rl(backend, 7, hooks)
    assert state.iteration == 7 and saves == saved


def test_a_resumed_rl_loop_counts_time_from_its_own_start(tiny_model_path, clock):
    """The time rule counts from the loop's start, not from step 0's: a loop resumed at step 4
    with the clock at 160 s saves 90 s later (step 7 ends at 280 s), not at its first step."""
    backend = LocalBackend(tiny_model_path, arithmetic_reward, trainer=TrainerConfig(lr=1e-3), seed=0)
    saves = []
    clock.now = 4 * STEP_S
    _rl(backend, 8, Hooks(logger=clock.step_ended, checkpoint_fn=lambda b, s: saves.append(s.iteration),
                          checkpoint_minutes=1.5), state=TrainState(iteration=4))
    assert saves == [7]


def test_the_sft_loop_checkpoints_by_time(tiny_model_path, clock):
    backend = LocalBackend(tiny_model_path, arithmetic_reward, trainer=TrainerConfig(lr=1e-3), seed=0)
    ids = np.arange(3, 11, dtype=np.int64)
    samples = [SFTSample(ids + i, np.array([0.0] * 4 + [1.0] * 4, dtype=np.float32)) for i in range(4)]
    saves = []
    train_sft(backend, samples, SFTRun(7, 2, lambda step: 1e-3, progress=False),
              Hooks(logger=clock.step_ended, checkpoint_fn=lambda b, step: saves.append(step), checkpoint_minutes=1.5))
    assert saves == [3, 6]


def test_a_negative_checkpoint_minutes_is_refused(tiny_model_path):
    with pytest.raises(ValueError, match="checkpoint_minutes must be >= 0"):
        _rl(None, 1, Hooks(checkpoint_minutes=-1.0))
    with pytest.raises(ValueError, match="checkpoint_minutes must be >= 0"):
        train_sft(None, ["a sample"], SFTRun(1, 1, lambda step: 1e-3), Hooks(checkpoint_minutes=-1.0))
