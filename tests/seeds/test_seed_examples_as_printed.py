"""The seeds' six worked examples (``../shared/seeds/002_*.txt``) run as printed: the test reads the
file, takes each example's ``python`` block and executes it statement by statement, in one namespace
for the whole document as a reader's notebook would (Example 2 uses Example 1's ``initial_state``,
``load_prompts`` and ``gen_config``). Only what cannot run here is substituted, each substitution
counted: the model path (the embedded tiny model), the device and dtype (CPU, float32, no flash
attention), the iteration counts (2) and the token budgets (8). The namespace starts with
``from rl_primitives import *`` and the ``typing`` names the examples use without importing.

Each example either completes or stops at its first wrong line with the error that names the
supported form (``EXPECTED``). The seeds' ``GenerationConfig`` samples one completion per prompt;
GRPO refuses that before generating, so the document as printed stops there in every example that
trains. A second pass applies the remedy that refusal names (``num_return_sequences=2``) and
nothing else, and checks where each example then stops. docs/seeds.md gives the counts."""
import ast
import glob
import os
import re
import traceback
from typing import NamedTuple, Optional

import pytest
import torch

from primitives.env.rewards import RewardError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEEDS = os.path.join(os.path.dirname(ROOT), "shared", "seeds")
DOCUMENT = next(iter(sorted(glob.glob(os.path.join(SEEDS, "002_*.txt")))), None)

PRELUDE = "from rl_primitives import *\nfrom typing import Any, Callable, Dict, List, Optional, Tuple\n"

# (text as printed, replacement, how many times it occurs in the whole document)
SUBSTITUTIONS = [
    ('"meta-llama/Llama-3-8B"', "MODEL_PATH", 3),  # the model path: the embedded tiny model
    ("torch.bfloat16", "torch.float32", 3),  # dtype: this CPU
    ('device_map="cuda"', 'device_map="cpu"', 3),  # device
    ("use_flash_attention_2=True", "", 1),  # a CUDA kernel
    ("num_iterations=50", "num_iterations=2", 1),  # iteration counts
    ("num_iterations=100", "num_iterations=2", 4),
    ("for iteration in range(50):", "for iteration in range(2):", 1),
    ("max_new_tokens=256", "max_new_tokens=8", 2),  # token budgets
    ("max_new_tokens=384", "max_new_tokens=8", 1),
]
# the remedy the one-completion refusal names, applied in the second pass: two completions per prompt in
# Example 1's config (which Examples 2, 3 and 5 reuse) and in Example 6's own
REMEDIES = [("    do_sample=True\n)", "    do_sample=True, num_return_sequences=2\n)", 1),
            ("        do_sample=True\n    )", "        do_sample=True, num_return_sequences=2\n    )", 1)]


class Stop(NamedTuple):
    """Where an example stops: the first line of the statement that raised, the error's type and a
    piece of its message."""
    line: str
    error: type
    message: str


N_REFUSAL = Stop("final_state = train(", ValueError,
                 "algorithm 'grpo' compares completions of the same prompt and needs at least 2 per prompt; the run "
                 "samples 1 (GenerationConfig.n, the seeds' num_return_sequences")
# Example 4's hand loop makes each rollout alone: all answer "prompt 0", so the first seed line that
# needs groups (compute_grpo_advantages) finds one uid twice; its loss (README 1) is refused after that
FIRST_TOOL_STOP = Stop("for iteration in range(2):", ValueError,
                       "two rollouts have uid e0/i0/s0: rollouts of different prompts made one at a time all get index "
                       "0 (one group); make them with create_batch_rollouts")
# Example 5 redefines create_ref_update_fn as the seeds' (ref, policy) lambda; train checks its hooks first
REF_UPDATE_STOP = Stop("final_state = train(", ValueError,
                       "ref_model_update_fn __main__.create_ref_update_fn.<locals>.<lambda>(ref, policy): a reference "
                       "update here is ref_update_fn(ref_state, policy_weights, step, kl) -> ref_state")
# what each example does as printed (pass 1) and with the remedy (pass 2); None: it completes
EXPECTED = {
    1: (N_REFUSAL, None),
    2: (N_REFUSAL, Stop("final_state = train(", RewardError, "reward function final_reward_fn raised on rollout "
                                                             "e0/i0/s0: ValueError: Rollout._replace(reward_metadata"
                                                             "=...): not fields here")),
    3: (Stop("final_state = train_with_algorithm_switching(", ValueError,
             "training_iteration: algorithm 'grpo' compares completions of the same prompt"), None),
    4: (FIRST_TOOL_STOP, FIRST_TOOL_STOP),
    5: (REF_UPDATE_STOP, REF_UPDATE_STOP),
    6: (Stop('if __name__ == "__main__":', ValueError, "training_step: algorithm 'grpo' compares completions"),
        None),
}


def example_blocks(text: str) -> dict:
    """``{number: code}``: the first ``python`` block under each ``## Example N`` heading."""
    blocks = {}
    for m in re.finditer(r"^## Example (\d+)\b.*?^```python\n(.*?)^```", text, re.S | re.M):
        blocks[int(m.group(1))] = m.group(2)
    return blocks


def substituted(text: str, remedy: bool) -> str:
    for old, new, count in SUBSTITUTIONS + (REMEDIES if remedy else []):
        assert text.count(old) == count, f"{old!r} occurs {text.count(old)} times in {DOCUMENT}, not {count}"
        text = text.replace(old, new)
    return text


def run_block(code: str, namespace: dict) -> Optional[tuple]:
    """Executes ``code`` statement by statement in ``namespace``: None when it completes, else
    ``(first line of the statement that raised, the exception)``."""
    tree = ast.parse(code)
    lines = code.splitlines()
    for stmt in tree.body:
        try:
            exec(compile(ast.Module([stmt], type_ignores=[]), "<seeds/002>", "exec"), namespace)  # noqa: S102
        except Exception as e:  # noqa: BLE001 - the stop is the result
            return lines[stmt.lineno - 1].strip(), e
    return None


def run_document(model_path: str, remedy: bool) -> tuple:
    """``({example: None or (line, exception)}, namespace)``, the examples in order in one namespace."""
    with open(DOCUMENT) as f:
        blocks = example_blocks(substituted(f.read(), remedy))
    assert sorted(blocks) == [1, 2, 3, 4, 5, 6], f"{DOCUMENT}: examples {sorted(blocks)}"
    namespace = {"__name__": "__main__", "MODEL_PATH": model_path}
    exec(PRELUDE, namespace)  # noqa: S102
    outcomes = {}
    for number, code in blocks.items():
        torch.manual_seed(number)
        outcomes[number] = run_block(code, namespace)
    return outcomes, namespace


@pytest.fixture(scope="module")
def wandb_offline(tmp_path_factory):
    """Example 6 logs to W&B: offline, into a temporary directory; its checkpoints go there too."""
    out = tmp_path_factory.mktemp("seed_examples")
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_DIR", "WANDB_SILENT")}
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(out), WANDB_SILENT="true")
    import wandb

    wandb.teardown()  # W&B reads the environment once per process setup: another test may have set it up
    cwd = os.getcwd()
    os.chdir(out)
    yield out
    os.chdir(cwd)
    wandb.teardown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def no_wandb_run_left():
    """A pass that stops inside Example 6 leaves its W&B run open: close it for what follows."""
    yield
    import wandb

    if wandb.run is not None:
        wandb.finish()


def check(outcomes: dict, which: int) -> list:
    """The differences between ``outcomes`` and ``EXPECTED`` (pass ``which``), for one assertion."""
    problems = []
    for number, outcome in outcomes.items():
        want = EXPECTED[number][which]
        if want is None and outcome is not None:
            line, e = outcome
            problems.append(f"Example {number} stopped at {line!r}: "
                            + "".join(traceback.format_exception_only(type(e), e)).strip())
        elif want is not None:
            if outcome is None:
                problems.append(f"Example {number} completed; expected to stop at {want.line!r}")
                continue
            line, e = outcome
            if not (line.startswith(want.line) and isinstance(e, want.error) and want.message in str(e)):
                problems.append(f"Example {number} stopped at {line!r} with {type(e).__name__}: {e}; expected "
                                f"{want.error.__name__} at {want.line!r} containing {want.message!r}")
    return problems


@pytest.mark.skipif(DOCUMENT is None, reason=f"the seeds' worked examples are not at {SEEDS}")
@pytest.mark.parametrize("remedy", [False, True], ids=["as_printed", "with_n_2"])
def test_the_worked_examples_run_or_stop_where_expected(tiny_model_path, wandb_offline, capsys, remedy):
    outcomes, namespace = run_document(tiny_model_path, remedy)
    problems = check(outcomes, int(remedy))
    assert not problems, "\n".join(problems)
    out = capsys.readouterr().out
    if not remedy:  # nothing trained: every refusal came before the first update
        assert "[Iter" not in out and not os.path.exists(wandb_offline / "checkpoints")
        return
    # what the completed examples printed and wrote: Example 1's and 3's two iterations, Example 6's two
    # (its adaptive config, EMA reference, W&B offline run, and its checkpoints: after the first iteration,
    # iter_1, and the final one, iter_2)
    assert "Training complete! Final iteration: 2" in out and "=== Switching to GRPO at iteration 0 ===" in out
    assert out.count("[Iter   1]") == 1 and out.count("[Iter   2]") == 1  # Example 6's own logger
    assert "Training complete!\nFinal iteration: 2\nTotal steps: 2" in out
    final = namespace["final_state"]  # Example 6's
    assert (final.iteration, final.global_step, len(final.stats_history)) == (2, 2, 2)
    assert sorted(os.listdir(wandb_offline / "checkpoints")) == ["iter_1", "iter_2"]
    assert glob.glob(str(wandb_offline / "wandb" / "offline-run-*"))
