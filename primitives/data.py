"""Prompt sources with an explicit position, and SFT sample preparation.

A prompt source is ``prompt_source(position, batch_size) -> (items, next_position)``: it keeps no
state of its own, so resuming is passing the saved ``DataPosition`` back in (DESIGN section 4).
Each epoch visits every item exactly once in a seeded order.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from primitives.types import DataPosition


class PromptItem(NamedTuple):
    """One task item. ``epoch`` is set by the prompt source when the item is served."""

    index: int  # position in the dataset: with epoch, the stable identity of the prompt
    prompt: Any  # str, or a Conversation for chat models
    answer: Any = None  # reference answer for verifiable rewards
    epoch: int = 0
    metadata: Optional[dict] = None


class FieldMap(NamedTuple):
    """Which record fields hold the prompt and the answer (``answer=None``: no answer)."""

    prompt: str = "prompt"
    answer: Optional[str] = "answer"


def read_jsonl(path: str) -> list:
    """Records of a JSONL file; a malformed line raises naming the file and line number."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file not found: {path}")
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def items_from_records(records: Sequence[dict], fields: FieldMap = FieldMap(), where: str = "records",
                       line_of: Callable[[int], str] = lambda i: f"record {i}") -> list:
    """``PromptItem``s from dict records; a missing or empty field raises naming the record."""
    items = []
    for i, record in enumerate(records):
        for name in (fields.prompt, fields.answer):
            if name is not None and name not in record:
                raise KeyError(f"{where}, {line_of(i)}: missing field '{name}' (has: {sorted(record)})")
        prompt = record[fields.prompt]
        if prompt is None or (isinstance(prompt, str) and not prompt.strip()):
            raise ValueError(f"{where}, {line_of(i)}: empty prompt in field '{fields.prompt}'")
        answer = record[fields.answer] if fields.answer is not None else None
        extra = {k: v for k, v in record.items() if k not in (fields.prompt, fields.answer)}
        items.append(PromptItem(index=i, prompt=prompt, answer=answer, metadata=extra or None))
    return items


def load_prompts_jsonl(path: str, fields: FieldMap = FieldMap()) -> list:
    """Prompt items from a JSONL file (errors name the file and line)."""
    records = read_jsonl(path)
    # read_jsonl skips blank lines; report 1-based record numbers against the file.
    return items_from_records(records, fields, where=path, line_of=lambda i: f"record {i + 1}")


def load_prompts_dataset(path: str, fields: FieldMap = FieldMap(), split: str = "train") -> list:
    """Prompt items from local files through HF ``datasets`` (json/jsonl/csv/parquet, or a
    directory saved with ``save_to_disk``). Nothing is downloaded."""
    import datasets

    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset path not found: {path}")
    if os.path.isdir(path):
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise KeyError(f"{path}: no split '{split}' (has: {list(ds)})")
            ds = ds[split]
    else:
        ext = os.path.splitext(path)[1].lstrip(".")
        builder = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}.get(ext)
        if builder is None:
            raise ValueError(f"{path}: unsupported dataset file type '.{ext}' (json, jsonl, csv, parquet)")
        ds = datasets.load_dataset(builder, data_files=path, split="train")
    for name in (fields.prompt, fields.answer):
        if name is not None and name not in ds.column_names:
            raise KeyError(f"{path}: missing field '{name}' (columns: {ds.column_names})")
    return items_from_records(list(ds), fields, where=path)


def epoch_order(num_items: int, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """The order of item indices in ``epoch``: a seeded permutation (identity if not shuffled)."""
    if not shuffle:
        return np.arange(num_items)
    return np.random.default_rng([seed, epoch]).permutation(num_items)


def take_prompts(items: Sequence[PromptItem], position: DataPosition, batch_size: int,
                 seed: int = 0, shuffle: bool = True):
    """The next ``batch_size`` items from ``position`` and the position after them.

    Batches run across epoch boundaries; each served item carries its epoch, so
    (epoch, index) identifies it exactly.
    """
    if not items:
        raise ValueError("empty prompt list")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    out, epoch, offset = [], position.epoch, position.offset
    while len(out) < batch_size:
        order = epoch_order(len(items), epoch, seed, shuffle)
        take = order[offset: offset + batch_size - len(out)]
        out.extend(items[int(i)]._replace(epoch=epoch) for i in take)
        offset += len(take)
        if offset >= len(items):
            epoch, offset = epoch + 1, 0
    return out, DataPosition(epoch, offset)


def make_prompt_source(items: Sequence[PromptItem], seed: int = 0, shuffle: bool = True):
    """``prompt_source(position, batch_size) -> (items, next_position)`` over ``items``."""
    items = list(items)
    if not items:
        raise ValueError("make_prompt_source: empty prompt list")

    def prompt_source(position: DataPosition, batch_size: int):
        return take_prompts(items, position, batch_size, seed, shuffle)

    return prompt_source


# ----------------------------------------------------------------------------- SFT samples

class SFTSample(NamedTuple):
    input_ids: np.ndarray  # (L,) int64
    loss_mask: np.ndarray  # (L,) float32: 1 where the token is a training target


def prepare_sft_text(tokenizer, prompt: str, completion: str, max_len: Optional[int] = None) -> SFTSample:
    """Plain text: loss on the completion tokens and the closing eos, not on the prompt."""
    p = tokenizer(prompt, add_special_tokens=False).input_ids
    c = tokenizer(completion, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    if not p:
        raise ValueError(f"empty prompt for SFT sample with completion {completion!r}")
    return _sft_sample(p + c, [0.0] * len(p) + [1.0] * len(c), max_len)


def prepare_sft_chat(tokenizer, messages: Sequence[dict], max_len: Optional[int] = None) -> SFTSample:
    """Chat: render with the tokenizer's chat template; loss only on assistant turns.

    The tokens an assistant message adds after its generation header are targets;
    system, user and tool turns and the headers themselves are not.
    """
    def render(msgs, gen):
        return tokenizer.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=gen)

    ids, mask, done = [], [], ""
    for i, m in enumerate(messages):
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"message {i}: unknown role {m.get('role')!r}")
        if m["role"] == "assistant":
            header = render(messages[:i], True)
            full = render(messages[: i + 1], False)
            pieces = [(header, 0.0), (full, 1.0)]
        else:
            pieces = [(render(messages[: i + 1], False), 0.0)]
        for text, weight in pieces:
            if not text.startswith(done):
                raise ValueError(f"message {i}: chat template is not prefix-stable; cannot mask turns")
            new = tokenizer(text[len(done):], add_special_tokens=False).input_ids
            ids += new
            mask += [weight] * len(new)
            done = text
    return _sft_sample(ids, mask, max_len)


def _sft_sample(ids, mask, max_len):
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return SFTSample(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.float32))


def collate_sft(samples: Sequence[SFTSample], pad_id: int):
    """Right-pad SFT samples: ``(input_ids (B, L), attention_mask (B, L), loss_mask (B, L))`` numpy."""
    if not samples:
        raise ValueError("collate_sft: no samples")
    L = max(len(s.input_ids) for s in samples)
    ids = np.full((len(samples), L), pad_id, dtype=np.int64)
    attn = np.zeros((len(samples), L), dtype=np.int64)
    loss = np.zeros((len(samples), L), dtype=np.float32)
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        ids[i, :n], attn[i, :n], loss[i, :n] = s.input_ids, 1, s.loss_mask
    return ids, attn, loss
