"""Atomic checkpoints with RNG state; loggers; curves."""
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from primitives.fixtures.tiny import save_tiny_model
from primitives.io.checkpoint import atomic_directory, load_checkpoint, save_checkpoint
from primitives.io.loggers import (
    console_logger,
    curves_figure,
    jsonl_logger,
    multi_logger,
    noop_logger,
    plot_curves,
    read_jsonl_metrics,
    wandb_logger,
)
from primitives.types import DataPosition, TrainState


def test_checkpoint_round_trip_restores_weights_optimizer_state_and_rng(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    base = save_tiny_model(str(tmp_path / "base"))
    model = AutoModelForCausalLM.from_pretrained(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    state = TrainState(iteration=7, global_step=7, policy_version=7, data_position=DataPosition(1, 12),
                       rng_seed=3, metrics_history=({"step": 6, "reward/mean": 0.5},))
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    path = save_checkpoint(str(tmp_path / "ckpt"), model, tokenizer, opt, state, extra={"note": "x"})
    expected_draws = (random.random(), np.random.rand(), torch.rand(1).item())

    fresh = AutoModelForCausalLM.from_pretrained(base)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    loaded, extra = load_checkpoint(path, fresh, fresh_opt)
    assert loaded == state and extra == {"note": "x"}
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected_draws
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    # the HF part reloads by path on its own
    assert AutoModelForCausalLM.from_pretrained(path) is not None


def test_failed_save_leaves_previous_checkpoint_intact(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(str(tmp_path / "base")))
    path = save_checkpoint(str(tmp_path / "ckpt"), model, state=TrainState(iteration=1))

    class Boom:
        def state_dict(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(path, model, optimizer=Boom(), state=TrainState(iteration=2))
    assert load_checkpoint(path, restore_rng=False)[0].iteration == 1
    assert sorted(os.listdir(tmp_path)) == ["base", "ckpt"]  # no temp directory left behind
    save_checkpoint(path, model, state=TrainState(iteration=3))
    assert load_checkpoint(path, restore_rng=False)[0].iteration == 3
    with pytest.raises(FileNotFoundError, match="no train_state.json"):
        load_checkpoint(str(tmp_path / "base"))


def test_loggers(tmp_path):
    path = str(tmp_path / "m" / "metrics.jsonl")
    lines = []
    log = multi_logger(jsonl_logger(path), console_logger(["reward/mean"], write=lines.append), noop_logger)
    for step in range(3):
        log({"step": step, "reward/mean": step / 2, "loss/policy": 1.0})
    assert read_jsonl_metrics(path)[2] == {"step": 2, "reward/mean": 1.0, "loss/policy": 1.0}
    assert lines == ["step 0 reward/mean=0", "step 1 reward/mean=0.5", "step 2 reward/mean=1"]
    png = plot_curves(read_jsonl_metrics(path), ["reward/mean", "loss/policy", "absent"], str(tmp_path / "c.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="none of the keys"):
        plot_curves(read_jsonl_metrics(path), ["absent"], str(tmp_path / "d.png"))


# what matplotlib writes widest at the panels' edges: long negative tick labels, a scale (offset text) above or
# below the axis, big step numbers under it, a long panel title, a flat line, a missing value
WIDE = {"mismatch/max_abs_logp_diff": [-0.000123, 0.000456, -0.000789], "tiny": [1.5e-9, -2.5e-9, 3.25e-9],
        "huge": [-123456789.5, 987654321.25, 5.5e8], "offset": [1000000.001, 1000000.002, 1000000.004],
        "flat": [0.5, 0.5, 0.5], "gap": [1.0, float("nan"), -1.0], "loss/sft": [4.5, 0.25, 0.125]}


@pytest.mark.parametrize("keys", [list(WIDE), ["huge"], ["tiny", "offset"]], ids=["7 panels", "1", "2"])
def test_the_curves_panels_leave_room_for_what_they_draw(keys):
    """The fixed layout (no ``tight_layout``): each panel's drawing - ticks, tick labels, offset text,
    title, x label - lies inside the figure and apart from every other panel's and the figure's title."""
    history = [{"step": 99990 + i, **{k: WIDE[k][i] for k in keys}} for i in range(3)]
    fig = curves_figure(history, keys, title="a title as long as the job's: grpo on Ray (smollm2-135m-instruct)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # what savefig draws a PNG with
    canvas.draw()
    renderer = canvas.get_renderer()
    page = fig.bbox
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes if ax.axison]
    assert len(boxes) == len(keys)
    (title,) = [text.get_window_extent(renderer) for text in fig.texts]  # the figure's one text: its title
    for i, box in enumerate(boxes):
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, (keys[i], box)
        assert not box.overlaps(title), keys[i]
        for j, other in enumerate(boxes[:i]):
            assert not box.overlaps(other), (keys[i], keys[j])
    assert page.x0 <= title.x0 and title.x1 <= page.x1 and title.y1 <= page.y1


def test_wandb_offline_without_api_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    log = wandb_logger("rayrl-test", config={"a": 1}, directory=str(tmp_path))
    log({"step": 0, "reward/mean": 0.25})
    log.finish()
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run")]
    assert len(runs) == 1


def _tree(path) -> dict:
    """{relative file path: content} under ``path``."""
    return {os.path.relpath(os.path.join(d, f), path): Path(d, f).read_text()
            for d, _, files in os.walk(path) for f in files}


def test_atomic_directory_failed_write_leaves_old_checkpoint_and_no_temporaries(tmp_path):
    path = tmp_path / "ckpt"
    (path / "sub").mkdir(parents=True)
    (path / "weights.txt").write_text("old weights")
    (path / "sub" / "state.json").write_text('{"step": 1}')
    before = _tree(path)

    def write(staging):
        assert os.path.abspath(staging) != os.path.abspath(path)  # written elsewhere, renamed in
        assert not os.path.abspath(staging).startswith(os.path.abspath(path) + os.sep)
        with open(os.path.join(staging, "weights.txt"), "w") as f:
            f.write("half-written new weights")
        assert _tree(path) == before  # the old checkpoint is untouched while writing
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_directory(str(path), write)
    assert _tree(path) == before == {"weights.txt": "old weights", os.path.join("sub", "state.json"): '{"step": 1}'}
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no staging or backup directory left behind


def test_atomic_directory_success_replaces_exactly(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "old_only.txt").write_text("stale")
    staged = []

    def write(staging):
        staged.append(staging)
        assert os.path.abspath(staging) != os.path.abspath(path)
        with open(os.path.join(staging, "weights.txt"), "w") as f:
            f.write("new weights")

    assert atomic_directory(str(path), write) == str(path)
    assert _tree(path) == {"weights.txt": "new weights"}  # nothing of the old checkpoint survives
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and not os.path.exists(staged[0])
    atomic_directory(str(tmp_path / "fresh"), write)  # no previous checkpoint
    assert _tree(tmp_path / "fresh") == {"weights.txt": "new weights"}
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "fresh"]


def test_atomic_file_keeps_the_old_file_when_writing_fails(tmp_path):
    from primitives.io.checkpoint import atomic_file

    path = tmp_path / "samples.jsonl"
    atomic_file(str(path), lambda f: f.write("old\n"))

    def fails_halfway(f):
        f.write("new, half written")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_file(str(path), fails_halfway)
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["samples.jsonl"]
    atomic_file(str(path), lambda f: f.write("new\n"))
    assert path.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["samples.jsonl"]


def test_update_ema_metrics_hand_values():
    """momentum 0.9: 0.9 * 2.0 + 0.1 * 4.0 = 2.2; a key seen first takes its value; a key only in
    the average stays; a name is taken as it is; a NaN leaves the average alone; the input is not changed."""
    from primitives.io.loggers import update_ema_metrics

    ema = {"loss": 2.0, "old": 7.0, "reward": 0.5}
    out = update_ema_metrics({"loss": 4.0, "kl": 0.3, "algorithm": "dapo", "reward": float("nan")}, ema)
    assert out == {"loss": pytest.approx(2.2, abs=1e-12), "old": 7.0, "kl": 0.3, "algorithm": "dapo", "reward": 0.5}
    assert ema == {"loss": 2.0, "old": 7.0, "reward": 0.5}
    assert update_ema_metrics({"loss": 4.0}, {"loss": 2.0}, momentum=0.0) == {"loss": 4.0}
    import numpy as np
    import torch

    scalars = update_ema_metrics({"a": np.float32(4.0), "b": torch.tensor(4.0), "c": np.int64(4)},
                                 {"a": 2.0, "b": 2.0, "c": 2.0}, momentum=0.5)
    assert scalars == {"a": 3.0, "b": 3.0, "c": 3.0}  # numpy and 0-d tensor values are averaged too
    two = update_ema_metrics({"loss": 1.0}, update_ema_metrics({"loss": 3.0}, {}, 0.5), 0.5)
    assert two == {"loss": 2.0}
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\), got 1.0"):
        update_ema_metrics({}, {}, momentum=1.0)
