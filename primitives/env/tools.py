"""Tool use: parsers, a safe calculator, a sandboxed Python executor, multi-turn rollouts.

Model output is data, never code to run in this process: the calculator parses arithmetic
with ``ast`` and a whitelist; Python runs in a separate process isolated by bubblewrap, a
seccomp filter, rlimits and an audit hook (``primitives.env.sandbox``). An unparseable call
becomes a tool *error message* in the conversation.
"""
from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Callable
from typing import NamedTuple, Optional

import numpy as np

from primitives.env.sandbox import SandboxUnavailable, run_python_sandboxed  # noqa: F401 (part of this module's API)
from primitives.maths.metrics import tool_metrics as summary_tool_metrics
from primitives.model.generation import GenerationOutput
from primitives.model.prompts import render_prompt
from primitives.types import Conversation, Message, Rollout, group_id, make_uid, summarize


class ToolCall(NamedTuple):
    name: str
    arguments: dict
    id: str = ""
    error: str | None = None  # set when the call could not be parsed


class ToolResult(NamedTuple):
    call_id: str
    name: str
    content: str
    is_error: bool = False


# ----------------------------------------------------------------------------- parsers

_XML_CALL = re.compile(r'<tool_call\s+name="([^"]*)"\s*>(.*?)</tool_call>', re.DOTALL)
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _json_args(text: str, name: str, call_id: str) -> ToolCall:
    text = text.strip()
    if not text:
        return ToolCall(name, {}, call_id)
    try:
        args = json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCall(name, {}, call_id, error=f"arguments are not valid JSON: {e.msg}")
    if not isinstance(args, dict):
        return ToolCall(name, {}, call_id, error="arguments must be a JSON object")
    return ToolCall(name, args, call_id)


def parse_xml_tool_calls(text: str) -> list:
    """Calls written ``<tool_call name="calc">{"expression": "2+3"}</tool_call>``."""
    calls = []
    for i, m in enumerate(_XML_CALL.finditer(text)):
        name = m.group(1).strip()
        call = _json_args(m.group(2), name, f"call_{i}")
        calls.append(call if name else call._replace(error="tool call without a name"))
    if not calls and "<tool_call" in text:
        calls.append(ToolCall("", {}, "call_0", error="malformed <tool_call> tag"))
    return calls


def parse_json_tool_calls(text: str) -> list:
    """JSON function calls ``{"name": ..., "arguments": {...}}``, bare or inside Hermes-style
    ``<tool_call>...</tool_call>`` tags; a list of such objects is accepted too."""
    chunks = _HERMES_CALL.findall(text) or ([text.strip()] if text.strip().startswith(("{", "[")) else [])
    calls: list = []
    for chunk in chunks:
        try:
            obj = json.loads(chunk)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"call_{len(calls)}", error=f"tool call is not valid JSON: {e.msg}"))
            continue
        for o in obj if isinstance(obj, list) else [obj]:
            cid = f"call_{len(calls)}"
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                calls.append(ToolCall("", {}, cid, error="tool call needs a string 'name'"))
                continue
            args = o.get("arguments", o.get("parameters", {}))
            if isinstance(args, str):
                calls.append(_json_args(args, o["name"], cid))
            elif isinstance(args, dict):
                calls.append(ToolCall(o["name"], args, cid))
            else:
                calls.append(ToolCall(o["name"], {}, cid, error="arguments must be a JSON object"))
    return calls


# ----------------------------------------------------------------------------- calculator and python tool

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNOPS: dict[type, Callable] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def safe_calculate(expression: str, max_len: int = 200, max_power: int = 100, max_bits: int = 4096):
    """Evaluate + - * / // % ** and parentheses on int and float literals by walking the AST
    (no ``eval``). Anything else (names, calls, strings, bools, containers, attributes) is a
    ValueError, and so is an exponent above ``max_power`` or an integer above ``max_bits`` bits:
    a bound checked *before* multiplying, so ``((9**99)**99)**99`` never allocates."""
    if len(expression) > max_len:
        raise ValueError(f"expression longer than {max_len} characters")
    tree = ast.parse(expression, mode="eval")

    def bounded(value):
        if isinstance(value, int) and value.bit_length() > max_bits:
            raise ValueError(f"result has more than {max_bits} bits")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"result is not finite: {value}")
        return value

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return bounded(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > max_power:
                raise ValueError(f"exponent {right} too large (max {max_power})")
            _check_size(node.op, left, right, max_bits)
            try:
                return bounded(_BINOPS[type(node.op)](left, right))
            except OverflowError as e:
                raise ValueError(f"result too large: {e}") from None
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            return _UNOPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported syntax: {type(node).__name__}")

    return ev(tree)


def _check_size(op: ast.operator, left, right, max_bits: int) -> None:
    """Refuse an integer product or power whose size bound exceeds ``max_bits`` before computing it."""
    if not (type(left) is int and type(right) is int):
        return
    if isinstance(op, ast.Mult):
        bits = left.bit_length() + right.bit_length()
    elif isinstance(op, ast.Pow) and right > 0:
        bits = left.bit_length() * right
    else:
        return
    if bits > max_bits:
        raise ValueError(f"result would have about {bits} bits (max {max_bits})")


def calculator_tool(arguments: dict) -> str:
    expr = arguments.get("expression")
    if not isinstance(expr, str):
        raise TypeError("calculator needs a string argument 'expression'")
    value = safe_calculate(expr)
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def python_tool(arguments: dict, timeout: float = 5.0, memory_mb: int = 512) -> str:
    """The ``python`` tool: runs ``arguments["code"]`` with ``run_python_sandboxed``; its output,
    or a RuntimeError carrying the traceback (an error result for the model)."""
    code = arguments.get("code")
    if not isinstance(code, str):
        raise TypeError("python tool needs a string argument 'code'")
    ok, out = run_python_sandboxed(code, timeout, memory_mb)
    if not ok:
        raise RuntimeError(out or "python exited with an error")
    return out


def create_tool_executor(tools: dict) -> Callable:
    """``tool_executor(call) -> ToolResult`` dispatching to ``tools[name](arguments) -> str``.
    Unknown tools, parse errors and raising tools all become error results."""

    def tool_executor(call: ToolCall) -> ToolResult:
        if call.error is not None:
            return ToolResult(call.id, call.name, f"error: {call.error}", True)
        fn = tools.get(call.name)
        if fn is None:
            return ToolResult(call.id, call.name, f"error: unknown tool '{call.name}' (have {sorted(tools)})", True)
        try:
            return ToolResult(call.id, call.name, str(fn(call.arguments)))
        except SandboxUnavailable:  # a machine set-up problem, not information for the model
            raise
        except Exception as e:  # noqa: BLE001 - the tool's failure is information for the model, not a crash
            return ToolResult(call.id, call.name, f"error: {type(e).__name__}: {e}", True)

    return tool_executor


def execute_and_track_tools(rollout, tool_executor: Callable, result_tracker: Optional[Callable] = None):
    """Single-turn tool tracking (the seeds' ``execute_and_track_tools``): each of the rollout's
    ``tool_calls`` (``create_rollout(..., tool_parser=...)``) run by ``tool_executor(call) ->
    ToolResult`` in order, as a new rollout whose ``tool_results`` hold them and whose
    ``metadata["tool_tracking"]`` is ``result_tracker(results) -> dict`` ({} without one). The
    completion's tokens are unchanged: the results are not fed back to the model (that is
    ``multiturn_rollout``, whose tool tokens are masked out of the loss)."""
    from primitives.hooks import fn_name

    results = []
    for call in rollout.tool_calls:
        result = tool_executor(call)
        if not isinstance(result, ToolResult):
            raise ValueError(f"tool_executor {fn_name(tool_executor)} returned {type(result).__name__} for the call "
                             f"{call.name!r}; expected a primitives.env.tools.ToolResult (create_tool_executor)")
        results.append(result)
    tracking = {} if result_tracker is None else result_tracker(results)
    if not isinstance(tracking, dict):
        raise ValueError(f"result_tracker {fn_name(result_tracker)} returned {type(tracking).__name__}; expected a "
                         f"dict of tracking values")
    return rollout._replace(tool_results=tuple(results),
                            metadata={**(rollout.metadata or {}), "tool_tracking": tracking})


# ----------------------------------------------------------------------------- multi-turn

def no_tool_calls_stop(conversation: Conversation) -> bool:
    """Default ``stop_condition``: stop once the last assistant turn called no tool."""
    last = conversation.last("assistant")
    return last is not None and not last.tool_calls


class ToolConfig(NamedTuple):
    """What a tool-using rollout needs (``train(..., tools=ToolConfig(...))``); the functions
    travel to the generators by value.

    * ``parser(text) -> [ToolCall]``: the calls in one assistant turn.
    * ``executor(ToolCall) -> ToolResult``: runs one call (``create_tool_executor``).
    * ``stop_condition(Conversation) -> bool``: stop before the next turn.
    """

    executor: Callable
    parser: Optional[Callable] = None  # None: parse_xml_tool_calls
    stop_condition: Optional[Callable] = None  # None: no_tool_calls_stop
    max_turns: int = 4


def tool_metrics(rollouts) -> dict:
    """Tool statistics of rollouts (``primitives.maths.metrics.tool_metrics`` of their summaries)."""
    return summary_tool_metrics([summarize(r) for r in rollouts])


def multiturn_rollout(item, tokenizer, generate_turn: Callable[[np.ndarray], GenerationOutput],
                      tool_parser: Callable = parse_xml_tool_calls, tool_executor: Optional[Callable] = None,
                      stop_condition: Callable = no_tool_calls_stop, max_turns: int = 4,
                      sample: int = 0, policy_version: int = 0) -> Rollout:
    """Generate, parse tool calls, execute, append results, repeat; one ``Rollout``.

    Token ids are concatenated, never re-tokenized, so the trainer scores exactly what was
    sampled. Policy tokens have loss_mask 1 and their behaviour logprobs; tool-output and
    template tokens between turns have loss_mask 0 and logprob 0.
    ``generate_turn(context_ids) -> GenerationOutput`` continues a context by one turn.
    """
    if tool_executor is None:
        raise ValueError("multiturn_rollout needs a tool_executor")
    conversation = _conversation(item, tokenizer, tool_parser, tool_executor, stop_condition, max_turns, sample,
                                 policy_version)
    return run_conversations([conversation], lambda contexts: [generate_turn(contexts[0])])[0]


def run_conversations(conversations: list, generate_turns: Callable) -> list:
    """Drive ``_conversation`` coroutines in lockstep: each round, one batched call of
    ``generate_turns([context_ids, ...]) -> [GenerationOutput, ...]`` continues every conversation
    still going by one turn (a batch of as many rows as there are, where one at a time was a
    batch of one: a step's 16 tool rollouts on the tiny model took 1503 forward passes one by
    one). Returns each conversation's ``Rollout``, in order."""
    done: list = [None] * len(conversations)
    waiting: dict = {}
    for i, conversation in enumerate(conversations):  # each conversation's first context
        _advance(conversation, None, i, waiting, done)
    while waiting:
        order = list(waiting)
        outputs = list(generate_turns([waiting[i] for i in order]))
        if len(outputs) != len(order):
            raise ValueError(f"generate_turns returned {len(outputs)} outputs for {len(order)} contexts")
        waiting = {}
        for i, out in zip(order, outputs):
            _advance(conversations[i], out, i, waiting, done)
    return done


def _advance(conversation, output, i: int, waiting: dict, done: list) -> None:
    """Send ``output`` (None: start it) to conversation ``i``: its next context into ``waiting``, or,
    when it has ended (``max_turns`` 0 ends before any turn), its rollout into ``done``."""
    try:
        waiting[i] = conversation.send(output)
    except StopIteration as finished:
        done[i] = finished.value


def _conversation(item, tokenizer, tool_parser: Callable, tool_executor: Callable, stop_condition: Callable,
                  max_turns: int, sample: int, policy_version: int):
    """``multiturn_rollout``'s conversation as a coroutine: yields each turn's context ids, is sent
    that turn's ``GenerationOutput``, and returns the ``Rollout`` (``run_conversations``)."""
    from primitives.hooks import call_hook
    from primitives.model.prompts import message_to_dict

    uid = make_uid(item.epoch, item.index, sample)
    conv = item.prompt if isinstance(item.prompt, Conversation) else Conversation((Message("user", item.prompt),))
    prefix_text = render_prompt(tokenizer, conv)
    prompt_ids = np.asarray(tokenizer(prefix_text, add_special_tokens=False).input_ids, dtype=np.int64)
    ids: list = []
    mask: list = []
    logp: list = []
    calls_all, results_all, finish = [], [], "length"
    for turn in range(max_turns):
        out = yield np.concatenate([prompt_ids, np.asarray(ids, dtype=np.int64)])
        ids += out.completion_ids.tolist()
        mask += [1.0] * len(out.completion_ids)
        logp += out.logprobs.tolist()
        finish = out.finish_reason
        calls = list(call_hook(tool_parser, "tool_parser", out.text, where=f"rollout {uid}"))
        turn_ids = out.completion_ids.tolist()
        sampled = tokenizer.decode(turn_ids, skip_special_tokens=False)
        # the turn as sampled (special tokens kept), less the special token that closed it, which
        # the template writes itself: re-rendering then reproduces the sampled tokens before the
        # tool output (checked below)
        body = turn_ids[:-1] if turn_ids and turn_ids[-1] in set(tokenizer.all_special_ids) else turn_ids
        content = tokenizer.decode(body, skip_special_tokens=False)
        conv = conv.add_message(Message("assistant", content, tool_calls=tuple(calls) or None))
        if not calls or call_hook(stop_condition, "stop_condition", conv, where=f"rollout {uid}") \
                or turn == max_turns - 1 or out.finish_reason == "length":
            break
        results = [call_hook(tool_executor, "tool_executor", c, where=f"rollout {uid}") for c in calls]
        before = prefix_text + sampled
        with_results = conv
        for res in results:
            with_results = with_results.add_message(Message("tool", res.content, tool_call_id=res.call_id,
                                                            name=res.name))
        after = render_prompt(tokenizer, with_results)
        if not after.startswith(before):
            if body != turn_ids:  # closed by a special token the template does not write (eos, not the
                break             # turn's end): the model ended the text, so the rollout ends here
            raise ValueError("chat template is not prefix-stable across a tool turn; cannot append tool output")
        conv = with_results
        calls_all += calls
        results_all += results
        tool_ids = tokenizer(after[len(before):], add_special_tokens=False).input_ids
        ids += tool_ids
        mask += [0.0] * len(tool_ids)
        logp += [0.0] * len(tool_ids)
        prefix_text = after
    completion = np.asarray(ids, dtype=np.int64)
    # the conversation with its roles, after the prompt item's own metadata (which survives)
    metadata = {**(item.metadata or {}), "turns": len(conv.messages),
                "conversation": [message_to_dict(m) for m in conv.messages]}
    return Rollout(
        uid=uid, group=group_id(item.epoch, item.index),
        prompt=item.prompt, prompt_ids=prompt_ids, completion_ids=completion,
        loss_mask=np.asarray(mask, dtype=np.float32), logprobs=np.asarray(logp, dtype=np.float32),
        policy_version=policy_version, finish_reason=finish,
        text=tokenizer.decode(completion.tolist(), skip_special_tokens=True),
        tool_calls=tuple(calls_all), tool_results=tuple(results_all), answer=item.answer, metadata=metadata,
    )


def multiturn_rollouts(generate_turns: Callable, tokenizer, items, n: int, tools: ToolConfig,
                       policy_version: int = 0) -> list:
    """``n`` tool-using rollouts per item (``multiturn_rollout``), with ``tools``' parser,
    executor and stop condition; every conversation's next turn is generated in one batched call
    of ``generate_turns([context_ids, ...]) -> [GenerationOutput, ...]`` (``hf_turns_generator``,
    an engine's ``turns_generator``)."""
    conversations = [_conversation(it, tokenizer, tools.parser or parse_xml_tool_calls, tools.executor,
                                   tools.stop_condition or no_tool_calls_stop, tools.max_turns, k, policy_version)
                     for it in items for k in range(n)]
    return run_conversations(conversations, generate_turns)


def hf_turn_generator(model, tokenizer, config, generator=None) -> Callable:
    """``generate_turn`` for ``multiturn_rollout`` backed by ``generate_tokens``."""
    from primitives.model.generation import generate_tokens

    def generate_turn(context_ids: np.ndarray) -> GenerationOutput:
        return generate_tokens(model, tokenizer, [context_ids], config, generator)[0]

    return generate_turn


def hf_turns_generator(model, tokenizer, config, generator=None) -> Callable:
    """``generate_turns`` for ``multiturn_rollouts``: the contexts continued in batched ``generate_tokens``
    calls (rows left-padded to the longest of their batch) of ``config.max_batch_rows`` rows at most
    (0: all in one; ``primitives.model.generation.batch_rows``), the weights packed once per call."""
    from primitives.model.generation import generate_tokens, row_batches

    def generate_turns(contexts) -> list:
        contexts = list(contexts)
        if not contexts:
            return generate_tokens(model, tokenizer, contexts, config, generator)  # its error names the empty call
        with row_batches(model, config, len(contexts)) as batches:
            return [out for batch in batches for out in generate_tokens(model, tokenizer, contexts[batch], config,
                                                                          generator)]

    return generate_turns
