"""Prompt and SFT data: local files to records to items, validation, and prompt sources.

Files: JSONL, JSON (an array of objects, or JSON Lines), CSV, Parquet, a directory saved with
``datasets``' ``save_to_disk``, or a directory of such files (split chosen by file name).
Nothing is downloaded. Every record keeps where it came from (``file:line`` for JSONL and
CSV, ``file, row k`` for Parquet and datasets, k counted from 0 as in ``ds[k]``), and every
error names that place, the field, and what would be right - before any Ray work starts
(architecture section 8, invariant 5).

A prompt source is ``prompt_source(position, batch_size) -> (items, next_position)``: it keeps no
state of its own, so resuming is passing the saved ``DataPosition`` back in (architecture section 4).
Each epoch visits every item exactly once in a seeded order.
"""
from __future__ import annotations

import csv
import json
import math
import numbers
import os
import re
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import numpy as np

from primitives.hooks import did_you_mean
from primitives.types import ROLES, Conversation, DataPosition, Message, PromptItem


class FieldMap(NamedTuple):
    """Which record fields make a prompt item.

    A prompt is plain text in ``prompt``, or - when ``messages`` is set - a chat conversation
    (a list of ``{"role", "content"}`` dicts; ``prompt`` is then unused).
    """

    prompt: str = "prompt"  # field holding the prompt text
    answer: Optional[str] = "answer"  # reference answer for verifiers; None: no answer
    messages: Optional[str] = None  # field holding chat messages, instead of ``prompt``
    metadata: Optional[tuple] = None  # fields kept as metadata; None: every other field


class PromptFormat(NamedTuple):
    """How a prompt reaches the model: raw text, or through the model's chat template."""

    chat: bool = False  # True: a Conversation rendered with the chat template; False: raw text
    system_prompt: Optional[str] = None  # prepended as a system message (chat only) unless one is there
    enable_thinking: Optional[bool] = None  # passed to templates that read it (Qwen3-style); None: default


class Records(NamedTuple):
    """Rows of a data file and where each came from."""

    rows: list  # N dicts, field name -> value
    sources: list  # N str: "file:line" (JSONL, CSV) or "file, row k" (Parquet, datasets; k from 0)


class EvalData(NamedTuple):
    """Where eval prompts come from: a separate file, or a seeded held-out part of the train file."""

    path: Optional[str] = None  # eval file or directory; exclusive with ``size``
    split: str = "test"  # split of a datasets directory or of a directory of files, for ``path``
    size: Optional[Union[int, float]] = None  # held-out share of the train items (0 < size < 1) or count (int)
    seed: int = 0  # which train items are held out


DATA_EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet")
SPLIT_NAMES = ("train", "validation", "valid", "val", "test", "dev", "eval")
_NOT_DATA = ("dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json")
_KINDS = "a .jsonl, .json, .csv or .parquet file, or a directory of them or saved with datasets' save_to_disk"


# ----------------------------------------------------------------------------- reading files

def load_records(path: str, split: str = "train") -> Records:
    """Rows of a data file or directory, chosen by extension / directory content.

    ``split`` picks a split of a ``DatasetDict`` directory, or the files of a directory whose
    names contain it (``train.jsonl``, ``data/test-00000-of-00001.parquet``). Raises on a
    missing path, an unreadable or malformed file (naming file and line or row), or no rows.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file not found: {path} (expected {_KINDS})")
    if not os.path.isdir(path):
        records = _read_data_file(path)
    elif _is_saved_dataset(path):
        records = _read_saved_dataset(path, split)
    else:
        parts = [_read_data_file(os.path.join(path, f)) for f in _data_files(path, split)]
        records = Records([r for p in parts for r in p.rows], [s for p in parts for s in p.sources])
    if not records.rows:
        raise ValueError(f"{path}: empty dataset (no rows); expected at least one record")
    return records


def _read_data_file(path: str) -> Records:
    ext = os.path.splitext(path)[1].lower()
    readers = {".jsonl": _read_jsonl_rows, ".json": _read_json_rows, ".csv": _read_csv_rows,
               ".parquet": _read_parquet_rows}
    if ext not in readers:
        raise ValueError(f"{path}: unsupported data file type '{ext}' (expected {', '.join(DATA_EXTENSIONS)})")
    return readers[ext](path)


def _json_object(text: str, where: str) -> dict:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno}); "
                         "expected one JSON object per line") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object {{...}}, got {type(record).__name__}")
    return record


def _read_jsonl_rows(path: str) -> Records:
    """JSON Lines: one object per line; blank lines are skipped; sources are ``file:line``."""
    rows, sources = [], []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{where}: not UTF-8 text; save the file as UTF-8") from None
            if line.strip():
                rows.append(_json_object(line, where))
                sources.append(where)
    return Records(rows, sources)


def _read_json_rows(path: str) -> Records:
    """A ``.json`` file: an array of objects (sources ``file, record k``), else JSON Lines."""
    with open(path, "rb") as f:
        try:
            text = f.read().decode("utf-8-sig")
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text; save the file as UTF-8") from None
    if not text.lstrip().startswith("["):
        return _read_jsonl_rows(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON array of objects or JSON Lines, got {type(data).__name__}")
    sources = [f"{path}, record {k}" for k in range(len(data))]
    for record, where in zip(data, sources):
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object {{...}}, got {type(record).__name__}")
    return Records(data, sources)


def _read_csv_rows(path: str) -> Records:
    """CSV with a header row; values stay text (no type guessing); sources are ``file:line``."""
    rows, sources = [], []
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if header is None:
                return Records([], [])
            if len(set(header)) != len(header) or not all(header):
                raise ValueError(f"{path}:1: the header needs distinct, non-empty column names, got {header}")
            start = reader.line_num + 1
            for values in reader:
                where = f"{path}:{start}"
                start = reader.line_num + 1
                if not values:
                    continue
                if len(values) != len(header):
                    raise ValueError(f"{where}: {len(values)} values for {len(header)} columns "
                                     f"({', '.join(header)}); quote values that contain commas")
                rows.append(dict(zip(header, values)))
                sources.append(where)
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text; save the file as UTF-8") from None
        except csv.Error as e:
            raise ValueError(f"{path}:{reader.line_num}: malformed CSV ({e})") from None
    return Records(rows, sources)


def _read_parquet_rows(path: str) -> Records:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    return Records(rows, [f"{path}, row {k}" for k in range(len(rows))])


def _is_saved_dataset(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, name)) for name in ("dataset_dict.json", "state.json"))


def _read_saved_dataset(path: str, split: str) -> Records:
    """A directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    import datasets

    ds, where = datasets.load_from_disk(path), path
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise KeyError(f"{path}: no split '{split}' (splits: {', '.join(ds)})")
        ds, where = ds[split], f"{path}[{split}]"
    rows = ds.to_list()
    return Records(rows, [f"{where}, row {k}" for k in range(len(rows))])


def _data_files(directory: str, split: str) -> list:
    """Data files under ``directory`` (sorted, relative) for ``split``.

    A file belongs to a split when its path names it as a word (``train.jsonl``,
    ``data/test-00000.parquet``). When no file names any split, all files are the train split.
    """
    found = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.relpath(os.path.join(root, n), directory) for n in names
                  if n.lower().endswith(DATA_EXTENSIONS) and not n.startswith(".") and n not in _NOT_DATA]
    if not found:
        raise ValueError(f"{directory}: no data files ({', '.join(DATA_EXTENSIONS)}) and no datasets "
                         "save_to_disk files (dataset_dict.json, state.json)")
    words = {f: set(re.split(r"[^0-9a-z]+", f.lower())) for f in sorted(found)}
    chosen = [f for f, w in words.items() if split in w]
    if chosen or (split == "train" and not any(w & set(SPLIT_NAMES) for w in words.values())):
        return chosen or list(words)
    raise ValueError(f"{directory}: no data files for split '{split}' (files: {', '.join(words)}); "
                     f"name them after the split, e.g. {split}.jsonl")


# ----------------------------------------------------------------------------- records -> items

class MissingFieldError(KeyError):
    """A record lacks a mapped field. A ``KeyError`` whose message prints without quotes."""

    def __str__(self) -> str:
        return str(self.args[0])


def _field(row: dict, name: str, source: str) -> Any:
    """``row[name]``; a missing field raises naming the fields that exist and the closest one."""
    if name not in row:
        names = sorted(map(str, row))
        hint = did_you_mean(name, names)
        raise MissingFieldError(f"{source}: missing field '{name}' (fields: {', '.join(names)}){hint}")
    return row[name]


def _text(value: Any, name: str, source: str, what: str = "prompt") -> str:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"{source}: empty {what} in field '{name}'")
    if not isinstance(value, str):
        raise ValueError(f"{source}: field '{name}' must be text, got {type(value).__name__} {value!r:.60}")
    return value


def _messages(value: Any, name: str, source: str) -> list:
    """Chat messages as ``[{"role", "content"}]`` dicts, checked; CSV cells may hold them as JSON."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{source}: field '{name}' is text, not a JSON list of messages") from None
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{source}: field '{name}' must be a non-empty list of {{\"role\", \"content\"}} "
                         f"messages, got {value!r:.60}")
    for k, m in enumerate(value):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ValueError(f"{source}: field '{name}', message {k}: expected {{\"role\": one of "
                             f"{'/'.join(ROLES)}, \"content\": text}}, got {m!r:.80}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _with_system(messages: list, system_prompt: Optional[str]) -> list:
    """``messages`` with a system message first when ``system_prompt`` is set and none is there."""
    if system_prompt is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system_prompt}] + messages


def _check_format(uses_messages: bool, fmt: PromptFormat, where: str) -> None:
    if uses_messages and not fmt.chat:
        raise ValueError(f"{where}: chat messages need PromptFormat(chat=True) (the model's chat template); "
                         "for raw text use a prompt field instead")
    if not fmt.chat and (fmt.system_prompt is not None or fmt.enable_thinking is not None):
        raise ValueError("PromptFormat.system_prompt and enable_thinking need chat=True: "
                         "raw-text prompts do not go through a chat template")


def _prompt(row: dict, source: str, fields: FieldMap, fmt: PromptFormat) -> Any:
    """The prompt of one row: raw text, or a Conversation (system prompt first) when ``fmt.chat``."""
    if fields.messages is not None:
        messages = _messages(_field(row, fields.messages, source), fields.messages, source)
        if messages[-1]["role"] == "assistant":
            raise ValueError(f"{source}: field '{fields.messages}' ends with an assistant message; an RL "
                             "prompt ends where the model's turn begins (drop it, or load the file as SFT data)")
    else:
        text = _text(_field(row, fields.prompt, source), fields.prompt, source)
        if not fmt.chat:
            return text
        messages = [{"role": "user", "content": text}]
    messages = _with_system(messages, fmt.system_prompt)
    return Conversation(tuple(Message(m["role"], m["content"]) for m in messages))


def _metadata(row: dict, source: str, fields: FieldMap) -> Optional[dict]:
    if fields.metadata is not None:
        return {name: _field(row, name, source) for name in fields.metadata} or None
    used = (fields.messages if fields.messages is not None else fields.prompt, fields.answer)
    return {k: v for k, v in row.items() if k not in used} or None


def items_from_rows(records: Records, fields: FieldMap = FieldMap(), fmt: PromptFormat = PromptFormat()) -> list:
    """``PromptItem``s (index = row position, source = the row's place) from loaded records."""
    _check_format(fields.messages is not None, fmt, f"FieldMap.messages='{fields.messages}'")
    items = []
    for i, (row, source) in enumerate(zip(records.rows, records.sources)):
        prompt = _prompt(row, source, fields, fmt)
        answer = _field(row, fields.answer, source) if fields.answer is not None else None
        items.append(PromptItem(index=i, prompt=prompt, answer=answer,
                                metadata=_metadata(row, source, fields), source=source))
    return items


def load_prompt_items(path: str, fields: FieldMap = FieldMap(), fmt: PromptFormat = PromptFormat(),
                      split: str = "train") -> list:
    """Prompt items from a data file or directory (``load_records``, then ``items_from_rows``)."""
    return items_from_rows(load_records(path, split), fields, fmt)


def split_eval(items: Sequence, size: float, seed: int = 0) -> tuple:
    """``(train, eval)``: a seeded held-out part of ``items``, both in their original order.

    ``size`` is a share (float, 0 < size < 1, at least one item) or a count (int). Items keep
    their fields (a PromptItem its ``index``), so the same seed always holds out the same ones.
    """
    n = len(items)
    if isinstance(size, bool) or not isinstance(size, (numbers.Integral, numbers.Real)):
        raise TypeError(f"eval size must be a share (0 < size < 1) or a count (int), got {size!r}")
    if isinstance(size, numbers.Integral):
        count = int(size)
    else:  # round half up (round() rounds halves to even: 0.25 and 0.35 of 10 would both give 2 and 4)
        count = max(1, int(math.floor(size * n + 0.5))) if 0 < size < 1 else 0
    if not 1 <= count < n:
        raise ValueError(f"eval size {size!r} of {n} items: need a share 0 < size < 1 or a count "
                         f"1 <= size <= {n - 1}, leaving at least one item for training")
    held = set(np.random.default_rng(seed).permutation(n)[:count].tolist())
    return [it for i, it in enumerate(items) if i not in held], [it for i, it in enumerate(items) if i in held]


def load_train_eval(path: str, fields: FieldMap = FieldMap(), fmt: PromptFormat = PromptFormat(),
                    eval_data: Optional[EvalData] = None, split: str = "train") -> tuple:
    """``(train_items, eval_items)``: eval from ``eval_data.path``, or held out of the train file.

    ``eval_data=None`` means evaluation is off (eval items ``[]``).
    """
    if eval_data is not None and (eval_data.path is None) == (eval_data.size is None):
        raise ValueError("evaluation is on but " + ("no eval set is given" if eval_data.path is None else
                         "both an eval file and an eval size are given") +
                         ": set EvalData.path (a separate file) or EvalData.size (a held-out share or count)")
    items = load_prompt_items(path, fields, fmt, split)
    if eval_data is None:
        return items, []
    if eval_data.size is not None:
        return split_eval(items, eval_data.size, eval_data.seed)
    if eval_data.path is None:  # checked above: a size or a path
        raise ValueError("evaluation is on but no eval set is given")
    if os.path.exists(eval_data.path) and os.path.samefile(path, eval_data.path) and (
            not os.path.isdir(path) or eval_data.split == split):
        raise ValueError(f"{eval_data.path}: the eval set is the training data; give another file or "
                         "split, or EvalData.size to hold out part of it")
    return items, load_prompt_items(eval_data.path, fields, fmt, eval_data.split)


# ----------------------------------------------------------------------------- checks with a tokenizer

def chat_template_kwargs(tokenizer, fmt: PromptFormat) -> dict:
    """Extra chat-template variables for ``render_prompt``: ``{"enable_thinking": bool}`` when set
    and the template reads it (Qwen3-style templates), else ``{}``."""
    template = getattr(tokenizer, "chat_template", None)
    if fmt.enable_thinking is None or "enable_thinking" not in str(template or ""):
        return {}
    return {"enable_thinking": fmt.enable_thinking}


def check_chat_template(tokenizer, what: str = "chat formatting") -> None:
    """Raise when ``tokenizer`` has no chat template (``tokenizer.chat_template is None``)."""
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"{what} needs a chat template, but the tokenizer '{name}' has none "
                         "(tokenizer.chat_template is None); use PromptFormat(chat=False) for raw text, or "
                         "a model whose tokenizer_config.json has a 'chat_template'")


def check_prompt_lengths(items: Sequence[PromptItem], tokenizer, max_prompt_tokens: int,
                         template_kwargs: Optional[dict] = None) -> np.ndarray:
    """Prompt lengths ``(N,) int64`` in tokens as the generator renders them (``render_prompt``);
    raises naming the first item over ``max_prompt_tokens`` (its file:line and length)."""
    from primitives.model.prompts import render_prompt

    if not items:
        raise ValueError("check_prompt_lengths: no prompt items")
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be positive, got {max_prompt_tokens}")
    if any(isinstance(it.prompt, Conversation) for it in items):
        check_chat_template(tokenizer, "a chat-formatted prompt")
    texts = [render_prompt(tokenizer, it.prompt, template_kwargs=template_kwargs) for it in items]
    lengths = np.array([len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids], dtype=np.int64)
    over = np.flatnonzero(lengths > max_prompt_tokens)
    if over.size:
        k = int(over[0])
        where = items[k].source or f"item {items[k].index}"
        raise ValueError(f"{where}: prompt is {lengths[k]} tokens, over max_prompt_tokens={max_prompt_tokens} "
                         f"({over.size} of {len(items)} prompts are, the longest {lengths.max()}); "
                         "raise the limit or shorten or drop those prompts")
    return lengths


# ----------------------------------------------------------------------------- earlier entry points

def read_jsonl(path: str) -> list:
    """Records of a JSONL file; a malformed line raises naming the file and line number."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file not found: {path}")
    records = _read_jsonl_rows(path).rows
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def items_from_records(records: Sequence[dict], fields: FieldMap = FieldMap(), where: str = "records",
                       line_of: Callable[[int], str] = lambda i: f"record {i}") -> list:
    """``PromptItem``s from dict records; a missing or empty field raises naming the record."""
    return items_from_rows(Records(list(records), [f"{where}, {line_of(i)}" for i in range(len(records))]), fields)


def load_prompts_jsonl(path: str, fields: FieldMap = FieldMap()) -> list:
    """Prompt items from a JSONL file whatever its extension (errors name the file and line)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path} (expected a JSONL file)")
    records = _read_jsonl_rows(path)
    if not records.rows:
        raise ValueError(f"{path}: empty dataset (no rows); expected at least one record")
    return items_from_rows(records, fields)


def load_prompts_dataset(path: str, fields: FieldMap = FieldMap(), split: str = "train") -> list:
    """Prompt items from a local file or datasets directory: ``load_prompt_items`` with raw text."""
    return load_prompt_items(path, fields, split=split)


# ----------------------------------------------------------------------------- prompt sources

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
    out: list = []
    epoch, offset = position.epoch, position.offset
    while len(out) < batch_size:
        order = epoch_order(len(items), epoch, seed, shuffle)
        take = order[offset: offset + batch_size - len(out)]
        out.extend(items[int(i)]._replace(epoch=epoch) for i in take)
        offset += len(take)
        if offset >= len(items):
            epoch, offset = epoch + 1, 0
    return out, DataPosition(epoch, offset)


def as_prompt_items(prompts: Sequence) -> list:
    """``PromptItem``s of ``prompts``: items pass through; a bare prompt (a str or a
    ``Conversation``, as the seeds keep prompts) becomes ``PromptItem(index=i, prompt=p)``
    with ``i`` its position in ``prompts``, so each prompt has its own uid and group. Indices
    must be distinct: two items of one index would share uids and a group."""
    items = []
    for i, p in enumerate(prompts):
        if isinstance(p, PromptItem):
            items.append(p)
        elif isinstance(p, (str, Conversation)):
            items.append(PromptItem(index=i, prompt=p))
        else:
            raise ValueError(f"prompt {i}: {type(p).__name__} is not a prompt; expected a str, a "
                             f"primitives.types.Conversation or a PromptItem")
    seen: dict = {}
    for k, it in enumerate(items):
        if it.index in seen:
            raise ValueError(f"prompts {seen[it.index]} and {k} have the same index {it.index}: their rollouts "
                             f"would share uids and a group (give each item its own index)")
        seen[it.index] = k
    return items


def make_prompt_source(items: Sequence, seed: int = 0, shuffle: bool = True):
    """``prompt_source(position, batch_size) -> (items, next_position)`` over ``items``
    (``PromptItem``s, or bare prompts - str or ``Conversation`` - numbered by position)."""
    items = as_prompt_items(items)
    if not items:
        raise ValueError("make_prompt_source: empty prompt list")

    def prompt_source(position: DataPosition, batch_size: int):
        return take_prompts(items, position, batch_size, seed, shuffle)

    return prompt_source


def prompt_source_from_loader(loader: Callable[[int], Sequence]) -> Callable:
    """The seeds' ``prompt_loader(iteration) -> prompts`` as a prompt source
    (``prompt_source(position, n) -> (items, position)``).

    The position's ``offset`` is the loader's iteration: each step calls ``loader(offset)``
    once and takes every prompt it returns (``n`` is not consulted: the loader decides how
    many), and the position after is ``offset + 1``, so resuming from a saved position calls
    the loader where it stopped. The prompts of call ``k`` are served as epoch ``k`` (item
    ``j`` has uid ``e{k}/i{j}/s{sample}``): every call's prompts are distinct rollouts, even
    when the loader repeats a prompt text. The loader should be a function of its iteration
    alone (no hidden counter: seeds README error 9)."""
    from primitives.hooks import check_arity

    check_arity(loader, "prompt_loader", 0)

    def prompt_source(position: DataPosition, n: int):
        iteration = position.offset
        prompts = list(loader(iteration))
        if not prompts:
            raise ValueError(f"prompt_loader returned no prompts at iteration {iteration}")
        items = [it._replace(epoch=iteration) for it in as_prompt_items(prompts)]
        return items, DataPosition(0, iteration + 1)

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


# ----------------------------------------------------------------------------- SFT files

class SFTFields(NamedTuple):
    """Which record fields make an SFT example: chat ``messages``, or a prompt/completion pair."""

    prompt: str = "prompt"  # field holding the prompt text
    completion: str = "completion"  # field holding the target text
    messages: Optional[str] = None  # field holding chat messages, instead of prompt/completion


def _sft_messages(row: dict, source: str, fields: SFTFields, fmt: PromptFormat) -> list:
    """The row as chat messages (system prompt first when set); at least one assistant turn."""
    if fields.messages is None:
        prompt = _text(_field(row, fields.prompt, source), fields.prompt, source)
        completion = _text(_field(row, fields.completion, source), fields.completion, source, "completion")
        return _with_system([{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
                            fmt.system_prompt)
    messages = _messages(_field(row, fields.messages, source), fields.messages, source)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{source}: field '{fields.messages}' has no assistant message: nothing to train on")
    return _with_system(messages, fmt.system_prompt)


def _sft_sample_from_row(row: dict, source: str, tokenizer, fields: SFTFields = SFTFields(),
                         fmt: PromptFormat = PromptFormat(), max_len: Optional[int] = None) -> SFTSample:
    """One ``SFTSample`` (loss on completion / assistant tokens only); errors name ``source``."""
    try:
        if fmt.chat:
            sample = prepare_sft_chat(tokenizer, _sft_messages(row, source, fields, fmt), max_len)
        else:
            prompt = _text(_field(row, fields.prompt, source), fields.prompt, source)
            completion = _text(_field(row, fields.completion, source), fields.completion, source, "completion")
            sample = prepare_sft_text(tokenizer, prompt, completion, max_len)
    except ValueError as e:
        if str(e).startswith(source):
            raise
        raise ValueError(f"{source}: {e}") from e
    if not sample.loss_mask.any():
        raise ValueError(f"{source}: no completion tokens within max_len={max_len} (the sample is "
                         f"{len(sample.input_ids)} tokens, all prompt); raise max_len or shorten the prompt")
    return sample


def _check_sft_format(tokenizer, fields: SFTFields, fmt: PromptFormat) -> None:
    _check_format(fields.messages is not None, fmt, f"SFTFields.messages='{fields.messages}'")
    if fmt.chat:
        check_chat_template(tokenizer, "SFT on chat data")


def sft_samples_from_records(records: Records, tokenizer, fields: SFTFields = SFTFields(),
                             fmt: PromptFormat = PromptFormat(), max_len: Optional[int] = None) -> list:
    """``SFTSample``s of loaded records (loss on completion / assistant tokens only); a bad row
    raises naming its source (file:line)."""
    _check_sft_format(tokenizer, fields, fmt)
    return [_sft_sample_from_row(row, source, tokenizer, fields, fmt, max_len)
            for row, source in zip(records.rows, records.sources)]


def load_sft_samples(path: str, tokenizer, fields: SFTFields = SFTFields(), fmt: PromptFormat = PromptFormat(),
                     max_len: Optional[int] = None, split: str = "train") -> list:
    """``SFTSample``s from a data file or directory (same kinds and errors as ``load_records``).

    Prompt/completion pairs are raw text (``prepare_sft_text``) or, with ``fmt.chat``, a user and
    an assistant turn; chat ``messages`` need ``fmt.chat`` (``prepare_sft_chat``).
    """
    _check_sft_format(tokenizer, fields, fmt)
    return sft_samples_from_records(load_records(path, split), tokenizer, fields, fmt, max_len)
