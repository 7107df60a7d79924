"""``docs/seeds.md`` is true of the code: every function or class name its tables give in the seed
column imports from ``rl_primitives`` (or ``rl_primitives.utilities``), except the functions a
reader writes (hooks) and Python's own; every dotted name of ours it gives (``primitives.maths.kl
.per_token_kl``) resolves. A name the page promises and the package lacks fails here."""
import importlib
import os
import re

import pytest

import rl_primitives
import rl_primitives.utilities

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "seeds.md")

# names in the seed column that are not the package's to give, each for its reason
READERS_OWN = {
    # hooks the reader writes and passes in
    "reward_fn", "aggregate_fn", "checkpoint_fn", "eval_fn", "iteration_hook", "logger", "prompt_loader",
    "pair_selector", "get_config", "fn",
    # the seeds' own helper functions, refused by their signatures when passed (seeds README 2, 9)
    "ema_update", "truncated_kl", "adaptive_kl", "reward_history",
    # Python's, and methods of records the package does give
    "eval", "len", "exp", "_replace", "add_message",
}


def table_rows() -> list:
    with open(PAGE) as f:
        return [line for line in f if line.startswith("| ") and not line.startswith("| seed name")
                and not line.startswith("|---")]


def seed_names() -> set:
    names = set()
    for row in table_rows():
        for code in re.findall(r"`([^`]+)`", row.split("|")[1]):
            names.update(m.group(1) for m in re.finditer(r"(?<![.\w])([A-Za-z_]\w*)\s*\(", code))
            if re.fullmatch(r"[A-Za-z_]\w*", code.strip()):
                names.add(code.strip())
    return names


def our_dotted_names() -> set:
    out = set()
    for row in table_rows():
        for code in re.findall(r"`([^`]+)`", "|".join(row.split("|")[2:])):
            out.update(re.findall(r"\b((?:primitives|cluster|rl_primitives)(?:\.\w+)+)", code))
    return out


def test_the_page_has_tables_to_check():
    assert len(table_rows()) > 40 and len(seed_names()) > 40 and len(our_dotted_names()) > 10


@pytest.mark.parametrize("name", sorted(seed_names() - READERS_OWN))
def test_each_seed_name_on_the_page_imports_from_rl_primitives(name):
    assert hasattr(rl_primitives, name) or hasattr(rl_primitives.utilities, name), \
        f"docs/seeds.md lists the seeds' {name!r}; rl_primitives has no such name"


@pytest.mark.parametrize("dotted", sorted(our_dotted_names()))
def test_each_of_our_names_on_the_page_resolves(dotted):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), f"docs/seeds.md names {dotted}; {'.'.join(parts[:cut])} has no {attr}"
            obj = getattr(obj, attr)
        return
    raise AssertionError(f"docs/seeds.md names {dotted}, which does not import")


def test_everything_rl_primitives_exports_exists():
    assert all(hasattr(rl_primitives, name) for name in rl_primitives.__all__)
    assert {"generate", "weighted_sum_aggregator", "create_rollout"} <= set(rl_primitives.__all__)
