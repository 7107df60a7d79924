"""The seeds' tool, chat, reward and generation helpers (``rl_primitives.seed_tools``): calls parsed
and executed in order and read both ways, the chat template's exact text, rewards checked."""
import numpy as np
import pytest

import rl_primitives as rp
from primitives.env.tools import ToolResult
from primitives.types import Conversation, Message, Rollout

TEXT = 'First <tool_call name="calc">{"expression": "2+3"}</tool_call> then <tool_call name="calc">{"x</tool_call>'


def test_extract_tool_calls_from_text_a_generation_or_a_rollout():
    calls = rp.extract_tool_calls(TEXT)
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [("calc", {"expression": "2+3"}, True),
                                                                         ("calc", {}, False)]
    assert calls[0]["name"] == "calc" and calls[0]["arguments"] == {"expression": "2+3"}  # the seeds' dict reading
    gen = rp.Generation(TEXT, np.zeros(0), np.zeros(0, np.int64), "stop")
    assert rp.extract_tool_calls(gen) == calls
    mine = rp.extract_tool_calls("x", tool_parser=lambda t: [{"name": "search", "arguments": {"q": t}}])
    assert (mine[0].name, mine[0].arguments, mine[0].id) == ("search", {"q": "x"}, "call_0")
    with pytest.raises(TypeError, match="Generation, a Rollout or a str"):
        rp.extract_tool_calls(42)


def test_execute_tools_in_order_with_the_seeds_dicts_or_ours():
    order = []

    def seed_executor(call):  # the seeds' shape: a dict in, a dict out
        order.append(call["name"])
        return {"id": call["id"], "output": f"ran {call['arguments']['n']}", "success": call["arguments"]["n"] != 2}

    results = rp.execute_tools([{"name": "a", "arguments": {"n": 1}}, {"name": "b", "arguments": {"n": 2}}],
                               seed_executor)
    assert order == ["a", "b"]
    assert [(r.content, r.is_error, r["success"], r["output"]) for r in results] == [
        ("ran 1", False, True, "ran 1"), ("ran 2", True, False, "ran 2")]
    ours = rp.execute_tools(rp.extract_tool_calls(TEXT)[:1], lambda c: ToolResult(c.id, c.name, "5"))
    assert ours[0]["output"] == "5" and ours[0]["success"] is True


def _rollout_with_calls(calls):
    return Rollout("e0/i0/s0", "e0/i0", "p", np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.float32),
                   np.zeros(1, np.float32), tool_calls=tuple(calls))


def test_tracking_tool_calls():
    calls = rp.extract_tool_calls(TEXT + ' <tool_call name="search">{}</tool_call>')
    rollout = _rollout_with_calls(calls)
    assert rp.track_tool_stats(calls) == {"num_calls": 3, "unique_tools": 2, "malformed": 1}
    assert rp.track_tool_calls(rollout, rp.track_tool_stats) == {"num_calls": 3, "unique_tools": 2, "malformed": 1}
    assert rp.track_tool_calls(rollout, lambda cs: {"names": [c["name"] for c in cs]}) == {
        "names": ["calc", "calc", "search"]}
    with pytest.raises(TypeError, match="not a dict"):
        rp.track_tool_calls(rollout, len)


def test_parse_tool_calls_reads_the_seeds_tag():
    calls = rp.parse_tool_calls('<tool name="calculator">2 + 3</tool> and <tool name="search">{"q": "ray"}</tool>')
    assert [(c.name, c.arguments, c.id) for c in calls] == [("calculator", {"input": "2 + 3"}, "call_0"),
                                                            ("search", {"q": "ray"}, "call_1")]
    assert calls[0]["args"] == {"input": "2 + 3"}
    assert rp.parse_tool_calls("no tags") == []


def test_chat_template_and_format_prompt_give_the_templates_exact_text(tokenizer):
    conv = Conversation((Message("system", "S"), Message("user", "2+3?")))
    want = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert rp.apply_chat_template(conv, tokenizer) == want
    assert rp.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "2+3?"}],
                                  tokenizer) == want
    assert rp.apply_chat_template(conv, tokenizer, template_fn=lambda c, t: "mine") == "mine"
    assert rp.format_prompt("2+3?", tokenizer, use_chat_template=True, system_prompt="S") == want
    assert rp.format_prompt("2+3?", tokenizer) == "2+3?"
    with pytest.raises(ValueError, match="use_chat_template=True"):
        rp.format_prompt("2+3?", tokenizer, system_prompt="S")
    with pytest.raises(ValueError, match="enable_thinking=True, use_chat_template=False"):
        rp.format_prompt("2+3?", tokenizer, enable_thinking=True)


def test_batch_rewards_and_shaping():
    rollouts = [_rollout_with_calls(())._replace(text=t, uid=f"e0/i{k}/s0") for k, t in enumerate(["5", "x"])]
    exact = lambda r: 1.0 if r.text == "5" else 0.0  # noqa: E731
    assert rp.compute_batch_rewards(rp.RolloutBatch(tuple(rollouts)), exact) == [1.0, 0.0]
    assert rp.compute_batch_rewards(rollouts, lambda r: [exact(r), 0.5], is_vector=True) == [[1.0, 0.5], [0.0, 0.5]]
    assert rp.compute_batch_rewards(rollouts, [exact, lambda r: 2.0], is_vector=True) == [[1.0, 2.0], [0.0, 2.0]]
    with pytest.raises(ValueError, match="non-finite"):
        rp.compute_batch_rewards(rollouts, lambda r: [float("nan")], is_vector=True)
    assert rp.apply_reward_shaping(rollouts[0], 1.0, lambda r, b: b - 0.1 * len(r.text)) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="shaping_fn returned inf"):
        rp.apply_reward_shaping(rollouts[0], 1.0, lambda r, b: float("inf"))


def test_batch_generate_gives_one_generation_per_prompt_and_sample(tiny_model, tokenizer):
    import torch

    config = rp.GenerationConfig(max_new_tokens=3, temperature=1.0, num_return_sequences=2)
    torch.manual_seed(0)
    gens = rp.batch_generate(tiny_model, tokenizer, ["1+1=", "2+2=", "3+3="], config, batch_size=2)
    assert len(gens) == 6 and all(len(g.token_ids) == len(g.logprobs) <= 3 for g in gens)
    assert all(isinstance(g, rp.Generation) and np.all(np.asarray(g.logprobs) <= 0) for g in gens)
    assert rp.batch_generate(None, None, ["a"], config, generator=lambda m, t, p, c, b: ["custom", b]) == ["custom", 8]


def test_a_conversation_turn_adds_the_generation_as_the_assistants_message(tiny_model, tokenizer):
    """The seeds' turn: the rendered conversation is what the backend sees, and its text comes back
    as the last message; the default backend samples from the model."""
    seen = []

    def backend(model, tok, prompt, config):
        seen.append(prompt)
        return rp.Generation(text="4", token_ids=[5], logprobs=[-0.5], finish_reason="stop")

    config = rp.GenerationConfig(max_new_tokens=3, temperature=1.0)
    start = [{"role": "user", "content": "2+2="}]
    convo, gen = rp.generate_conversation_turn(tiny_model, tokenizer, start, config, generator=backend)
    assert seen == [rp.apply_chat_template(start, tokenizer)] and gen.text == "4"
    assert [(m.role, m.content) for m in convo.messages] == [("user", "2+2="), ("assistant", "4")]
    convo2, gen2 = rp.generate_conversation_turn(tiny_model, tokenizer, convo, config,
                                                 template_fn=lambda c, t: "".join(m.content for m in c.messages))
    assert len(gen2.token_ids) == len(gen2.logprobs) <= 3 and convo2.messages[-1] == rp.Message("assistant", gen2.text)
    assert convo2.messages[:2] == convo.messages
