"""The seeds' tool, chat, reward and generation helpers (seeds/000 and 001) by their names: parse
and execute tool calls, track them, render a conversation or a prompt through the chat template,
score and shape a batch, generate for many prompts. Each delegates to the project's primitives;
calls and results read both as our records and as the seeds' dicts (``call["name"]``,
``result["success"]``).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence

from primitives.env.rewards import compute_scalar_reward, compute_vector_reward
from primitives.env.tools import ToolCall, parse_xml_tool_calls
from primitives.model.prompts import render_prompt
from primitives.types import Conversation, Message
from rl_primitives.api import (
    _GenerationConfig,
    as_tool_call,
    create_batch_rollouts,
    seed_tool_executor,
    seed_tool_parser,
)


def _text(source) -> str:
    if isinstance(source, str):
        return source
    text = getattr(source, "text", None)
    if not isinstance(text, str):
        raise TypeError(f"expected a Generation, a Rollout or a str with the model's text, got {type(source).__name__}")
    return text


def extract_tool_calls(generation, tool_parser: Optional[Callable] = None) -> list:
    """The tool calls in a generation's text (a ``Generation``, ``Rollout`` or str), by
    ``tool_parser(text)`` (ours: ``<tool_call name="...">{json}</tool_call>``,
    ``primitives.env.tools.parse_xml_tool_calls``). Each reads as a ``ToolCall`` and as the seeds'
    dict."""
    return seed_tool_parser(tool_parser or parse_xml_tool_calls)(_text(generation))


def execute_tools(tool_calls: Sequence, tool_executor: Callable) -> list:
    """``tool_executor(call)`` of each call, in order; the results read as ``ToolResult`` and as
    the seeds' dicts (``{"id", "output", "success"}``). A call the parser marked malformed is
    handed to the executor as it is (``call.error`` says why): the executor decides what the model
    is told. Model-written code runs only in the sandbox (``python_tool``; seeds README error 6)."""
    execute = seed_tool_executor(tool_executor)
    return [execute(as_tool_call(call, k)) for k, call in enumerate(tool_calls)]


def track_tool_calls(rollout, tool_tracker: Callable) -> dict:
    """``tool_tracker(calls)`` of a rollout's tool calls (read both ways), checked to be a dict."""
    calls = [as_tool_call(call, k) for k, call in enumerate(rollout.tool_calls)]
    out = tool_tracker(calls)
    if not isinstance(out, dict):
        raise TypeError(f"tool_tracker {getattr(tool_tracker, '__name__', tool_tracker)!r} returned "
                        f"{type(out).__name__}, not a dict of tracking values")
    return out


def track_tool_stats(tool_calls: Sequence) -> dict:
    """The seeds' tracker: ``num_calls``, ``unique_tools`` (distinct names) and, ours,
    ``malformed`` (calls the parser could not read)."""
    calls = [as_tool_call(call, k) for k, call in enumerate(tool_calls)]
    return {"num_calls": len(calls), "unique_tools": len({c.name for c in calls}),
            "malformed": sum(bool(c.error) for c in calls)}


_SEED_TOOL = re.compile(r'<tool name="([^"]+)">(.*?)</tool>', re.DOTALL)


def parse_tool_calls(text: str) -> list:
    """The seeds' tag ``<tool name="calculator">2 + 3</tool>``: one call per tag, in order. Its
    arguments are ``{"input": text}`` (the tag's body), or the JSON object the body holds."""
    import json

    calls = []
    for k, (name, body) in enumerate(_SEED_TOOL.findall(_text(text))):
        body = body.strip()
        try:
            parsed = json.loads(body) if body.startswith("{") else None
        except ValueError:
            parsed = None
        calls.append(as_tool_call(ToolCall(name.strip(), parsed if isinstance(parsed, dict) else {"input": body},
                                           f"call_{k}"), k))
    return calls


def _as_conversation(conversation) -> Conversation:
    """A ``Conversation``, from ours or from the seeds' list of messages or ``{"role", "content"}`` dicts."""
    if isinstance(conversation, (list, tuple)) and not isinstance(conversation, Conversation):
        return Conversation(tuple(m if isinstance(m, Message) else Message(m["role"], m["content"])
                                  for m in conversation))
    return conversation


def apply_chat_template(conversation, tokenizer, template_fn: Optional[Callable] = None,
                        template_kwargs: Optional[dict] = None) -> str:
    """The text the model continues: ``template_fn(conversation, tokenizer)``, or the tokenizer's
    chat template with the generation prompt (``primitives.model.prompts.render_prompt``). The seeds'
    list of messages and ``{"role", "content"}`` dicts are accepted as a conversation."""
    if template_fn is not None:
        return template_fn(conversation, tokenizer)
    return render_prompt(tokenizer, _as_conversation(conversation), template_kwargs=template_kwargs)


def generate_conversation_turn(model, tokenizer, conversation, config: _GenerationConfig,
                               template_fn: Optional[Callable] = None,
                               generator: Optional[Callable] = None) -> tuple:
    """The seeds' next turn: the conversation rendered (``apply_chat_template``), one completion
    (``generate``, from the user's ``generator`` backend when given), and the conversation with the
    completion added as the assistant's message: ``(conversation, generation)``."""
    from rl_primitives.api import generate

    conversation = _as_conversation(conversation)
    generation = generate(model, tokenizer, apply_chat_template(conversation, tokenizer, template_fn), config,
                          generator)
    return conversation.add_message(Message("assistant", generation.text)), generation


def format_prompt(prompt: str, tokenizer, use_chat_template: bool = False, system_prompt: Optional[str] = None,
                  enable_thinking: bool = False, template_fn: Optional[Callable] = None) -> str:
    """seeds/001's ``format_prompt``: ``prompt`` as is, or (``use_chat_template``) as a user turn
    after an optional system turn through the chat template, ``enable_thinking`` passed to the
    template (Qwen3's switch). ``template_fn(prompt, tokenizer, use_chat_template, system_prompt,
    enable_thinking)`` replaces it all."""
    if template_fn is not None:
        return template_fn(prompt, tokenizer, use_chat_template, system_prompt, enable_thinking)
    if not use_chat_template:
        if system_prompt or enable_thinking:
            given = "system_prompt=..." if system_prompt else "enable_thinking=True"
            raise ValueError(f"format_prompt({given}, use_chat_template=False): it is a switch of the chat template; "
                             "pass use_chat_template=True")
        return render_prompt(tokenizer, prompt)
    turns = ((Message("system", system_prompt),) if system_prompt else ()) + (Message("user", prompt),)
    return render_prompt(tokenizer, Conversation(turns), template_kwargs={"enable_thinking": enable_thinking})


def compute_batch_rewards(batch, reward_fn: Callable, is_vector: bool = False) -> list:
    """The reward of each rollout of ``batch``: one finite float each, or (``is_vector``) a list
    of finite floats from a reward function that returns several (or a list of functions, one
    component each)."""
    rollouts = getattr(batch, "rollouts", batch)
    if not is_vector:
        return [compute_scalar_reward(r, reward_fn) for r in rollouts]
    if isinstance(reward_fn, (list, tuple)):
        return [compute_vector_reward(r, reward_fn).tolist() for r in rollouts]
    out = []
    for r in rollouts:
        value = reward_fn(r)
        components = [float(x) for x in value]
        if any(c != c or c in (float("inf"), float("-inf")) for c in components):
            raise ValueError(f"reward_fn returned a non-finite component for rollout {r.uid}: {components}")
        out.append(components)
    return out


def apply_reward_shaping(rollout, base_reward: float, shaping_fn: Callable[[Any, float], float]) -> float:
    """``shaping_fn(rollout, base_reward)``, checked to be one finite float (a rollout's KL is not
    a field here: put KL in the reward with ``algorithm kl_in_reward``, from the same tokens)."""
    value = float(shaping_fn(rollout, float(base_reward)))
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"shaping_fn returned {value} for rollout {getattr(rollout, 'uid', '?')}")
    return value


def batch_generate(model, tokenizer, prompts: Sequence, config: _GenerationConfig, batch_size: int = 8,
                   generator: Optional[Callable] = None) -> list:
    """One ``Generation`` (text, logprobs, token ids, finish reason) per prompt and sample, in
    prompt order, ``batch_size`` prompts at a time (``create_batch_rollouts``);
    ``generator(model, tokenizer, prompts, config, batch_size)`` replaces it."""
    if generator is not None:
        return generator(model, tokenizer, prompts, config, batch_size)
    batch = create_batch_rollouts(model, tokenizer, prompts, config, batch_size=batch_size)
    return [r.generation for r in batch.rollouts]
