"""Data by reference: the loop holds summaries and positions (``Held``, ``BatchPlan``), and every
trainer rank rebuilds the step's batch from the chunks it receives. Hand-worked positions, the
batch built from any chunking equal to the batch of the rollouts themselves (a property over
random splits), summaries that hold no tokens, and the SFT loop's refusal of a hook it would
ignore."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.loop.protocol import Held, plan_parts
from cluster.loop.sft import SFTRun, train_sft
from cluster.loop.train import Hooks
from primitives.env.tools import ToolCall, ToolResult, tool_metrics
from primitives.maths.algorithms import dapo, grpo, online_dpo
from primitives.maths.batching import planned_batch, trainable_batch
from primitives.maths.filters import dynamic_sampling_filter, kept_indices
from primitives.maths.metrics import tool_metrics as summary_tool_metrics
from primitives.types import BatchPlan, Rollout, planned_rollouts, summarize


def rollout(group: int, sample: int, reward: float, length: int = 3, ref: bool = False) -> Rollout:
    rng = np.random.default_rng(100 * group + sample)
    return Rollout(uid=f"e0/i{group}/s{sample}", group=f"e0/i{group}", prompt="1+2=",
                   prompt_ids=np.array([1, 2 + group, 3], dtype=np.int64),
                   completion_ids=rng.integers(4, 9, size=length).astype(np.int64),
                   loss_mask=np.ones(length, dtype=np.float32),
                   logprobs=-rng.random(length).astype(np.float32),
                   ref_logprobs=-rng.random(length).astype(np.float32) if ref else None, reward=reward)


def test_plan_parts_numbers_chunks_in_first_seen_order():
    a, b = ("chunk a", None), ("chunk b", None)
    rows = [Held(None, b, 1), Held(None, a, 0), Held(None, b, 0), Held(None, a, 2)]
    positions, parts = plan_parts(rows)
    assert positions == ((0, 1), (1, 0), (0, 0), (1, 2)) and parts == [b, a]


def test_planned_rollouts_take_a_chunks_reference_arrays():
    chunk = [rollout(0, 0, 1.0), rollout(0, 1, 0.0)]
    arrays = [np.full(3, -0.5, dtype=np.float32), np.full(3, -0.25, dtype=np.float32)]
    out = planned_rollouts(BatchPlan(((0, 1), (1, 0)), pad_token_id=0), [(chunk, arrays), (chunk, None)])
    assert [r.uid for r in out] == ["e0/i0/s1", "e0/i0/s0"]
    assert out[0].ref_logprobs.tolist() == [-0.25] * 3 and out[1].ref_logprobs is None


def test_kept_indices_are_the_filters_choice_in_its_order():
    # group 0 ties (both 1.0): dynamic sampling drops it; groups 1 and 2 keep both members
    rollouts = [rollout(0, 0, 1.0), rollout(1, 0, 0.0), rollout(0, 1, 1.0), rollout(1, 1, 1.0),
                rollout(2, 0, 0.5), rollout(2, 1, 0.0)]
    assert kept_indices(rollouts, [dynamic_sampling_filter]) == [1, 3, 4, 5]
    assert kept_indices(rollouts, []) == [0, 1, 2, 3, 4, 5]


def test_a_summary_holds_no_tokens_and_the_tool_counts():
    r = rollout(3, 1, 0.5, length=200)
    tool_output = np.ones(200, dtype=r.loss_mask.dtype)
    tool_output[100:150] = 0  # 50 tokens of tool output: in the rollout, not in the loss
    r = r._replace(tool_calls=(ToolCall("calc", {}), ToolCall("calc", {})), loss_mask=tool_output,
                   tool_results=(ToolResult("1", "calc", "3"), ToolResult("2", "calc", "bad", is_error=True)))
    s = summarize(r)
    assert s.untrained_tokens == 50
    assert (s.uid, s.group, s.reward, s.num_tokens, s.has_ref) == ("e0/i3/s1", "e0/i3", 0.5, 200, False)
    assert len(pickle.dumps(s)) < 200 < len(pickle.dumps(r))  # no arrays: O(1) per rollout
    plain = rollout(0, 0, 1.0)
    assert summary_tool_metrics([s, summarize(plain)]) == tool_metrics([r, plain]) == {
        "tools/calls_per_rollout": 1.0, "tools/success_rate": 0.5, "tools/rollouts_with_calls": 0.5,
        "tools/untrained_tokens": 25.0}


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(1, 11), max_size=4, unique=True), seed=st.integers(0, 1000),
       with_ref=st.booleans())
def test_any_chunking_builds_the_batch_of_the_rollouts_themselves(cuts, seed, with_ref):
    """Rollouts split into chunks at any cuts (each chunk's reference logprobs as arrays beside
    it, or on the records) give, through a plan, the very batch of the list."""
    rng = np.random.default_rng(seed)
    rollouts = [rollout(g, s, float(rng.integers(0, 3)), length=int(rng.integers(1, 6)), ref=True)
                for g in range(3) for s in range(4)]
    bounds = [0, *sorted(cuts), len(rollouts)]
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        chunk = rollouts[lo:hi]
        parts.append(([r._replace(ref_logprobs=None) for r in chunk], [r.ref_logprobs for r in chunk]) if with_ref
                     else (chunk, None))
    rows = tuple((p, i) for p, (chunk, _) in enumerate(parts) for i in range(len(chunk)))
    algo = grpo(kl_coef=0.05)
    plan = BatchPlan(rows, pad_token_id=0, seed=seed, budget=5)
    ours, theirs = planned_batch(plan, parts, algo), trainable_batch(rollouts, algo, 0, seed=seed, budget=5)
    for field in ("input_ids", "attention_mask", "loss_mask", "behaviour_logprobs", "rewards", "advantages",
                  "ref_logprobs"):
        np.testing.assert_array_equal(getattr(ours, field), getattr(theirs, field), err_msg=field)


def test_a_tied_group_leaves_nothing_to_train():
    """DAPO's dynamic sampling keeps no tied group, and online DPO finds no pair in one: the
    plan's batch is None (the loop skips the update)."""
    tied = [rollout(0, 0, 1.0), rollout(0, 1, 1.0)]
    assert kept_indices(tied, dapo().filters) == []
    assert planned_batch(BatchPlan(((0, 0), (0, 1)), 0), [(tied, None)], online_dpo()) is None
    spread = [rollout(0, 0, 1.0), rollout(0, 1, 0.0)]  # and with a spread, both train
    assert planned_batch(BatchPlan(((0, 0), (0, 1)), 0), [(spread, None)], online_dpo()).size == 2


def test_train_sft_refuses_a_hook_it_would_ignore():
    with pytest.raises(ValueError, match="hooks.eval_fn would be ignored"):
        train_sft(None, ["a sample"], SFTRun(1, 1, lambda step: 1e-3), Hooks(eval_fn=lambda backend, state: {}))
