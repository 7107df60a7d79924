"""The text a model continues: a str as is, a ``Conversation`` through the tokenizer's chat
template (tool schemas and template variables passed on), and its token ids."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from primitives.types import Conversation, Message


def message_to_dict(m: Message) -> dict:
    d: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        d["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    return d


def render_prompt(tokenizer, prompt: Any, tools: Optional[list] = None,
                  template_kwargs: Optional[dict] = None) -> str:
    """Text the model continues: a str as is; a Conversation through the chat template.

    ``template_kwargs``: extra template variables, e.g. ``{"enable_thinking": False}``
    (``primitives.io.data.chat_template_kwargs`` builds them)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt")
        return prompt
    if isinstance(prompt, Conversation):
        if not prompt.messages:
            raise ValueError("empty conversation")
        if tokenizer.chat_template is None:
            raise ValueError("a Conversation prompt needs a tokenizer with a chat template")
        msgs = [message_to_dict(m) for m in prompt.messages]
        kwargs = dict(template_kwargs or {}, **({"tools": tools} if tools else {}))
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    raise TypeError(f"prompt must be str or Conversation, got {type(prompt).__name__}")


def encode_prompts(tokenizer, prompts: Sequence[Any], template_kwargs: Optional[dict] = None) -> list:
    """Token ids (numpy int64) of each rendered prompt."""
    out = []
    for i, p in enumerate(prompts):
        text = render_prompt(tokenizer, p, template_kwargs=template_kwargs)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if not ids:
            raise ValueError(f"prompt {i} encodes to no tokens: {p!r}")
        out.append(np.asarray(ids, dtype=np.int64))
    return out
