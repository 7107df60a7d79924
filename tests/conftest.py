"""Shared fixtures: the embedded tiny tokenizer and a randomly initialised tiny Qwen2."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("TQDM_DISABLE", "1")
# Ray reads this when imported: a local Ray then binds 127.0.0.1 (tests stay on loopback)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def tokenizer():
    from primitives.tiny import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    from primitives.tiny import TinyModelSpec, build_tiny_model

    model = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2),
                             seed=1)
    model.eval()
    return model
