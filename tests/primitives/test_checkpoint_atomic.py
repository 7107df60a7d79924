"""A checkpoint killed mid-write (SIGKILL, in a real child process) leaves the previous one
intact and is never taken for a checkpoint; ``latest_checkpoint`` picks the newest complete
``step_N`` by number; ``prune_checkpoints`` keeps the newest ``keep``. A PEFT-wrapped model's every
weight comes back from a checkpoint (``save_model_weights``)."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from primitives.io.checkpoint import latest_checkpoint, prune_checkpoints, step_checkpoints
from tests.conftest import ROOT


def _complete(directory, name: str, step: int) -> str:
    """A directory shaped like a finished cluster checkpoint (train_state.json, deepspeed/)."""
    path = os.path.join(directory, name)
    os.makedirs(os.path.join(path, "deepspeed"))
    with open(os.path.join(path, "train_state.json"), "w") as f:
        json.dump({"iteration": step}, f)
    with open(os.path.join(path, "deepspeed", "shard.pt"), "w") as f:
        f.write(f"weights of step {step}")
    return path


def _contents(path: str) -> dict:
    return {os.path.relpath(os.path.join(folder, name), path): open(os.path.join(folder, name)).read()
            for folder, _, names in os.walk(path) for name in names}


# a child that starts writing a checkpoint, leaves a marker once part of it is on disk, and
# sleeps there until the parent kills it; argv: the mode, the checkpoint path, the marker name
CHILD = """
import json, os, sys, time
mode, path, marker = sys.argv[1:4]

def stall(directory):
    open(os.path.join(directory, marker), "w").close()
    time.sleep(600)

def write(staging):  # what a checkpoint's last writer does: train_state.json, then the rest
    os.makedirs(os.path.join(staging, "deepspeed"), exist_ok=True)
    with open(os.path.join(staging, "train_state.json"), "w") as f:
        json.dump({"iteration": -1}, f)
    stall(staging)

if mode == "atomic_directory":
    from primitives.io.checkpoint import atomic_directory
    atomic_directory(path, write)
else:  # DeepSpeedRank.save, one rank, its engine replaced by one that writes a shard file
    import torch.distributed as dist
    from rl_actors.deepspeed_rank import DeepSpeedRank

    class Engine:
        def save_checkpoint(self, directory, tag, client_state, exclude_frozen_parameters=False):
            os.makedirs(os.path.join(directory, tag))
            with open(os.path.join(directory, tag, "shard.pt"), "w") as f:
                f.write("new shard")
            if mode == "deepspeed_shards":
                stall(directory)

    dist.init_process_group("gloo", init_method="file://" + path + ".store", rank=0, world_size=1)
    rank = object.__new__(DeepSpeedRank)  # no model: only save's file handling runs
    rank.rank, rank.engine, rank.steps, rank.frozen = 0, Engine(), 3, False
    rank.save(path, write)
"""


def _kill_mid_write(mode: str, path: str, marker_glob: str) -> None:
    """Run the child until its marker appears under ``marker_glob``, then SIGKILL it."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, mode, path, "marker"], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": ROOT})
    try:
        deadline = time.monotonic() + 180
        while not glob.glob(os.path.join(marker_glob, "marker")):
            assert child.poll() is None, f"the child exited ({child.returncode}) before writing its marker"
            assert time.monotonic() < deadline, "the child never started writing"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.parametrize("mode,target,leftover", [
    ("atomic_directory", "step_7", "step_7.tmp-*"),  # a new step
    ("atomic_directory", "step_4", "step_4.tmp-*"),  # the same path again (as final_model is)
    ("deepspeed_shards", "step_7", "step_7.tmp"),  # killed while the ranks write their shards
    ("deepspeed_staging", "step_7", "step_7.tmp-*"),  # killed after the shards moved in, before the rename
])
def test_a_checkpoint_killed_mid_write_leaves_the_previous_one(tmp_path, mode, target, leftover):
    """SIGKILL while a checkpoint is half on disk: the previous checkpoint at ``step_4`` is
    byte for byte as it was, the half-written one exists only under a temporary name (which
    holds train_state.json and deepspeed/ where the kill came late: only its name tells it
    apart), and ``latest_checkpoint`` returns ``step_4``."""
    checkpoints = str(tmp_path / "checkpoints")
    _complete(checkpoints, "step_2", 2)
    previous = _complete(checkpoints, "step_4", 4)
    before = _contents(previous)
    _kill_mid_write(mode, os.path.join(checkpoints, target), os.path.join(checkpoints, leftover))
    assert _contents(previous) == before
    assert glob.glob(os.path.join(checkpoints, leftover))  # the kill came mid-write
    if target != "step_4":
        assert not os.path.exists(os.path.join(checkpoints, target))
    assert latest_checkpoint(checkpoints) == previous
    assert [step for step, _ in step_checkpoints(checkpoints)] == [2, 4]


def test_latest_checkpoint_is_the_highest_complete_step_by_number(tmp_path):
    """step_10 over step_9 and step_2 (not the lexical order); a directory without
    train_state.json or deepspeed/, or not named exactly step_N, is skipped."""
    d = str(tmp_path)
    assert latest_checkpoint(os.path.join(d, "missing")) is None
    assert latest_checkpoint(d) is None
    for step in (2, 9, 10):
        _complete(d, f"step_{step}", step)
    assert latest_checkpoint(d) == os.path.join(d, "step_10")
    for name in ("step_11.tmp", "step_12.tmp-abc", "step_13.old-xyz", "step_14.reference.tmp", "final_model",
                 "step_x", "Step_15", "step_16_"):
        _complete(d, name, 99)
    os.makedirs(os.path.join(d, "step_20", "deepspeed"))  # no train_state.json
    os.makedirs(os.path.join(d, "step_21"))
    open(os.path.join(d, "step_21", "train_state.json"), "w").close()  # no deepspeed/
    open(os.path.join(d, "step_22"), "w").close()  # a file
    assert latest_checkpoint(d) == os.path.join(d, "step_10")
    assert step_checkpoints(d) == [(s, os.path.join(d, f"step_{s}")) for s in (2, 9, 10)]


@pytest.mark.parametrize("keep,left", [(0, [1, 2, 3, 10, 11]), (1, [11]), (2, [10, 11]), (5, [1, 2, 3, 10, 11]),
                                       (9, [1, 2, 3, 10, 11])])
def test_prune_keeps_the_newest_complete_checkpoints(tmp_path, keep, left):
    """``keep`` newest by step number stay (0: all); leftovers and incomplete directories are
    never touched; what was removed is returned, and no ``.old-`` directory stays behind."""
    d = str(tmp_path)
    for step in (1, 2, 3, 10, 11):
        _complete(d, f"step_{step}", step)
    others = ["step_12.tmp", "step_4.tmp-abc", "final_model", "step_20"]
    for name in others[:-1]:
        _complete(d, name, 0)
    os.makedirs(os.path.join(d, "step_20", "deepspeed"))  # incomplete: no train_state.json
    removed = prune_checkpoints(d, keep, os.path.join(d, "step_11"))
    assert [s for s, _ in step_checkpoints(d)] == left
    assert sorted(removed) == sorted(os.path.join(d, f"step_{s}") for s in {1, 2, 3, 10, 11} - set(left))
    assert sorted(os.listdir(d)) == sorted([f"step_{s}" for s in left] + others)


def test_prune_never_removes_the_checkpoint_just_written(tmp_path):
    """A run resumed from an older checkpoint writes a step below those already there: it
    stays, and the newest ``keep`` stay too."""
    d = str(tmp_path)
    for step in (5, 10, 20, 30):
        _complete(d, f"step_{step}", step)
    written = _complete(d, "step_12", 12)
    assert prune_checkpoints(d, 2, written) == [os.path.join(d, "step_5"), os.path.join(d, "step_10")]
    assert [s for s, _ in step_checkpoints(d)] == [12, 20, 30]


@pytest.mark.filterwarnings("ignore::UserWarning:peft")  # PEFT's notes on wrapping a tied head: wanted here
@pytest.mark.parametrize("peft", [dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
                                  dict(target_modules=["q_proj", "lm_head"]),
                                  dict(target_modules=["q_proj", "embed_tokens"])])
def test_a_peft_models_every_weight_comes_back(tiny_model_path, tmp_path, peft):
    """``save_model_weights`` of a PEFT-wrapped model writes every weight (PEFT's ``save_pretrained`` writes the
    adapters alone), a tensor under two names once, even where PEFT wrapped the tied head (its names then end
    otherwise than ``lm_head.weight``): a wrapper built with other adapters loads it back equal, name for name.
    A directory of adapters alone (an older checkpoint) is refused by name."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from primitives.io.checkpoint import load_model_weights, save_model_weights

    def wrapped(seed):
        torch.manual_seed(seed)
        return get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(r=4, **peft))

    saved, loaded = wrapped(0), wrapped(1)
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # adapters (B starts at 0) and base alike
    save_model_weights(saved, str(tmp_path / "m"))
    load_model_weights(loaded, str(tmp_path / "m"))
    expected = saved.state_dict()
    assert expected.keys() == loaded.state_dict().keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    saved.save_pretrained(str(tmp_path / "adapters"))
    with pytest.raises(ValueError, match=r"holds adapters alone .* cannot be resumed from"):
        load_model_weights(loaded, str(tmp_path / "adapters"))
