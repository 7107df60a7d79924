"""Tools: parsers, the calculator (no eval), the Python sandbox, multi-turn loss masks."""
import numpy as np
import pytest

from primitives.env import sandbox
from primitives.env.tools import (
    ToolCall,
    calculator_tool,
    create_tool_executor,
    multiturn_rollout,
    parse_json_tool_calls,
    parse_xml_tool_calls,
    python_tool,
    run_python_sandboxed,
    safe_calculate,
)
from primitives.hooks import UserFunctionError
from primitives.io.data import PromptItem
from primitives.model.generation import GenerationOutput


def test_xml_parser():
    calls = parse_xml_tool_calls('x <tool_call name="calc">{"expression": "2+3"}</tool_call> y '
                                 '<tool_call name="py">{"code": "print(1)"}</tool_call>')
    assert [(c.name, c.arguments, c.id, c.error) for c in calls] == [
        ("calc", {"expression": "2+3"}, "call_0", None), ("py", {"code": "print(1)"}, "call_1", None)]
    bad = parse_xml_tool_calls('<tool_call name="calc">{not json}</tool_call>')
    assert bad[0].name == "calc" and "not valid JSON" in bad[0].error
    assert parse_xml_tool_calls("<tool_call calc>")[0].error == "malformed <tool_call> tag"
    assert parse_xml_tool_calls("no calls here") == []


def test_json_parser():
    calls = parse_json_tool_calls('<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call>')
    assert calls == [ToolCall("calc", {"expression": "1+1"}, "call_0")]
    calls = parse_json_tool_calls('[{"name": "a", "arguments": "{\\"x\\": 1}"}, {"name": "b"}]')
    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert "not valid JSON" in parse_json_tool_calls("<tool_call>{oops</tool_call>")[0].error
    assert "string 'name'" in parse_json_tool_calls('{"arguments": {}}')[0].error


def test_calculator_never_evaluates_code():
    assert safe_calculate("2 + 3 * (4 - 1) ** 2 / 3") == 11.0
    assert calculator_tool({"expression": "7 // 2 + -1"}) == "2"
    for evil in ["__import__('os').system('true')", "open('/etc/passwd')", "(1).__class__", "x + 1", "[1, 2]"]:
        with pytest.raises((ValueError, SyntaxError)):
            safe_calculate(evil)
    with pytest.raises(ValueError, match="exponent"):
        safe_calculate("9 ** 999999")


def test_xml_call_without_a_name_is_an_error():
    for tag in ['<tool_call name="">{"a": 1}</tool_call>', '<tool_call name="  ">{"a": 1}</tool_call>']:
        (call,) = parse_xml_tool_calls(tag)
        assert call.error == "tool call without a name" and call.name == ""


@pytest.mark.parametrize("expression, value", [("2+3*4", 14), ("-(2**10)", -1024), ("7//2", 3), ("7/2", 3.5),
                                               ("7 % 4 - 2 ** -1", 2.5), ("(10**100) // 10**99", 10)])
def test_calculator_hand_values(expression, value):
    result = safe_calculate(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize("expression", [
    "'x' * 10**9", "True + 1", '"abc"', "[1]*10**9", "(1).__class__", "__import__('os')", "x", "lambda: 1",
    "abs(-1)", "None", "1j", "{1: 2}", "(1, 2)", "1 if 1 else 2", "1 < 2", "1 << 10", "~1", "not 1",
])
def test_calculator_refuses_everything_but_arithmetic_on_numbers(expression):
    with pytest.raises(ValueError, match="unsupported syntax"):
        safe_calculate(expression)


@pytest.mark.parametrize("expression, message", [
    ("2**1000", "exponent 1000 too large"),
    ("(10**100)**100", "bits"),  # the exponent is allowed; the result's size is not
    ("((9**99)**99)**99", "bits"),  # would be ~3 million bits: refused before computing
    ("*".join(["10**100"] * 24), "bits"),  # repeated multiplication, 191 characters
    ("1e308 * 10", "not finite"),
    ("(10**99)**10 / 3", "too large"),  # int too large for a float
])
def test_calculator_bounds_magnitude_before_computing(expression, message):
    assert len(expression) <= 200
    with pytest.raises(ValueError, match=message):
        safe_calculate(expression)


def test_calculator_size_bound_is_a_parameter():
    assert safe_calculate("2**64 * 2**64", max_bits=130) == 2 ** 128
    with pytest.raises(ValueError, match="bits"):
        safe_calculate("2**64 * 2**64", max_bits=120)
    assert safe_calculate("*".join(["10**100"] * 12)) == 10 ** 1200  # 3987 bits: under the default 4096


@pytest.mark.skipif(sandbox._probe_bwrap()[0] is None, reason="no bubblewrap namespaces here; "
                    "tests/primitives/test_sandbox.py covers the unisolated mode")
def test_python_sandbox_runs_and_limits():
    ok, out = run_python_sandboxed("print(sum(range(10)))")
    assert ok and out == "45"
    ok, out = run_python_sandboxed("while True: pass", timeout=1.0)
    assert not ok and "timed out" in out
    ok, out = run_python_sandboxed("import socket; socket.create_connection(('127.0.0.1', 9))")
    assert not ok and ("network" in out or "Network" in out or "unreachable" in out)
    ok, out = run_python_sandboxed("x = bytearray(2 * 1024 ** 3)", memory_mb=256)
    assert not ok and "MemoryError" in out
    ok, out = run_python_sandboxed("import os; print(sorted(os.environ))")
    assert ok and "HOME" not in out  # the environment is emptied
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        python_tool({"code": "1/0"})


def test_executor_turns_failures_into_error_results():
    ex = create_tool_executor({"calc": calculator_tool})
    assert ex(ToolCall("calc", {"expression": "2+2"}, "c0")).content == "4"
    r = ex(ToolCall("calc", {"expression": "import os"}, "c1"))
    assert r.is_error and r.content.startswith("error:")
    assert ex(ToolCall("nope", {}, "c2")).content.startswith("error: unknown tool 'nope'")
    assert ex(ToolCall("", {}, "c3", error="malformed <tool_call> tag")).is_error


def _scripted_turns(tokenizer, turns):
    """generate_turn that returns the given texts in order (with logprob -0.5 per token)."""
    it = iter(turns)

    def generate_turn(context_ids):
        text = next(it)
        ids = np.asarray(tokenizer(text, add_special_tokens=False).input_ids, dtype=np.int64)
        return GenerationOutput(ids, np.full(len(ids), -0.5, np.float32), "stop", text)

    return generate_turn


def test_multiturn_loss_mask_excludes_tool_tokens(tokenizer):
    turns = ['<tool_call name="calc">{"expression": "12*3"}</tool_call>',
             '<tool_call name="calc">{bad json}</tool_call>', "The answer is 36<|im_end|>"]
    item = PromptItem(0, "What is 12*3?", answer="36")
    r = multiturn_rollout(item, tokenizer, _scripted_turns(tokenizer, turns),
                          tool_executor=create_tool_executor({"calc": calculator_tool}), max_turns=5)
    assert len(r.completion_ids) == len(r.loss_mask) == len(r.logprobs)
    policy = tokenizer.decode(r.completion_ids[r.loss_mask == 1].tolist(), skip_special_tokens=False)
    assert policy == "".join(turns)  # every policy token, and only those, is in the loss
    tool = tokenizer.decode(r.completion_ids[r.loss_mask == 0].tolist(), skip_special_tokens=False)
    assert "<tool_response>36</tool_response>" in tool and "error:" in tool
    assert "36</tool_response>" not in policy
    assert (r.logprobs[r.loss_mask == 0] == 0).all() and (r.logprobs[r.loss_mask == 1] == -0.5).all()
    assert [c.name for c in r.tool_calls] == ["calc", "calc"] and r.tool_results[1].is_error
    # the whole sequence is what the chat template renders for the conversation
    full = tokenizer.decode(np.concatenate([r.prompt_ids, r.completion_ids]).tolist(), skip_special_tokens=False)
    assert full.startswith("<|im_start|>user\nWhat is 12*3?<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>tool\n<tool_response>36</tool_response><|im_end|>\n<|im_start|>assistant\n" in full


def test_multiturn_turn_closed_by_a_special_token_and_the_kept_conversation(tokenizer):
    """A tool turn that ends with <|im_end|> (as a chat model closes its turn) is followed by
    the tool output once, not by a second <|im_end|>; the rollout keeps the conversation with
    its roles, and the prompt item's own metadata survives."""
    turns = ['<tool_call name="calc">{"expression": "7*6"}</tool_call><|im_end|>', "42<|im_end|>"]
    item = PromptItem(3, "7*6?", answer="42", metadata={"source_id": "q-17"})
    r = multiturn_rollout(item, tokenizer, _scripted_turns(tokenizer, turns),
                          tool_executor=create_tool_executor({"calc": calculator_tool}), max_turns=3)
    full = tokenizer.decode(r.completion_ids.tolist(), skip_special_tokens=False)
    assert full == ('<tool_call name="calc">{"expression": "7*6"}</tool_call><|im_end|>\n<|im_start|>tool\n'
                    "<tool_response>42</tool_response><|im_end|>\n<|im_start|>assistant\n42<|im_end|>")
    policy = tokenizer.decode(r.completion_ids[r.loss_mask == 1].tolist(), skip_special_tokens=False)
    assert policy == "".join(turns)
    assert r.metadata["source_id"] == "q-17" and r.metadata["turns"] == 4
    assert [m["role"] for m in r.metadata["conversation"]] == ["user", "assistant", "tool", "assistant"]
    assert r.metadata["conversation"][1]["content"] == '<tool_call name="calc">{"expression": "7*6"}</tool_call>'
    assert r.metadata["conversation"][2] == {"role": "tool", "content": "42", "tool_call_id": r.tool_calls[0].id,
                                             "name": "calc"}


def test_a_tool_turn_ended_by_eos_ends_the_rollout(tokenizer):
    """The tiny tokenizer's eos (<|endoftext|>) is not the token its template closes a turn
    with (<|im_end|>): a tool call followed by eos ends the text, so no tool output is appended
    and the rollout ends there instead of failing the whole generate call."""
    turns = ['<tool_call name="calc">{"expression": "7*6"}</tool_call>' + tokenizer.eos_token, "never reached"]
    r = multiturn_rollout(PromptItem(0, "7*6?"), tokenizer, _scripted_turns(tokenizer, turns),
                          tool_executor=create_tool_executor({"calc": calculator_tool}), max_turns=3)
    assert tokenizer.decode(r.completion_ids.tolist(), skip_special_tokens=False) == turns[0]
    assert r.loss_mask.tolist() == [1.0] * len(r.completion_ids) and r.tool_calls == () and r.tool_results == ()
    assert [m["role"] for m in r.metadata["conversation"]] == ["user", "assistant"]


def test_multiturn_stops_without_tool_calls(tokenizer):
    r = multiturn_rollout(PromptItem(1, "hi"), tokenizer, _scripted_turns(tokenizer, ["hello<|im_end|>"]),
                          tool_executor=create_tool_executor({}))
    assert r.loss_mask.tolist() == [1.0] * len(r.completion_ids) and r.tool_calls == ()


def test_multiturn_with_real_model(tiny_model, tokenizer):
    import torch

    from primitives.env.tools import hf_turn_generator
    from primitives.types import GenerationConfig

    gen = hf_turn_generator(tiny_model, tokenizer, GenerationConfig(max_new_tokens=8, seed=0),
                            torch.Generator().manual_seed(0))
    r = multiturn_rollout(PromptItem(0, "2+2?"), tokenizer, gen, tool_executor=create_tool_executor({}))
    assert len(r.completion_ids) == len(r.loss_mask) >= 1
    # the behaviour logprobs of policy tokens are what a trainer recomputes on the whole sequence
    from primitives.model.logprobs import rollout_logprobs

    again = rollout_logprobs(tiny_model, [r], tokenizer.pad_token_id)[0]
    policy = r.loss_mask == 1
    assert np.abs(again[policy] - r.logprobs[policy]).max() < 1e-4


def _by_context(tokenizer, calls_before_answer: dict, seen_batches: list):
    """``generate_turns`` that answers each context by what it holds: item ``i`` (its prompt names it)
    calls the calculator ``calls_before_answer[i]`` times, then answers; each call's batch size is
    recorded."""
    def turn(context_ids) -> GenerationOutput:
        text = tokenizer.decode(context_ids.tolist())
        i = int(text.split("item ")[1].split("?")[0])
        done = text.count("<tool_response>")
        reply = f'<tool_call name="calc">{{"expression": "{i}*{done + 1}"}}</tool_call>' \
            if done < calls_before_answer[i] else f"The answer is {i}<|im_end|>"
        ids = np.asarray(tokenizer(reply, add_special_tokens=False).input_ids, dtype=np.int64)
        return GenerationOutput(ids, np.full(len(ids), -0.25 - i, np.float32), "stop", reply)

    def turns(contexts) -> list:
        seen_batches.append(len(contexts))
        return [turn(c) for c in contexts]

    return turns


def test_conversations_advance_in_lockstep_and_equal_one_at_a_time(tokenizer):
    """Every conversation still going is continued in one call per round: conversations of 0, 2, 1 and 3
    tool calls (2 samples each) take 4 rounds of 8, 6, 4 and 2 rows, and give exactly the rollouts
    ``multiturn_rollout`` gives for each alone, in item-major order."""
    from primitives.env.tools import ToolConfig, multiturn_rollouts

    calls = {0: 0, 1: 2, 2: 1, 3: 3}
    items = [PromptItem(i, f"What is item {i}?", answer=str(i)) for i in calls]
    tools = ToolConfig(create_tool_executor({"calc": calculator_tool}), max_turns=5)
    batches: list = []
    together = multiturn_rollouts(_by_context(tokenizer, calls, batches), tokenizer, items, 2, tools, policy_version=3)
    assert batches == [8, 6, 4, 2]
    assert [r.uid for r in together] == [f"e0/i{i}/s{k}" for i in calls for k in range(2)]
    one = _by_context(tokenizer, calls, [])
    for j, r in enumerate(together):
        item, sample = items[j // 2], j % 2
        alone = multiturn_rollout(item, tokenizer, lambda c: one([c])[0], tool_executor=tools.executor,
                                  max_turns=5, sample=sample, policy_version=3)
        assert _same_rollout(r, alone)
        assert len(r.tool_calls) == calls[item.index] and r.text.endswith(f"The answer is {item.index}")


def _same_rollout(a, b) -> bool:
    arrays = ("prompt_ids", "completion_ids", "loss_mask", "logprobs")
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in arrays) and \
        (a.uid, a.text, a.finish_reason, a.tool_calls, a.tool_results, a.metadata, a.policy_version) == \
        (b.uid, b.text, b.finish_reason, b.tool_calls, b.tool_results, b.metadata, b.policy_version)


def test_generate_turns_that_miscount_are_named(tokenizer):
    from primitives.env.tools import ToolConfig, multiturn_rollouts

    with pytest.raises(ValueError, match="returned 1 outputs for 2 contexts"):
        multiturn_rollouts(lambda contexts: [None], tokenizer, [PromptItem(0, "hi")], 2,
                           ToolConfig(create_tool_executor({})))


def test_batched_turns_decode_as_one_at_a_time(tiny_model, tokenizer):
    """``hf_turns_generator`` left-pads contexts of different lengths into one batch, whose rows end at
    different steps (stop strings after 2, 3 and 4 tokens, one at the budget): greedy turns are the
    tokens each context gets alone, with the same ends, their logprobs within 1e-5."""
    import torch

    from primitives.env.tools import hf_turn_generator, hf_turns_generator
    from primitives.types import GenerationConfig

    gen = GenerationConfig(max_new_tokens=12, temperature=0.0, stop=("??", "iii", "1111"))
    contexts = [np.asarray(tokenizer(text, add_special_tokens=False).input_ids, dtype=np.int64)
                for text in ("2+2=", "What is 17 times 23, worked out by hand?", "hi", "1 2 3 4 5 6 7 8 9 10 11")]
    assert len({len(c) for c in contexts}) == len(contexts)
    together = hf_turns_generator(tiny_model, tokenizer, gen, torch.Generator())(contexts)
    assert [(len(t.completion_ids), t.finish_reason) for t in together] == \
        [(12, "length"), (2, "stop"), (3, "stop"), (4, "stop")]
    one = hf_turn_generator(tiny_model, tokenizer, gen, torch.Generator())
    for c, t in zip(contexts, together):
        alone = one(c)
        assert t.completion_ids.tolist() == alone.completion_ids.tolist() and t.finish_reason == alone.finish_reason
        assert np.abs(t.logprobs - alone.logprobs).max() < 1e-5


def test_turns_decode_in_batches_of_max_batch_rows(tiny_model, tokenizer, monkeypatch):
    """``max_batch_rows`` 2 over 5 contexts: ``generate_tokens`` calls of 2, 2 and 1 rows, the greedy turns in
    the contexts' order as one batch of all 5 gives them, logprobs within 1e-5; no context: the
    empty call's own error."""
    import torch

    from primitives.env.tools import hf_turns_generator
    from primitives.model import generation
    from primitives.types import GenerationConfig

    gen = GenerationConfig(max_new_tokens=8, temperature=0.0)
    contexts = [np.asarray(tokenizer(text, add_special_tokens=False).input_ids, dtype=np.int64)
                for text in ("2+2=", "hi", "What is 17 times 23?", "1 2 3", "x")]
    together = hf_turns_generator(tiny_model, tokenizer, gen, torch.Generator())(contexts)
    calls: list = []
    real = generation.generate_tokens
    monkeypatch.setattr(generation, "generate_tokens",
                        lambda m, t, ids, *a: calls.append(len(ids)) or real(m, t, ids, *a))
    capped = hf_turns_generator(tiny_model, tokenizer, gen._replace(max_batch_rows=2), torch.Generator())(contexts)
    assert calls == [2, 2, 1]  # 5 rows under a cap of 2: three batches
    assert [t.completion_ids.tolist() for t in capped] == [t.completion_ids.tolist() for t in together]
    assert max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in zip(capped, together)) < 1e-5
    with pytest.raises(ValueError, match="no prompts"):
        hf_turns_generator(tiny_model, tokenizer, gen._replace(max_batch_rows=2), torch.Generator())([])


def test_no_turns_end_a_conversation_before_it_starts(tokenizer):
    """``max_turns`` 0: a rollout with nothing generated, as one turn budget of none would give, and no call."""
    from primitives.env.tools import ToolConfig, multiturn_rollouts

    calls: list = []
    rollouts = multiturn_rollouts(lambda contexts: calls.append(contexts) or [], tokenizer, [PromptItem(0, "hi")], 2,
                                  ToolConfig(create_tool_executor({}), max_turns=0))
    assert calls == [] and [r.uid for r in rollouts] == ["e0/i0/s0", "e0/i0/s1"]
    assert all(len(r.completion_ids) == 0 and r.finish_reason == "length" for r in rollouts)


def test_a_tool_that_raises_mid_round_is_named_with_its_rollout(tokenizer):
    """A raising executor (the user's) stops the round at its conversation, named by the rollout's uid."""
    from primitives.env.tools import ToolConfig, multiturn_rollouts

    def executor(call):
        raise OSError("disk gone")

    named = r"tool_executor \S+executor raised \(rollout e0/i1/s0\): OSError: disk gone"
    with pytest.raises(UserFunctionError, match=named):
        multiturn_rollouts(_by_context(tokenizer, {0: 0, 1: 1}, []), tokenizer,
                           [PromptItem(i, f"What is item {i}?") for i in (0, 1)], 1, ToolConfig(executor))


def test_dapo_overlong_limit_of_a_tool_rollout_is_its_whole_budget(monkeypatch):
    """DAPO's soft overlong penalty counts a rollout's policy tokens over all its turns, so the RL loop's
    budget for it is max_new_tokens x max_turns (20 x 3 = 60), not a turn's 20. Default buffer 20 % of 60
    = 12, so the penalty starts past 48 tokens: turns of [12, 12] and [10, 10, 10] tokens (each ended by
    its stop, tool output between them) keep reward 1, and [20, 20, 12] = 52 tokens gets 1 - 4 / 12 by
    hand. With a turn's 20 as the limit (buffer 4), 24 and 30 tokens lost the whole reward."""
    from collections import deque

    from cluster.loop import train as loop
    from primitives.env.tools import ToolConfig
    from primitives.maths.algorithms import get_algorithm
    from primitives.maths.batching import apply_overlong_penalty
    from primitives.types import GenerationConfig, Rollout, TrainState

    def rollout(turns, tool=6):
        mask = np.concatenate([np.r_[np.ones(t), np.zeros(tool)] for t in turns])[:-tool].astype(np.float32)
        return Rollout(uid="e0/i0/s0", group="e0/i0", prompt="p", prompt_ids=np.arange(3),
                       completion_ids=np.arange(len(mask)), loss_mask=mask, logprobs=np.zeros(len(mask), np.float32),
                       finish_reason="stop", reward=1.0)

    gen, tools = GenerationConfig(max_new_tokens=20), ToolConfig(executor=lambda call: None, max_turns=3)
    budget = loop.policy_token_budget(gen, tools)
    assert budget == 60 and loop.policy_token_budget(gen) == 20
    assert loop.policy_token_budget(gen, ToolConfig(executor=lambda call: None, max_turns=0)) == 20
    dapo = get_algorithm("dapo")
    rewards = [r.reward for r in apply_overlong_penalty([rollout(t) for t in ([12, 12], [10, 10, 10], [20, 20, 12])],
                                                        dapo, budget)]
    assert rewards == pytest.approx([1.0, 1.0, 1.0 - 4 / 12], abs=1e-12)
    per_turn = [r.reward for r in apply_overlong_penalty([rollout([12, 12]), rollout([10, 10, 10])], dapo, 20)]
    assert per_turn == [0.0, 0.0]

    planned = []
    monkeypatch.setattr(loop, "train_and_sync", lambda backend, rows, plan_args, *rest: planned.append(plan_args))
    run = loop.RLRun(gen, num_steps=1, prompts_per_step=1, lr_schedule=lambda it: None, progress=False)
    loop.update_and_sync(None, [object()], TrainState(), dapo, run, 0, deque(), tools)
    loop.update_and_sync(None, [object()], TrainState(), dapo, run, 0, deque())
    assert [p["budget"] for p in planned] == [60, 20]
