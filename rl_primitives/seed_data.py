"""The plan's SFT data preparation (seeds/004, ``rollouts.training.sample_prep``):
``tokenize_conversation`` and ``compute_loss_mask`` turn a chat into the token ids and the mask of
a ``Sample``, and ``load_sft_samples`` reads a data file into ``Sample``s, over this project's SFT
data functions (``primitives.io.data``). Loss falls on what the assistant says, nothing else: the
system and user turns, tool output and the chat template's own headers are masked."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from primitives.io.data import (
    PromptFormat,
    SFTFields,
    check_chat_template,
    load_records,
    prepare_sft_chat,
    sft_samples_from_records,
)
from rl_primitives.plan import Sample


def tokenize_conversation(conversation: Sequence[dict], tokenizer, max_len: Optional[int] = None) -> tuple:
    """``(tokens, user_spans)`` of a chat (``[{"role", "content"}, ...]``) rendered by the
    tokenizer's chat template: the token ids (a list of ints), and the ``(start, end)`` spans
    (end exclusive) of the tokens not to learn from - every token but what the assistant says
    (``primitives.io.data.prepare_sft_chat``; the seeds' name says "user", the spans hold the
    template's headers and system and tool turns too). ``compute_loss_mask(tokens, user_spans)``
    gives the mask back."""
    check_chat_template(tokenizer, "tokenize_conversation")
    sample = prepare_sft_chat(tokenizer, [dict(m) for m in conversation], max_len)
    spans, start = [], None
    for i, learn in enumerate(sample.loss_mask.tolist() + [1.0]):
        if learn == 0 and start is None:
            start = i
        elif learn != 0 and start is not None:
            spans.append((start, i))
            start = None
    return sample.input_ids.tolist(), spans


def compute_loss_mask(tokens: Sequence[int], user_spans: Sequence[tuple]) -> list:
    """1 for each token to learn from, 0 inside the ``(start, end)`` spans (end exclusive); a span
    outside the tokens is refused by its index."""
    mask = [1] * len(tokens)
    for k, (start, end) in enumerate(user_spans):
        if not 0 <= start <= end <= len(tokens):
            raise ValueError(f"compute_loss_mask: span {k} ({start}, {end}) is outside the {len(tokens)} tokens")
        mask[start:end] = [0] * (end - start)
    return mask


def load_sft_samples(path: str, tokenizer=None, fields: Optional[SFTFields] = None,
                     fmt: Optional[PromptFormat] = None, max_len: Optional[int] = None, split: str = "train") -> list:
    """The plan's ``load_sft_samples("dataset.jsonl")``: a data file or directory (JSONL, JSON, CSV,
    Parquet, a saved dataset) as ``Sample``s (``input_ids``, ``labels`` = the ids, ``loss_mask``).
    Rows with ``messages`` are chats through the chat template (``fields``/``fmt`` say otherwise);
    rows of ``prompt`` and ``completion`` are text, with the loss on the completion and its EOS
    (``primitives.io.data.load_sft_samples``). Tokens need a tokenizer, which the seeds' call
    leaves out: without one it is refused before the file is read. A bad row is named by file and
    line."""
    if tokenizer is None:
        raise TypeError(f"load_sft_samples({path!r}): a Sample holds token ids, so loading needs the tokenizer: "
                        f"load_sft_samples({path!r}, tokenizer)")
    records = load_records(path, split)
    if fields is None:  # a file of chats has messages in its first row; a row without them is then named
        chat = bool(records.rows) and "messages" in records.rows[0]
        fields = SFTFields(messages="messages") if chat else SFTFields()
        fmt = fmt or PromptFormat(chat=chat)
    out = []
    for s in sft_samples_from_records(records, tokenizer, fields, fmt or PromptFormat(), max_len):
        ids = torch.as_tensor(s.input_ids)
        out.append(Sample(ids, ids.clone(), torch.as_tensor(np.asarray(s.loss_mask, dtype=np.float32))))
    return out
