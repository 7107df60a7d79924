"""benchmarks/bench_tied_gradient.py on the tiny model (tied, as SmolLM2) in a subprocess: both modes train and
the figures print; a model whose pair cannot be folded is refused by name before any round."""
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT


def _bench(*args):
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "benchmarks/bench_tied_gradient.py", "--model", "tiny", "--prompts", "2",
                           "--group", "2", "--max-new-tokens", "4", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.no_ray
def test_bench_tied_gradient_runs_on_the_tiny_model():
    proc = _bench("--repeats", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert re.search(r"^tiny, 4 rollouts, micro-batches of 16, 1 threads, 1 rounds, heap kept as an actor keeps it$",
                     lines[-5]), lines[-5]
    figures = r"\| \d+\.\d{3} +\| \d\.\d{3} +\| \d+\.\d{3} +\| [a-z_A-Z]+ \d\.\d{3}"  # s, ratio, (V, H) ops
    for line, name in ((lines[-2], "as PyTorch makes it"), (lines[-1], "folded")):
        assert re.search(rf"^\| {name} +" + figures, line), line
    assert "| 1.000 " in lines[-2]


@pytest.mark.no_ray
def test_bench_tied_gradient_refuses_an_untied_model(tmp_path, monkeypatch):
    """Before any trainer is built (in this process: the refusal comes first)."""
    from primitives.fixtures.tiny import TinyModelSpec, build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_tied_gradient

    monkeypatch.setattr(bench_tied_gradient, "trainer_rank", None)  # called, it would fail otherwise
    with pytest.raises(SystemExit, match=f"{tmp_path}: its embedding and head are not a tied pair this folds"):
        bench_tied_gradient.main(["--model", str(tmp_path), "--default-heap"])
