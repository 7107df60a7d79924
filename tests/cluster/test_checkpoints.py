"""Checkpoints by time as well as by step count (``Hooks.checkpoint_minutes``), in the RL
loop and the SFT loop on the local backend, under a clock the test moves; ``checkpoint.resume
auto`` resolved before anything loads; a killed job continues from its newest checkpoint."""
import json
import os
import shutil
import sys
import types

import numpy as np
import pytest

import cluster.loop.sft as sft_loop
import cluster.loop.train as rl_loop
from cluster.jobs.checks import ConfigErrors
from cluster.jobs.config import CheckpointConfig, DataConfig, LoggingConfig, RLJob, SFTConfig, SFTJob
from cluster.jobs.inputs import prepare_rl, prepare_sft
from cluster.local import LocalBackend
from cluster.loop.sft import SFTRun, train_sft
from cluster.loop.train import Hooks, RLRun, checkpoint_due, train
from primitives.fixtures.tasks import ArithmeticTaskSpec, arithmetic_reward, make_arithmetic_task
from primitives.io.data import SFTSample, make_prompt_source
from primitives.maths.algorithms import constant_schedule, grpo
from primitives.types import GenerationConfig, ModelConfig, TrainState
from rl_actors.trainer import TrainerConfig
from tests.conftest import ROOT, run_job

DEFAULT = os.path.join(ROOT, "examples", "configs", "default.yaml")

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


# ----------------------------------------------------------------------------- jobs: resume auto, keep


def _plant(directory, name: str, complete: bool = True) -> str:
    """A directory shaped like a cluster checkpoint (train_state.json with the step of its name,
    deepspeed/), or like half of one (deepspeed/ only)."""
    path = os.path.join(directory, name)
    os.makedirs(os.path.join(path, "deepspeed"))
    if complete:
        with open(os.path.join(path, "train_state.json"), "w") as f:
            json.dump({"iteration": int(name.split("_")[1].split(".")[0])}, f)
    return path


def _rl_job(tmp_path, model, **checkpoint):
    return RLJob(model=ModelConfig(model), data=DataConfig(task="arithmetic"), sft=SFTConfig(steps=3),
                 checkpoint=CheckpointConfig(**checkpoint), logging=LoggingConfig(out=str(tmp_path / "out")))


def test_resume_auto_is_a_fresh_start_with_sft_when_the_run_has_no_checkpoint(tmp_path, tiny_model_path, capsys):
    """No <out>/checkpoints, or only leftovers and half-written ones in it: ``auto`` is None, said
    so, and the SFT stage's samples are loaded (the stage runs)."""
    inputs = prepare_rl(_rl_job(tmp_path, tiny_model_path, resume="auto"))
    assert inputs.job.checkpoint.resume is None and len(inputs.sft_samples) > 0
    checkpoints = str(tmp_path / "out" / "checkpoints")
    _plant(checkpoints, "step_4.tmp")
    _plant(checkpoints, "step_5.tmp-x1")
    _plant(checkpoints, "step_6", complete=False)
    inputs = prepare_rl(_rl_job(tmp_path, tiny_model_path, resume="auto"))
    assert inputs.job.checkpoint.resume is None and len(inputs.sft_samples) > 0
    assert f"no checkpoint in {checkpoints}: a fresh start" in capsys.readouterr().out


def test_resume_auto_resolves_to_the_newest_complete_checkpoint_before_loading(tmp_path, tiny_model_path, capsys):
    """step_10 over step_9 (a leftover step_11.tmp and a half-written step_12 aside), chosen in
    ``prepare_rl`` and ``prepare_sft``; the RL job then loads no SFT samples (no SFT again)."""
    checkpoints = str(tmp_path / "out" / "checkpoints")
    for name in ("step_9", "step_10", "step_11.tmp"):
        _plant(checkpoints, name)
    _plant(checkpoints, "step_12", complete=False)
    newest = os.path.join(checkpoints, "step_10")
    inputs = prepare_rl(_rl_job(tmp_path, tiny_model_path, resume="auto"))
    assert inputs.job.checkpoint.resume == newest and inputs.sft_samples == []
    assert f"checkpoint.resume auto: resuming from {newest}" in capsys.readouterr().out
    sft_rows = [{"prompt": f"{a}+1=", "completion": str(a + 1)} for a in range(8)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_rows))
    sft_job = SFTJob(model=ModelConfig(tiny_model_path), sft=SFTConfig(steps=12, path=str(tmp_path / "sft.jsonl")),
                     checkpoint=CheckpointConfig(resume="auto"), logging=LoggingConfig(out=str(tmp_path / "out")))
    assert prepare_sft(sft_job).job.checkpoint.resume == newest


def test_a_resume_with_nothing_left_to_train_is_refused_before_ray(tmp_path, tiny_model_path, monkeypatch):
    """A checkpoint at algorithm.steps (80 by default) or past it would run no step and write an empty
    history over the run's metrics and summary: refused by name, before Ray; one step short is taken.
    The same for an SFT job against sft.steps (refused once Ray was up, and only past it, before)."""
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    checkpoints = str(tmp_path / "out" / "checkpoints")
    for step in (80, 81):
        path = _plant(checkpoints, f"step_{step}")
        with pytest.raises(ConfigErrors, match=rf"checkpoint.resume {path} is at step {step}, algorithm.steps is 80: "
                                               r"nothing is left to train; raise algorithm.steps"):
            prepare_rl(_rl_job(tmp_path, tiny_model_path, resume=path))
    with open(os.path.join(path, "train_state.json"), "w") as f:
        json.dump({}, f)
    with pytest.raises(ConfigErrors, match="train_state.json has no step to continue from"):
        prepare_rl(_rl_job(tmp_path, tiny_model_path, resume=path))
    assert "ray" not in sys.modules
    assert prepare_rl(_rl_job(tmp_path, tiny_model_path, resume=_plant(checkpoints, "step_79"))).sft_samples == []
    # found by auto, the run's last checkpoint (its driver killed before the final outputs: the k8s RayJob's
    # retry) is taken, and the run finishes
    last = _plant(str(tmp_path / "done" / "checkpoints"), "step_80")
    done = _rl_job(tmp_path, tiny_model_path, resume="auto")._replace(logging=LoggingConfig(out=str(tmp_path / "done")))
    assert prepare_rl(done).job.checkpoint.resume == last
    past = _plant(str(tmp_path / "done" / "checkpoints"), "step_81")  # steps lowered since: refused, auto or not
    with pytest.raises(ConfigErrors, match=rf"{past} is at step 81, algorithm.steps is 80: nothing is left"):
        prepare_rl(done)
    sft_rows = [{"prompt": f"{a}+1=", "completion": str(a + 1)} for a in range(8)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_rows))

    def sft_job(resume):
        return SFTJob(model=ModelConfig(tiny_model_path), sft=SFTConfig(steps=2, path=str(tmp_path / "sft.jsonl")),
                      checkpoint=CheckpointConfig(resume=resume), logging=LoggingConfig(out=str(tmp_path / "sft")))

    at_end = _plant(str(tmp_path / "sft" / "checkpoints"), "step_2")
    with pytest.raises(ConfigErrors, match=rf"{at_end} is at step 2, sft.steps is 2: nothing is left to train"):
        prepare_sft(sft_job(at_end))
    one_short = _plant(str(tmp_path / "sft" / "checkpoints"), "step_1")
    assert prepare_sft(sft_job(one_short)).job.checkpoint.resume == one_short
    assert prepare_sft(sft_job("auto")).job.checkpoint.resume == at_end  # found by auto at the end: it finishes
    assert "ray" not in sys.modules


def test_a_fresh_start_sets_an_earlier_runs_outputs_aside(tmp_path, tiny_model_path, capsys):
    """An earlier run's outputs in <out> (its higher-step checkpoints would outrank the new run's: pruned
    first, taken by a later resume auto) move to <out>/earlier/<time>/ when a job starts afresh there,
    whole; a file of the user's stays, and a run continuing from <out>/checkpoints moves nothing."""
    from cluster.jobs.outputs import RUN_OUTPUTS, set_aside_earlier_run, start_output
    from primitives.io.checkpoint import latest_checkpoint

    out = tmp_path / "out"
    checkpoints = str(out / "checkpoints")
    _plant(checkpoints, "step_80")
    (out / "samples").mkdir()
    (out / "samples" / "step_79.jsonl").write_text("earlier\n")
    for name in ("metrics.jsonl", "summary.json", "trained_groups.jsonl", "notes.txt"):
        (out / name).write_text(f"{name} of the earlier run\n")
    kept = os.path.join(checkpoints, "step_80")
    assert set_aside_earlier_run(str(out), [kept]) is None  # continuing in place: nothing moves
    (out / "final_model" / "hf").mkdir(parents=True)
    (tmp_path / "link").symlink_to(out)
    for reads in ([str(out / "final_model")], [None, str(out / "final_model" / "hf")],  # its model: the run's output
                  [str(tmp_path / "link" / "checkpoints" / "step_80")]):  # the same checkpoint through a link
        assert set_aside_earlier_run(str(out), reads) is None and os.path.isdir(kept)
        assert set_aside_earlier_run(str(tmp_path / "link"), reads) is None and os.path.isdir(kept)
    assert set_aside_earlier_run(str(out), [str(tmp_path / "elsewhere" / "checkpoints" / "step_3")]) is not None
    aside = os.path.join(out, "earlier", os.listdir(out / "earlier")[0])
    assert sorted(os.listdir(aside)) == ["checkpoints", "final_model", "metrics.jsonl", "samples", "summary.json",
                                         "trained_groups.jsonl"]
    assert open(os.path.join(aside, "samples", "step_79.jsonl")).read() == "earlier\n"
    assert latest_checkpoint(checkpoints) is None and latest_checkpoint(os.path.join(aside, "checkpoints"))
    assert sorted(os.listdir(out)) == ["earlier", "notes.txt"]
    assert set_aside_earlier_run(str(out)) is None  # nothing of a run left to move
    assert set_aside_earlier_run(str(tmp_path / "new")) is None and not (tmp_path / "new").exists()
    (out / "metrics.jsonl").write_text("a second earlier run\n")
    job = _rl_job(tmp_path, tiny_model_path)._replace(logging=LoggingConfig(out=str(out)))
    (out / "final_model").mkdir()
    _plant(str(out / "final_model"), "step_80")
    final = job._replace(checkpoint=CheckpointConfig(resume=str(out / "final_model" / "step_80")))
    start_output(final)  # the job way, resuming from the run's own final model: nothing moves
    assert len(os.listdir(out / "earlier")) == 1 and (out / "final_model" / "step_80" / "deepspeed").is_dir()
    (out / "final_model" / "step_80" / "train_state.json").unlink()
    start_output(job)  # a fresh start the job way: the second earlier run goes to a directory of its own
    assert len(os.listdir(out / "earlier")) == 2 and "moved to" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["config.yaml", "earlier", "notes.txt"] and "config.yaml" in RUN_OUTPUTS


def test_a_resume_that_changes_training_settings_is_refused_unless_allowed(tmp_path, tiny_model_path, capsys,
                                                                          monkeypatch):
    """A resume continues the run that wrote the checkpoint: one whose job changes that run's training settings
    (its ``config.yaml`` as the run's start wrote it; a k8s RayJob re-applied with an edited config and the same
    ``logging.out``) is refused before Ray, every change named, auto or a named checkpoint, unless
    ``checkpoint.allow_changes``; what a resume may change (the step count, evaluation, checkpoints, logging,
    the cluster, the model's device and attention kernel, the decode loop and its batches) passes, and so does
    a checkpoint with no run config beside it. The same for an SFT job."""
    import re

    from cluster.jobs.config import dump_config

    monkeypatch.delitem(sys.modules, "ray", raising=False)
    fresh = _rl_job(tmp_path, tiny_model_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.yaml").write_text(dump_config(prepare_rl(fresh).job))  # as start_output writes it
    step = _plant(str(tmp_path / "out" / "checkpoints"), "step_4")
    same = _rl_job(tmp_path, tiny_model_path, resume="auto")
    assert prepare_rl(same).job.checkpoint.resume == step
    free = same._replace(algorithm=same.algorithm._replace(steps=90), eval=same.eval._replace(every=5),
                         cluster=same.cluster._replace(micro_batch_size=8),
                         logging=same.logging._replace(console_every=3), checkpoint=same.checkpoint._replace(every=2),
                         generation=same.generation._replace(decode="eager", max_batch_rows=16),
                         model=same.model._replace(device="cpu", attn_implementation="eager"))
    assert prepare_rl(free).job.checkpoint.resume == step
    edited = same._replace(algorithm=same.algorithm._replace(lr=1e-4), seed=7,
                           generation=same.generation._replace(temperature=0.7))
    changes = ["algorithm.lr 0.0003 -> 0.0001", "generation.temperature 1.0 -> 0.7", "seed 0 -> 7"]
    for job in (edited, edited._replace(checkpoint=CheckpointConfig(resume=step))):
        with pytest.raises(ConfigErrors) as refused:
            prepare_rl(job)
        message = str(refused.value)
        assert f"checkpoint.resume {step}: this job changes settings of the run that wrote the checkpoint" in message
        assert "; ".join(changes) in message and "checkpoint.allow_changes" in message
        assert message.count(" -> ") == 3
    assert "ray" not in sys.modules
    capsys.readouterr()
    allowed = edited._replace(checkpoint=edited.checkpoint._replace(allow_changes=True))
    assert prepare_rl(allowed).job.checkpoint.resume == step
    assert f"continuing with changed settings: {'; '.join(changes)}" in capsys.readouterr().out
    copied = _plant(str(tmp_path / "copied"), "step_4")  # no run around it: nothing to compare with
    assert prepare_rl(edited._replace(checkpoint=CheckpointConfig(resume=copied))).job.checkpoint.resume == copied
    # a dict-valued field is one value (a key added, or the dict from none), rewards a list of records, and the
    # model's path once resolved (the same directory through a link passes, another one does not)
    overrides = same._replace(algorithm=same.algorithm._replace(overrides={"clip_eps_high": 0.28}))
    rewards = same._replace(rewards=same.rewards + (same.rewards[0]._replace(weight=0.5, label="half"),))
    os.symlink(tiny_model_path, tmp_path / "link")
    linked = same._replace(model=same.model._replace(model_name_or_path=str(tmp_path / "link")))
    other = same._replace(model=same.model._replace(model_name_or_path=str(tmp_path / "other_model")))
    shutil.copytree(tiny_model_path, tmp_path / "other_model")
    assert prepare_rl(linked).job.checkpoint.resume == step
    for job, field in ((overrides, "algorithm.overrides None -> {'clip_eps_high': 0.28}"), (rewards, "rewards ["),
                       (other, f"model.model_name_or_path {tiny_model_path!r} -> {str(tmp_path / 'other_model')!r}")):
        with pytest.raises(ConfigErrors, match=re.escape(field)):
            prepare_rl(job)
    # a run config a kill cut short: refused, named, unless allowed
    (tmp_path / "out" / "config.yaml").write_text("model:\n  model_name_or_path: [")
    with pytest.raises(ConfigErrors, match=r"the settings of the run that wrote the checkpoint are not known: .*"
                                           r"config.yaml cannot be read"):
        prepare_rl(same)
    assert prepare_rl(allowed).job.checkpoint.resume == step

    sft_rows = [{"prompt": f"{a}+1=", "completion": str(a + 1)} for a in range(8)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_rows))
    sft_job = SFTJob(model=ModelConfig(tiny_model_path), sft=SFTConfig(steps=6, path=str(tmp_path / "sft.jsonl")),
                     logging=LoggingConfig(out=str(tmp_path / "sft")))
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "config.yaml").write_text(dump_config(prepare_sft(sft_job).job))
    sft_step = _plant(str(tmp_path / "sft" / "checkpoints"), "step_3")
    resumed = sft_job._replace(checkpoint=CheckpointConfig(resume="auto"))
    assert prepare_sft(resumed._replace(sft=resumed.sft._replace(steps=9))).job.checkpoint.resume == sft_step
    with pytest.raises(ConfigErrors, match=re.escape("sft.lr 1e-05 -> 2e-05")):
        prepare_sft(resumed._replace(sft=resumed.sft._replace(lr=2e-5)))


def test_evaluation_settings_count_where_they_shape_training(tmp_path):
    """``resume_changes``: evaluation may change on a resume, but ``eval.enabled`` not where the eval prompts are
    held out of the training file (off, they go back into training), nor any of ``eval`` where a metric schedule
    watches an evaluation. A run config of an older version (a reward record without a later field, a field
    since removed) is compared on what both hold."""
    import yaml

    from cluster.jobs.config import EvalConfig, EvalData, RewardSpec, ScheduleConfig, dump_config
    from cluster.jobs.resume import resume_changes

    run = tmp_path / "run"
    step = _plant(str(run / "checkpoints"), "step_3")

    def write(job, edit=lambda saved: None):  # the run's config.yaml, its tiny model resolved as the run did
        saved = yaml.safe_load(dump_config(job))
        saved["model"]["model_name_or_path"] = str(run / "base_model")
        edit(saved)
        (run / "config.yaml").write_text(yaml.safe_dump(saved))

    def older(saved):
        del saved["rewards"][0]["label"]  # an older version's reward record
        saved["algorithm"]["retired_field"] = 1

    held_out = RLJob(model=ModelConfig("tiny"), data=DataConfig(path="prompts.jsonl", eval_set=EvalData(size=0.25)),
                     rewards=(RewardSpec("exact_match", label="match"),))
    write(held_out, older)
    assert resume_changes(step, held_out, "algorithm.steps") == []
    off = held_out._replace(eval=EvalConfig(enabled=False))
    assert resume_changes(step, off, "algorithm.steps") == [("eval.enabled", True, False)]
    assert resume_changes(step, held_out._replace(eval=EvalConfig(every=5)), "algorithm.steps") == []
    # an embedded model, built where each run puts it (here into another output directory), by its directory's name
    elsewhere = held_out._replace(logging=held_out.logging._replace(out=str(tmp_path / "elsewhere")))
    assert resume_changes(step, elsewhere, "algorithm.steps") == []
    assert resume_changes(step, held_out._replace(model=ModelConfig("smollm2")), "algorithm.steps") == [
        ("model.model_name_or_path", str(run / "base_model"), "smollm2")]
    on_task = held_out._replace(data=DataConfig(task="arithmetic"))
    write(on_task)
    assert resume_changes(step, on_task._replace(eval=EvalConfig(enabled=False)), "algorithm.steps") == []
    watching = on_task._replace(schedule=ScheduleConfig(kind="metric", metric="eval/accuracy"))
    write(watching)
    assert resume_changes(step, watching._replace(eval=EvalConfig(every=5)), "algorithm.steps") == [
        ("eval.every", 20, 5)]


def test_a_resume_in_place_keeps_the_metrics_rows_before_its_checkpoint(tmp_path):
    """``rows_before_resume``: an RL job resuming from ``<out>/checkpoints/step_2`` keeps its SFT stage's rows
    (any step), the evaluation before RL (step -1) and RL steps 0-1; RL steps 2 on (trained again), an earlier
    resume's evaluation at the checkpoint (step 1, made again) and a cut line go. An SFT job at its step 2
    keeps SFT steps 0-1. A checkpoint of another run, or no resume: nothing."""
    from cluster.jobs.outputs import rows_before_resume

    out = tmp_path / "out"
    step = _plant(str(out / "checkpoints"), "step_2")
    rows = [{"step": k, "phase": "sft", "loss/sft": 1.0 / (k + 1)} for k in range(4)]
    rows += [{"step": -1, "eval/accuracy": 0.1}] + [{"step": k, "reward/mean": k / 10} for k in range(4)]
    rows.insert(7, {"step": 1, "eval/accuracy": 0.2})  # an earlier resume's evaluation at this checkpoint
    lines = [json.dumps(r) + "\n" for r in rows]
    (out / "metrics.jsonl").write_text("".join(lines) + '{"step": 4, "rew')
    assert rows_before_resume(str(out), step, None) == lines[:7]  # SFT 0-3, step -1's evaluation, RL 0-1
    assert rows_before_resume(str(out), step, "sft") == lines[:2] + lines[4:]
    other = _plant(str(tmp_path / "other" / "checkpoints"), "step_2")
    assert rows_before_resume(str(out), other, None) == [] and rows_before_resume(str(out), None, None) == []


def test_a_lora_resume_takes_the_sft_model_of_the_checkpoints_own_run(tmp_path):
    """``adapters_base``: a LoRA checkpoint after a full-weight SFT stage names ``<out>/sft_model/hf``; once
    its run was set aside into ``<out>/earlier/<time>/`` (the stage's model with it) and a newer run wrote
    its own ``<out>/sft_model``, the checkpoint's own run's model is the base, not the named newer one."""
    from cluster.jobs.inputs import adapters_base

    out = tmp_path / "out"
    named = out / "sft_model" / "hf"
    named.mkdir(parents=True)
    run = out / "earlier" / "20261202-120000"
    (run / "sft_model" / "hf").mkdir(parents=True)
    step = run / "checkpoints" / "step_40" / "adapter"
    step.mkdir(parents=True)
    (step / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(named)}))
    assert adapters_base(str(run / "checkpoints" / "step_40")) == str(run / "sft_model" / "hf")
    in_place = out / "checkpoints" / "step_7" / "adapter"
    in_place.mkdir(parents=True)
    (in_place / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(named)}))
    assert adapters_base(str(out / "checkpoints" / "step_7")) == str(named)
    elsewhere = tmp_path / "copied" / "step_9" / "adapter"  # a checkpoint copied out of its run: the named base
    elsewhere.mkdir(parents=True)
    (elsewhere / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(named)}))
    assert adapters_base(str(tmp_path / "copied" / "step_9")) == str(named)


def test_resume_alias_on_the_command_line():
    from cluster.jobs.cli import parse

    for args in (["--resume", "auto"], ["--resume=auto"], ["--checkpoint.resume", "auto"]):
        for command in ("rl", "sft"):
            assert parse([command, *args])[1].checkpoint.resume == "auto"
    assert parse(["rl", "--resume", "runs/x/checkpoints/step_4"])[1].checkpoint.resume == "runs/x/checkpoints/step_4"


@pytest.mark.parametrize("field,value", [("every", -1), ("minutes", -0.5), ("keep", -2)])
def test_a_negative_checkpoint_setting_fails_before_ray(tmp_path, tiny_model_path, field, value, monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    for prepare, job in ((prepare_rl, _rl_job(tmp_path, tiny_model_path, **{field: value})),
                         (prepare_sft, SFTJob(model=ModelConfig(tiny_model_path), sft=SFTConfig(steps=1, path="x"),
                                              checkpoint=CheckpointConfig(**{field: value})))):
        with pytest.raises(ConfigErrors, match=f"checkpoint.{field} must be >= 0"):
            prepare(job)
    assert "ray" not in sys.modules


@pytest.mark.slow
def test_a_killed_run_continues_with_resume_auto(tmp_path, capsys):
    """``rayrl rl ... --resume auto`` three ways: on an empty output directory a fresh start
    (SFT, then RL from step 0), writing a checkpoint every step and keeping the newest 2; after
    a write killed mid-way (a leftover ``step_9.tmp`` shaped like a checkpoint) and a
    half-written ``step_7``, the same command continues from ``step_3`` - no SFT again; its
    ``metrics.jsonl`` keeps the earlier rows before step 3 and drops a killed run's past it - and
    keeps pruning; leftovers are never touched. Its summary takes the run's first steps from the
    checkpoint's history (a reward that varies from step to step: the tiny model scores 0 on the task)."""
    import yaml

    out = str(tmp_path / "run")
    checkpoints = os.path.join(out, "checkpoints")
    (tmp_path / "varied.py").write_text("def reward(r):\n    return float(int(sum(r.completion_ids)) % 3)\n")
    job = yaml.safe_load(open(DEFAULT))
    job["rewards"] = [{"name": f"{tmp_path / 'varied.py'}:reward"}]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    command = ["rl", str(tmp_path / "job.yaml"), "--logging.out", out, "--resume", "auto", "--checkpoint.every", "1",
               "--sft.steps", "5", "--eval.enabled", "False", "--eval.final-pass-k", "0",
               "--algorithm.prompts-per-step", "8"]

    def rows():
        return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]

    fresh = run_job([*command, "--algorithm.steps", "3"])
    assert "a fresh start" in capsys.readouterr().out
    first = rows()
    assert any("loss/sft" in r for r in first)
    assert [r["step"] for r in first if "reward/mean" in r] == [0, 1, 2]
    assert sorted(os.listdir(checkpoints)) == ["step_2", "step_3"]  # keep 2
    _plant(checkpoints, "step_9.tmp")
    _plant(checkpoints, "step_7", complete=False)
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:  # a killed run's step past its checkpoint, a cut line
        f.write(json.dumps({"step": 3, "reward/mean": 123.0}) + "\n" + '{"step": 4, "rew')

    summary = run_job([*command, "--algorithm.steps", "5"])
    assert f"resuming from {os.path.join(checkpoints, 'step_3')}" in capsys.readouterr().out
    second = rows()
    # the earlier run's rows before the checkpoint stay (its SFT stage's too: not repeated), the rest goes
    assert second[: len(first)] == first
    assert [r["step"] for r in second if "reward/mean" in r] == [0, 1, 2, 3, 4]
    # its summary says where it resumed and takes the run's first steps from the checkpoint's history
    rewards = [r["reward/mean"] for r in second if "reward/mean" in r]
    assert summary["resumed_at_step"] == 3 and fresh["resumed_at_step"] == 0 and len(set(rewards)) > 1
    assert summary["reward_mean_first5"] == round(sum(rewards[:5]) / 5, 4)
    assert not any(r.get("reward/mean") == 123.0 for r in second)
    assert [r for r in second if "loss/sft" in r] == [r for r in first if "loss/sft" in r]
    assert summary["rl_steps"] == 5 and summary["median_over_rl_steps"]
    assert sorted(os.listdir(checkpoints)) == ["step_4", "step_5", "step_7", "step_9.tmp"]
    with open(os.path.join(checkpoints, "step_5", "train_state.json")) as f:
        assert json.load(f)["iteration"] == 5
