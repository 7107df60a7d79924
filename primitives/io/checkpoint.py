"""Atomic checkpoints: HF-format model, optimizer, ``TrainState`` and every RNG state.

A checkpoint is written into a temporary sibling directory and renamed into place, so
a crash leaves either the previous checkpoint or the new one, never half of one. A run's
``step_N`` checkpoints are found (``latest_checkpoint``) and kept bounded
(``prune_checkpoints``) by their names and contents alone, so leftovers of a killed write
(``step_N.tmp``, ``step_N.tmp-*``, ``step_N.old-*``) are never taken for a checkpoint.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from typing import Callable, Optional

import numpy as np
import torch

from primitives.files import atomic_directory, atomic_file  # noqa: F401  (this module's names too)
from primitives.types import DataPosition, TrainState


def capture_rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def state_to_json(state: TrainState) -> dict:
    d = state._asdict()
    d["data_position"] = state.data_position._asdict()
    d["metrics_history"] = list(state.metrics_history)
    return d


def state_from_json(d: dict) -> TrainState:
    d = dict(d)
    d["data_position"] = DataPosition(**d["data_position"])
    d["metrics_history"] = tuple(d.get("metrics_history", ()))
    return TrainState(**d)


def save_checkpoint(path: str, model, tokenizer=None, optimizer=None, state: Optional[TrainState] = None,
                    extra: Optional[dict] = None, also: Optional[Callable[[str], None]] = None) -> str:
    """Write ``model`` (HF ``save_pretrained``), tokenizer, optimizer, state and RNG atomically;
    ``also(directory)`` writes more into the same directory before it is renamed into place."""

    def write(tmp: str) -> None:
        save_model_weights(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        torch.save(capture_rng_state(), os.path.join(tmp, "rng.pt"))
        with open(os.path.join(tmp, "train_state.json"), "w") as f:
            json.dump({"state": state_to_json(state) if state is not None else None, "extra": extra or {}}, f)
        if also is not None:
            also(tmp)

    return atomic_directory(path, write)


def load_checkpoint(path: str, model=None, optimizer=None, restore_rng: bool = True):
    """Load into ``model``/``optimizer`` in place (if given); returns ``(TrainState | None, extra)``."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    meta_path = os.path.join(path, "train_state.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no train_state.json)")
    if model is not None:
        load_model_weights(model, path)
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=False))
    if restore_rng:
        restore_rng_state(torch.load(os.path.join(path, "rng.pt"), weights_only=False))
    with open(meta_path) as f:
        meta = json.load(f)
    state = state_from_json(meta["state"]) if meta["state"] is not None else None
    return state, meta.get("extra", {})


WEIGHTS = "model.safetensors"  # a model's every weight, in a directory save_model_weights wrote
TRACKING_STATE = "reference_state.safetensors"  # beside a saved reference that tracks the policy


def save_model_weights(model, directory: str) -> None:
    """``model.save_pretrained(directory)``; for a PEFT-wrapped model, whose ``save_pretrained`` writes its
    adapters alone (a model cannot be rebuilt from them without its base), also every weight under the
    wrapper's own names in ``WEIGHTS``: a tensor held under two names (a head tied to the embeddings, wrapped
    by PEFT or not) once, the other name recorded as its alias (``load_model_weights`` reads both)."""
    model.save_pretrained(directory)
    if hasattr(model, "peft_config"):
        from safetensors.torch import save_file

        weights: dict = {}
        aliases: dict = {}  # a name -> the name its tensor was written under
        first: dict = {}  # a tensor's (address, shape, strides) -> the first name it had
        for name, tensor in model.state_dict().items():
            key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
            if tensor.numel() and key in first:
                aliases[name] = first[key]
                continue
            first[key] = name
            weights[name] = tensor.detach().cpu().contiguous()
        save_file(weights, os.path.join(directory, WEIGHTS), metadata={"aliases": json.dumps(aliases)})


def load_model_weights(model, directory: str) -> None:
    """Load what ``save_model_weights`` (or an HF ``save_pretrained``) wrote in ``directory`` into ``model``
    in place; a weight missing or left over is an error naming ``directory`` (but a tied head)."""
    from safetensors import safe_open

    weights = os.path.join(directory, WEIGHTS)
    if os.path.isfile(weights):
        with safe_open(weights, "pt") as f:
            sd = {k: f.get_tensor(k) for k in f.keys()}
            aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
        sd.update({name: sd[kept] for name, kept in aliases.items()})
    elif os.path.isfile(os.path.join(directory, "adapter_config.json")):
        raise ValueError(f"checkpoint {directory} holds adapters alone (PEFT's save_pretrained), without the "
                         f"weights under them: it cannot be resumed from; a checkpoint saved by this version holds "
                         f"{WEIGHTS} too")
    else:
        sd = type(model).from_pretrained(directory).state_dict()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
    if missing or unexpected:
        raise ValueError(f"checkpoint {directory} does not fit the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")


def save_tracking_state(directory: str, model, weights: dict, last_reset_step: int) -> None:
    """Beside a saved reference ``model`` that tracks the policy (an update function moves it), its update
    state: the step of its last reset, and its float32 ``weights`` where the model holds them narrower (bf16:
    ``primitives.maths.kl.ref_state_from_model``), which the saved model has only rounded."""
    from safetensors.torch import save_file

    params = dict(model.named_parameters())
    wider = {k: v.detach().cpu().contiguous() for k, v in weights.items() if k in params and v.dtype != params[k].dtype}
    save_file(wider, os.path.join(directory, TRACKING_STATE), metadata={"last_reset_step": str(last_reset_step)})


def load_tracking_state(directory: str, device) -> Optional[tuple]:
    """``(wider weights on device, last reset step)`` that ``save_tracking_state`` wrote in ``directory``; None
    where it wrote none (a reference that started tracking from its weights)."""
    from safetensors import safe_open

    file = os.path.join(directory, TRACKING_STATE)
    if not os.path.isfile(file):
        return None
    with safe_open(file, "pt") as f:
        return {k: f.get_tensor(k).to(device) for k in f.keys()}, int((f.metadata() or {}).get("last_reset_step", 0))


STEP_DIR = re.compile(r"step_(\d+)")  # the name of a step checkpoint, exactly


def is_cluster_checkpoint(path: str) -> bool:
    """Whether ``path`` holds a finished cluster checkpoint: ``train_state.json`` and ``deepspeed/``
    (what the trainer ranks write last, inside the atomic rename)."""
    return os.path.isfile(os.path.join(path, "train_state.json")) and os.path.isdir(os.path.join(path, "deepspeed"))


def step_checkpoints(directory: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint named exactly ``step_N`` in ``directory``,
    by step (numeric: step_10 after step_9); [] when there is no such directory."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = STEP_DIR.fullmatch(name)
        path = os.path.join(directory, name)
        if match and is_cluster_checkpoint(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(directory: str) -> Optional[str]:
    """The path of the newest complete ``step_N`` checkpoint in ``directory`` (a run's
    ``<out>/checkpoints``), or None when there is none: what ``checkpoint.resume auto``
    continues from."""
    found = step_checkpoints(directory)
    return found[-1][1] if found else None


def prune_checkpoints(directory: str, keep: int, written: str) -> list[str]:
    """Remove the complete ``step_N`` checkpoints of ``directory`` older than the newest
    ``keep`` (0: keep all), never ``written`` (the one just saved, wherever its step falls);
    returns the paths removed. Each is first renamed to a ``.old-`` sibling, so a kill during
    the removal leaves a leftover that no reader takes for a checkpoint."""
    if keep <= 0:
        return []
    written = os.path.abspath(written)
    removed = []
    for _, path in step_checkpoints(directory)[:-keep]:
        if os.path.abspath(path) == written:
            continue
        old = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old-", dir=directory)
        os.rename(path, os.path.join(old, "ckpt"))
        shutil.rmtree(old)
        removed.append(path)
    return removed
