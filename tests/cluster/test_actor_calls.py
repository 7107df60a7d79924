"""Every actor method the cluster side calls by name (``call``, ``call_split``, ``fan_out``,
``fan_out_each`` in ``cluster/``) exists on an actor class and takes the arguments given: a wrong
name or a wrong argument count fails here, in the fast tier, not deep in a Ray run. The method
names are strings because Ray dispatches them; this test is the table a type checker would be."""
import ast
import inspect
import os

import pytest

from rl_actors.critic import CriticWorker
from rl_actors.generator import GeneratorWorker
from rl_actors.reference import RefLogprobWorker
from rl_actors.reward import RewardWorker
from rl_actors.trainer import TrainerWorker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ACTORS = (TrainerWorker, GeneratorWorker, RewardWorker, RefLogprobWorker, CriticWorker)
METHOD_ARG = {"call": 2, "call_split": 2, "fan_out": 1, "fan_out_each": 1}  # where the method name is


def actor_calls() -> list:
    """``(file:line, method, positional arguments after it or None when starred/per-rank)``."""
    out = []
    for folder, _, files in os.walk(os.path.join(ROOT, "cluster")):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if not isinstance(node, ast.Call):
                    continue
                fn = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                at = METHOD_ARG.get(fn)
                if at is None or len(node.args) <= at:
                    continue
                method = node.args[at]
                if not (isinstance(method, ast.Constant) and isinstance(method.value, str)):
                    continue
                rest = node.args[at + 1:]
                count = None if fn == "fan_out_each" or any(isinstance(a, ast.Starred) for a in rest) else len(rest)
                out.append((f"{os.path.relpath(path, ROOT)}:{node.lineno}", method.value, count,
                            sorted(k.arg for k in node.keywords if k.arg)))
    return out


CALLS = actor_calls()


def takes(method: str, count, keywords) -> list:
    """The actor classes whose ``method`` accepts ``count`` positional arguments and ``keywords``."""
    fits = []
    for cls in ACTORS:
        fn = getattr(cls, method, None)
        if not callable(fn):
            continue
        if count is None:
            fits.append(cls)
            continue
        try:
            inspect.signature(fn).bind(None, *([None] * count), **{k: None for k in keywords})
            fits.append(cls)
        except TypeError:
            pass
    return fits


@pytest.mark.parametrize("where,method,count,keywords", CALLS, ids=[f"{c[0]}:{c[1]}" for c in CALLS])
def test_each_method_called_by_name_exists_and_takes_its_arguments(where, method, count, keywords):
    assert takes(method, count, keywords), (f"{where}: no actor class has {method}() taking {count} positional "
                                            f"arguments and {keywords}")


def test_the_table_is_read_and_catches_a_wrong_name_or_count():
    called = {c[1] for c in CALLS}
    assert len(CALLS) >= 40 and {"train_planned", "send_weights", "receive_weights", "score_summarized"} <= called
    assert not takes("train_planed", 5, [])  # a misspelt name
    assert takes("send_weights", 2, []) and not takes("send_weights", 3, [])  # (meta, bucket_bytes)
