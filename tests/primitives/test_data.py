"""Data: local files (JSONL, JSON, CSV, Parquet, datasets directories) to prompt items and SFT
samples, field mapping, chat formatting, eval splits, validation errors; prompt sources."""
import json

import numpy as np
import pytest

from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task, needs_carry, sft_demonstrations
from primitives.fixtures.tiny import CHAT_TEMPLATE, build_char_tokenizer
from primitives.io.data import (
    EvalData,
    FieldMap,
    PromptFormat,
    PromptItem,
    Records,
    SFTFields,
    chat_template_kwargs,
    check_prompt_lengths,
    collate_sft,
    items_from_records,
    items_from_rows,
    load_prompt_items,
    load_prompts_dataset,
    load_prompts_jsonl,
    load_records,
    load_sft_samples,
    load_train_eval,
    make_prompt_source,
    prepare_sft_chat,
    prepare_sft_text,
    split_eval,
    take_prompts,
)
from primitives.model.prompts import render_prompt
from primitives.types import Conversation, DataPosition, Message

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M-Instruct's BPE tokenizer and chat template, read from the embedded GGUF (a few s)."""
    from transformers import AutoTokenizer

    from primitives.fixtures.pretrained import smollm2_gguf

    directory, name = smollm2_gguf()
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture()
def no_template():
    tok = build_char_tokenizer()
    tok.chat_template = None
    return tok


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _jsonl(path, rows):
    return _write(path, [json.dumps(r) for r in rows])


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


# ----------------------------------------------------------------------------- file kinds

def test_jsonl_loading_and_field_mapping(tmp_path):
    p = _write(tmp_path / "d.jsonl", [json.dumps({"q": "1+1=", "a": "2", "src": "x"}), "",
                                      json.dumps({"q": "2+2=", "a": "4"})])
    items = load_prompts_jsonl(p, FieldMap(prompt="q", answer="a"))
    assert [(i.index, i.prompt, i.answer) for i in items] == [(0, "1+1=", "2"), (1, "2+2=", "4")]
    assert items[0].metadata == {"src": "x"} and items[1].metadata is None
    assert [i.source for i in items] == [f"{p}:1", f"{p}:3"]  # the blank line 2 still counts
    assert load_prompt_items(p, FieldMap(prompt="q", answer="a")) == items


def test_jsonl_errors_name_file_and_line(tmp_path):
    p = _write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "a", "answer": 1}), "{not json"])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: malformed JSON"):
        load_prompts_jsonl(p)
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: malformed JSON \(Expecting property name"):
        load_prompt_items(p)
    p = _write(tmp_path / "miss.jsonl", [json.dumps({"prompt": "a", "answer": 1}), json.dumps({"prompt": "b"})])
    with pytest.raises(KeyError, match=r"miss\.jsonl:2: missing field 'answer' \(fields: prompt\)$"):
        load_prompts_jsonl(p)
    p = _write(tmp_path / "empty.jsonl", [json.dumps({"prompt": "  ", "answer": 1})])
    with pytest.raises(ValueError, match=r"empty\.jsonl:1: empty prompt in field 'prompt'"):
        load_prompts_jsonl(p)
    with pytest.raises(FileNotFoundError, match=r"data file not found: .*nope\.jsonl \(expected a JSONL file\)"):
        load_prompts_jsonl(str(tmp_path / "nope.jsonl"))
    p = _write(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=r"list\.jsonl:1: expected a JSON object"):
        load_prompts_jsonl(p)
    p = tmp_path / "latin.jsonl"
    p.write_bytes(b'{"prompt": "a", "answer": 1}\n{"prompt": "caf\xe9", "answer": 2}\n')
    with pytest.raises(ValueError, match=r"latin\.jsonl:2: not UTF-8 text"):
        load_prompt_items(str(p))
    p = _write(tmp_path / "num.jsonl", [json.dumps({"prompt": 12, "answer": 1})])
    with pytest.raises(ValueError, match=r"num\.jsonl:1: field 'prompt' must be text, got int 12"):
        load_prompt_items(p)


def test_csv_values_stay_text_and_rows_name_their_line(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text('question,answer,level\n1+1=,2,easy\n"say ""hi"", then\nstop",hi,hard\n\n3+3=,6,easy\n')
    records = load_records(str(p))
    assert records.rows == [{"question": "1+1=", "answer": "2", "level": "easy"},
                            {"question": 'say "hi", then\nstop', "answer": "hi", "level": "hard"},
                            {"question": "3+3=", "answer": "6", "level": "easy"}]
    assert records.sources == [f"{p}:2", f"{p}:3", f"{p}:6"]  # a quoted row spans lines 3-4; line 5 is blank
    items = load_prompt_items(str(p), FieldMap("question", "answer"))
    assert [(i.index, i.answer, i.metadata) for i in items] == [(0, "2", {"level": "easy"}),
                                                                (1, "hi", {"level": "hard"}),
                                                                (2, "6", {"level": "easy"})]
    bad = tmp_path / "bad.csv"
    bad.write_text("q,a\n1,2\n3,4,5\n")
    with pytest.raises(ValueError, match=r"bad\.csv:3: 3 values for 2 columns \(q, a\); quote values"):
        load_records(str(bad))
    header_only = tmp_path / "h.csv"
    header_only.write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"h\.csv: empty dataset \(no rows\)"):
        load_records(str(header_only))


def test_parquet_rows(tmp_path):
    p = _parquet(tmp_path / "d.parquet", [{"prompt": "1+1=", "answer": 2, "tags": ["a", "b"]},
                                          {"prompt": "2+5=", "answer": 7, "tags": []}])
    items = load_prompt_items(p)
    assert items == [PromptItem(0, "1+1=", 2, metadata={"tags": ["a", "b"]}, source=f"{p}, row 0"),
                     PromptItem(1, "2+5=", 7, metadata={"tags": []}, source=f"{p}, row 1")]
    p = _parquet(tmp_path / "null.parquet", [{"prompt": "1+1=", "answer": 2}, {"prompt": None, "answer": 3}])
    with pytest.raises(ValueError, match=r"null\.parquet, row 1: empty prompt in field 'prompt'"):
        load_prompt_items(p)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"this is not parquet")
    with pytest.raises(ValueError, match=r"junk\.parquet: not a readable Parquet file"):
        load_records(str(junk))


def test_json_array_file(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}], indent=1))
    assert load_records(str(p)) == Records([{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}],
                                           [f"{p}, record 0", f"{p}, record 1"])
    p.write_text('[{"prompt": "a"},\n "b"]')
    with pytest.raises(ValueError, match=r"d\.json, record 1: expected a JSON object"):
        load_records(str(p))
    p.write_text('[{"prompt": "a"},\n {"prompt": }]')
    with pytest.raises(ValueError, match=r"d\.json:2: malformed JSON"):
        load_records(str(p))
    p.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": 2}\n')  # JSON Lines named .json
    assert [i.prompt for i in load_prompt_items(str(p))] == ["a", "b"]


def test_hf_datasets_local_files(tmp_path):
    rows = [{"question": f"{i}+1=", "solution": str(i + 1)} for i in range(5)]
    p = _write(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    items = load_prompts_dataset(p, FieldMap("question", "solution"))
    assert [(i.prompt, i.answer) for i in items] == [(r["question"], r["solution"]) for r in rows]
    csv = tmp_path / "d.csv"
    csv.write_text("question,solution\n1+1=,2\n")
    assert load_prompts_dataset(str(csv), FieldMap("question", "solution"))[0].prompt == "1+1="
    with pytest.raises(KeyError, match="missing field 'prompt'"):
        load_prompts_dataset(p)
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert len(load_prompts_dataset(str(tmp_path / "saved"), FieldMap("question", "solution"))) == 5


def test_saved_dataset_dict_splits(tmp_path):
    import datasets

    d = str(tmp_path / "dd")
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a", "answer": 1}] * 3),
                          "test": datasets.Dataset.from_list([{"prompt": "t", "answer": 9}])}).save_to_disk(d)
    assert load_records(d).sources == [f"{d}[train], row {k}" for k in range(3)]
    assert load_records(d, split="test") == Records([{"prompt": "t", "answer": 9}], [f"{d}[test], row 0"])
    with pytest.raises(KeyError, match=r"dd: no split 'validation' \(splits: train, test\)"):
        load_records(d, split="validation")


def test_directory_of_data_files(tmp_path):
    split_dir = tmp_path / "split"
    (split_dir / "data").mkdir(parents=True)
    _jsonl(split_dir / "data" / "train.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}])
    (split_dir / "data" / "test.csv").write_text("prompt,answer\nt,9\n")
    (split_dir / "README.md").write_text("not data")
    train = load_prompt_items(str(split_dir))
    assert [(i.index, i.prompt, i.source) for i in train] == [
        (0, "a", f"{split_dir}/data/train.jsonl:1"), (1, "b", f"{split_dir}/data/train.jsonl:2")]
    assert load_records(str(split_dir), split="test").rows == [{"prompt": "t", "answer": "9"}]
    with pytest.raises(ValueError, match=r"no data files for split 'validation' \(files: data/test\.csv, "
                                         r"data/train\.jsonl\); name them after the split"):
        load_records(str(split_dir), split="validation")
    # no file names a split: all files, in path order, are the train split (and only that)
    parts = tmp_path / "parts"
    parts.mkdir()
    _jsonl(parts / "part-1.jsonl", [{"prompt": "x", "answer": 0}])
    _parquet(parts / "part-0.parquet", [{"prompt": "y", "answer": 1}])
    assert [(i.index, i.prompt) for i in load_prompt_items(str(parts))] == [(0, "y"), (1, "x")]
    with pytest.raises(ValueError, match="no data files for split 'test'"):
        load_records(str(parts), split="test")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: no data files \(\.jsonl, \.json, \.csv, \.parquet\)"):
        load_records(str(tmp_path / "empty"))


def test_missing_empty_and_unsupported_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data file not found: .*nope\.parquet \(expected a \.jsonl"):
        load_records(str(tmp_path / "nope.parquet"))
    with pytest.raises(ValueError, match=r"d\.txt: unsupported data file type '\.txt' \(expected \.jsonl, "
                                         r"\.json, \.csv, \.parquet\)"):
        load_records(_write(tmp_path / "d.txt", ["x"]))
    with pytest.raises(ValueError, match=r"blank\.jsonl: empty dataset \(no rows\); expected at least one"):
        load_records(_write(tmp_path / "blank.jsonl", ["", "  "]))


def test_missing_field_names_existing_fields_and_closest(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"question": "1+1=", "answer": "2", "id": 7}])
    with pytest.raises(KeyError, match=r"d\.jsonl:1: missing field 'questoin' \(fields: answer, id, question\); "
                                       r"did you mean 'question'\?$"):
        load_prompt_items(p, FieldMap(prompt="questoin"))
    with pytest.raises(KeyError, match=r"d\.jsonl:1: missing field 'prompt' \(fields: answer, id, question\)$"):
        load_prompt_items(p)
    with pytest.raises(KeyError, match=r"d\.jsonl:1: missing field 'solution' .*did you mean"):
        load_prompt_items(p, FieldMap("question", answer="solution", metadata=()))


def test_metadata_fields(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"q": "1+1=", "a": "2", "id": 7, "level": "easy"}])
    assert load_prompt_items(p, FieldMap("q", "a"))[0].metadata == {"id": 7, "level": "easy"}
    assert load_prompt_items(p, FieldMap("q", "a", metadata=("level",)))[0].metadata == {"level": "easy"}
    assert load_prompt_items(p, FieldMap("q", "a", metadata=()))[0].metadata is None
    assert load_prompt_items(p, FieldMap("q", None))[0] == PromptItem(
        0, "1+1=", None, metadata={"a": "2", "id": 7, "level": "easy"}, source=f"{p}:1")
    with pytest.raises(KeyError, match=r"d\.jsonl:1: missing field 'lvl' .*did you mean 'level'"):
        load_prompt_items(p, FieldMap("q", "a", metadata=("lvl",)))


# ----------------------------------------------------------------------------- chat formatting

def test_chat_prompts_system_prompt_and_messages(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    sys_user = Conversation((Message("system", "Be brief."), Message("user", "1+1=")))
    assert load_prompt_items(p, fmt=PromptFormat(chat=True, system_prompt="Be brief."))[0].prompt == sys_user
    assert load_prompt_items(p, fmt=PromptFormat(chat=True))[0].prompt == Conversation((Message("user", "1+1="),))
    msgs = [{"role": "user", "content": "hi"}]
    p = _jsonl(tmp_path / "m.jsonl", [{"messages": msgs, "answer": "x"},
                                      {"messages": [{"role": "system", "content": "Own."}] + msgs, "answer": "y"}])
    items = load_prompt_items(p, FieldMap(messages="messages"), PromptFormat(chat=True, system_prompt="Be brief."))
    assert [i.prompt for i in items] == [Conversation((Message("system", "Be brief."), Message("user", "hi"))),
                                         Conversation((Message("system", "Own."), Message("user", "hi")))]
    assert items[0].metadata is None and items[1].answer == "y"
    c = tmp_path / "m.csv"  # a CSV cell holds the messages as JSON text
    c.write_text('messages,answer\n"[{""role"": ""user"", ""content"": ""hi""}]",x\n')
    assert load_prompt_items(str(c), FieldMap(messages="messages"), PromptFormat(chat=True))[0].prompt == \
        Conversation((Message("user", "hi"),))


def test_chat_format_errors(tmp_path):
    p = _jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "hi"}]},
                                      {"messages": [{"role": "robot", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"messages='messages': chat messages need PromptFormat\(chat=True\)"):
        load_prompt_items(p, FieldMap(messages="messages", answer=None))
    with pytest.raises(ValueError, match=r"system_prompt and enable_thinking need chat=True"):
        load_prompt_items(p, fmt=PromptFormat(system_prompt="x"))
    chat = (FieldMap(messages="messages", answer=None), PromptFormat(chat=True))
    with pytest.raises(ValueError, match=r"m\.jsonl:2: field 'messages', message 0: expected \{\"role\": one of "
                                         r"system/user/assistant/tool, \"content\": text\}, got \{'role': 'robot'"):
        load_prompt_items(p, *chat)
    p = _jsonl(tmp_path / "s.jsonl", [{"messages": "hello"}])
    with pytest.raises(ValueError, match=r"s\.jsonl:1: field 'messages' is text, not a JSON list of messages"):
        load_prompt_items(p, *chat)
    p = _jsonl(tmp_path / "e.jsonl", [{"messages": []}])
    with pytest.raises(ValueError, match=r"e\.jsonl:1: field 'messages' must be a non-empty list"):
        load_prompt_items(p, *chat)
    p = _jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "yo"}]}])
    with pytest.raises(ValueError, match=r"a\.jsonl:1: field 'messages' ends with an assistant message"):
        load_prompt_items(p, *chat)


def test_chat_rendering_with_smollm2(smol, tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": "What is 2+2?", "answer": "4"}])
    item = load_prompt_items(p, fmt=PromptFormat(chat=True, system_prompt="Be brief."))[0]
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(smol, item.prompt) == text
    plain = load_prompt_items(p, fmt=PromptFormat(chat=True))[0]  # SmolLM2's template adds its own system turn
    assert render_prompt(smol, plain.prompt) == SMOL_SYSTEM + text[text.index("<|im_start|>user"):]
    n = len(smol(text, add_special_tokens=False).input_ids)
    assert check_prompt_lengths([item], smol, max_prompt_tokens=n).tolist() == [n]
    with pytest.raises(ValueError, match=rf"d\.jsonl:1: prompt is {n} tokens, over max_prompt_tokens={n - 1} "
                                         rf"\(1 of 1 prompts are, the longest {n}\)"):
        check_prompt_lengths([item], smol, max_prompt_tokens=n - 1)
    # SmolLM2's template does not read enable_thinking, so nothing is passed
    assert chat_template_kwargs(smol, PromptFormat(chat=True, enable_thinking=False)) == {}


def test_enable_thinking_reaches_templates_that_read_it(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE + ("{% if add_generation_prompt and enable_thinking is defined and "
                                         "not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}")
    assert chat_template_kwargs(tok, PromptFormat(chat=True)) == {}
    kwargs = chat_template_kwargs(tok, PromptFormat(chat=True, enable_thinking=False))
    assert kwargs == {"enable_thinking": False}
    item = PromptItem(0, Conversation((Message("user", "hi"),)), source="q.jsonl:1")
    base = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(tok, item.prompt) == base
    assert render_prompt(tok, item.prompt, template_kwargs=kwargs) == base + "<think>\n\n</think>\n\n"
    # char tokens: 2 specials + "user\nhi" (7) + "\n" + 1 special + "assistant\n" (10) = 21; the think block adds 19
    assert check_prompt_lengths([item], tok, 100).tolist() == [21]
    assert check_prompt_lengths([item], tok, 100, template_kwargs=kwargs).tolist() == [40]
    # the generator renders with the same variables (GenerationConfig.template_kwargs): its
    # rollouts' prompt ids are the think-block prompt, 40 tokens
    from primitives.fixtures.tiny import TinyModelSpec, build_tiny_model
    from primitives.model.generation import generate_rollouts
    from primitives.types import GenerationConfig

    model = build_tiny_model(tok, TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1), 0)
    gen = GenerationConfig(max_new_tokens=2, temperature=0.0)
    assert len(generate_rollouts(model, tok, [item], gen)[0].prompt_ids) == 21
    (rollout,) = generate_rollouts(model, tok, [item], gen._replace(template_kwargs=kwargs))
    assert tok.decode(rollout.prompt_ids) == base + "<think>\n\n</think>\n\n"


def test_tasks_a_job_names():
    """The default job's task is the arithmetic task with its imperfect demonstrations as
    prompt/completion rows; the chat task gives chat prompts and correct message demonstrations."""
    from primitives.fixtures.tasks import (
        CHAT_QUESTION,
        TASKS,
        ArithmeticTaskSpec,
        make_arithmetic_task,
        sft_demonstrations,
    )

    task = TASKS["arithmetic"](seed=3, num_heldout=10, num_train=50)
    spec = ArithmeticTaskSpec(num_train=50, num_heldout=10, seed=3)
    train, heldout = make_arithmetic_task(spec)
    pairs, wrong = sft_demonstrations(train, spec)
    assert task.train == train and task.eval == heldout and not task.sft_chat
    assert task.sft_rows == [{"prompt": p, "completion": c} for p, c in pairs] and task.info["sft_wrong_share"] == \
        round(wrong, 4)
    chat = TASKS["chat_arithmetic"](seed=1, max_operand=9, num_train=5, num_heldout=2)
    item, row = chat.train[0], chat.sft_rows[0]
    a, b = item.metadata["a"], item.metadata["b"]
    assert item.prompt == Conversation((Message("user", CHAT_QUESTION.format(a=a, b=b)),)) and chat.sft_chat
    assert row["messages"] == [{"role": "user", "content": CHAT_QUESTION.format(a=a, b=b)},
                               {"role": "assistant", "content": str(a + b)}]
    assert len(chat.eval) == 2 and {it.index for it in chat.eval} == {0, 1}


def test_prompt_length_limit_names_first_offender(tokenizer, tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "123+456=", "answer": "579"},
                                      {"prompt": "12+3=", "answer": "15"}, {"prompt": "1234+5=", "answer": "1239"}])
    items = load_prompt_items(p)
    assert check_prompt_lengths(items, tokenizer, 8).tolist() == [4, 8, 5, 7]
    with pytest.raises(ValueError, match=r"d\.jsonl:2: prompt is 8 tokens, over max_prompt_tokens=6 "
                                         r"\(2 of 4 prompts are, the longest 8\); raise the limit"):
        check_prompt_lengths(items, tokenizer, 6)
    with pytest.raises(ValueError, match="no prompt items"):
        check_prompt_lengths([], tokenizer, 6)


def test_chat_template_missing(no_template, tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    assert check_prompt_lengths(load_prompt_items(p), no_template, 4).tolist() == [4]  # raw text needs no template
    with pytest.raises(ValueError, match=r"a chat-formatted prompt needs a chat template, but the tokenizer "
                                         r"'\w+' has none \(tokenizer\.chat_template is None\); "
                                         r"use PromptFormat\(chat=False\)"):
        check_prompt_lengths(load_prompt_items(p, fmt=PromptFormat(chat=True)), no_template, 100)
    m = _jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                    {"role": "assistant", "content": "b"}]}])
    with pytest.raises(ValueError, match=r"SFT on chat data needs a chat template"):
        load_sft_samples(m, no_template, SFTFields(messages="messages"), PromptFormat(chat=True))


# ----------------------------------------------------------------------------- eval split

def test_eval_split_is_seeded_disjoint_and_keeps_indices():
    items = [PromptItem(i, f"p{i}") for i in range(10)]
    train, held = split_eval(items, 0.3, seed=1)
    assert [i.index for i in held] == [4, 7, 8]  # pinned: a changed RNG would silently change every eval set
    assert sorted(i.index for i in train + held) == list(range(10))  # disjoint and complete
    assert [i.index for i in held] == sorted(i.index for i in held)  # original order, original indices
    assert all(items[i.index] == i for i in train + held)
    assert split_eval(items, 0.3, seed=1) == (train, held)
    assert split_eval(items, 3, seed=1) == (train, held)  # a count and the same share agree
    assert any(split_eval(items, 3, seed=s)[1] != held for s in range(2, 6))
    assert len(split_eval(items, 0.01, seed=0)[1]) == 1  # a share holds out at least one item
    assert [len(split_eval(items, s)[1]) for s in (0.25, 0.35, 0.45)] == [3, 4, 5]  # halves round up
    assert split_eval(items, np.int64(3), seed=1) == (train, held)  # numpy integers count too
    for bad in (0, 10, 0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match=rf"eval size {bad!r} of 10 items: need a share 0 < size < 1 "
                                             r"or a count 1 <= size <= 9"):
            split_eval(items, bad)
    with pytest.raises(TypeError, match="eval size must be a share"):
        split_eval(items, True)


def test_load_train_eval(tmp_path):
    p = _jsonl(tmp_path / "train.jsonl", [{"prompt": f"p{i}", "answer": i} for i in range(6)])
    e = _jsonl(tmp_path / "eval.jsonl", [{"prompt": "e0", "answer": 0}])
    train, held = load_train_eval(p)
    assert len(train) == 6 and held == []
    train, held = load_train_eval(p, eval_data=EvalData(path=e))
    assert len(train) == 6 and [(i.index, i.prompt, i.source) for i in held] == [(0, "e0", f"{e}:1")]
    train, held = load_train_eval(p, eval_data=EvalData(size=2, seed=4))
    assert (train, held) == split_eval(load_prompt_items(p), 2, seed=4)
    with pytest.raises(ValueError, match=r"evaluation is on but no eval set is given: set EvalData\.path"):
        load_train_eval(p, eval_data=EvalData())
    with pytest.raises(ValueError, match="both an eval file and an eval size are given"):
        load_train_eval(p, eval_data=EvalData(path=e, size=0.5))
    with pytest.raises(ValueError, match=r"train\.jsonl: the eval set is the training data"):
        load_train_eval(p, eval_data=EvalData(path=p))
    with pytest.raises(FileNotFoundError, match=r"data file not found: .*nope\.jsonl"):
        load_train_eval(p, eval_data=EvalData(path=str(tmp_path / "nope.jsonl")))


# ----------------------------------------------------------------------------- prompt sources

def test_each_item_once_per_epoch_and_resume_equals_continuous():
    items = [PromptItem(i, f"p{i}") for i in range(10)]
    source = make_prompt_source(items, seed=3)
    pos, served = DataPosition(), []
    for _ in range(5):  # 5 batches of 4 = 2 epochs
        batch, pos = source(pos, 4)
        served += [(it.epoch, it.index) for it in batch]
    assert pos == DataPosition(2, 0)
    for epoch in (0, 1):
        assert sorted(i for e, i in served if e == epoch) == list(range(10))
    assert [i for e, i in served if e == 0] != [i for e, i in served if e == 1]  # reshuffled per epoch
    # resuming from a saved position continues exactly
    first, mid = take_prompts(items, DataPosition(), 12, seed=3)
    rest, _ = take_prompts(items, mid, 8, seed=3)
    assert [(i.epoch, i.index) for i in first + rest] == served
    with pytest.raises(ValueError, match="empty prompt list"):
        make_prompt_source([])


def test_held_out_train_items_keep_file_indices_in_the_source(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": i} for i in range(8)])
    train, _ = load_train_eval(p, eval_data=EvalData(size=3, seed=0))
    batch, pos = make_prompt_source(train, seed=1)(DataPosition(), 5)
    assert pos == DataPosition(1, 0)
    assert sorted(i.index for i in batch) == sorted(i.index for i in train)  # file indices, not 0..4
    assert all(i.prompt == f"p{i.index}" and i.source == f"{p}:{i.index + 1}" for i in batch)


# ----------------------------------------------------------------------------- SFT

def test_sft_text_masks_prompt(tokenizer):
    s = prepare_sft_text(tokenizer, "1+2=", "3")
    assert s.input_ids.tolist() == tokenizer("1+2=3").input_ids + [tokenizer.eos_token_id]
    assert s.loss_mask.tolist() == [0, 0, 0, 0, 1, 1]


def test_sft_chat_loss_only_on_assistant_tokens(tokenizer):
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "ok"}]
    s = prepare_sft_chat(tokenizer, msgs)
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert tokenizer.decode(s.input_ids.tolist(), skip_special_tokens=False) == full
    trained = tokenizer.decode(s.input_ids[s.loss_mask == 1].tolist(), skip_special_tokens=False)
    assert trained == "yo<|im_end|>\nok<|im_end|>\n"
    with pytest.raises(ValueError, match="unknown role 'robot'"):
        prepare_sft_chat(tokenizer, [{"role": "robot", "content": "x"}])


def test_collate_sft(tokenizer):
    a, b = prepare_sft_text(tokenizer, "1+2=", "3"), prepare_sft_text(tokenizer, "10+20=", "30")
    ids, attn, loss = collate_sft([a, b], tokenizer.pad_token_id)
    assert ids.shape == (2, 9) and attn[0].tolist() == [1] * 6 + [0] * 3 and loss[0, 6:].sum() == 0


def _trained_text(tok, sample):
    return tok.decode(sample.input_ids[sample.loss_mask == 1].tolist(), skip_special_tokens=False)


def test_sft_prompt_completion_files(tokenizer, tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"q": "1+2=", "c": "3"}, {"q": "10+20=", "c": "30"}])
    samples = load_sft_samples(p, tokenizer, SFTFields("q", "c"))
    assert samples[0].loss_mask.tolist() == [0, 0, 0, 0, 1, 1]
    wants = (prepare_sft_text(tokenizer, "1+2=", "3"), prepare_sft_text(tokenizer, "10+20=", "30"))
    for s, want in zip(samples, wants):
        assert s.input_ids.tolist() == want.input_ids.tolist() and s.loss_mask.tolist() == want.loss_mask.tolist()
    c = tmp_path / "d.csv"
    c.write_text("prompt,completion\n1+2=,3\n")
    assert load_sft_samples(str(c), tokenizer)[0].input_ids.tolist() == samples[0].input_ids.tolist()
    with pytest.raises(KeyError, match=r"d\.jsonl:1: missing field 'completion' \(fields: c, q\)"):
        load_sft_samples(p, tokenizer, SFTFields(prompt="q"))
    with pytest.raises(ValueError, match=r"d\.jsonl:1: no completion tokens within max_len=4 \(the sample is 4 "
                                         r"tokens, all prompt\); raise max_len"):
        load_sft_samples(p, tokenizer, SFTFields("q", "c"), max_len=4)
    e = _jsonl(tmp_path / "e.jsonl", [{"prompt": "1+2=", "completion": "3"}, {"prompt": "1+2=", "completion": ""}])
    with pytest.raises(ValueError, match=r"e\.jsonl:2: empty completion in field 'completion'"):
        load_sft_samples(e, tokenizer)


def test_sft_chat_messages_parquet(tokenizer, tmp_path):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    p = _parquet(tmp_path / "m.parquet", [{"messages": msgs}, {"messages": msgs[:1]}])
    fields, fmt = SFTFields(messages="messages"), PromptFormat(chat=True, system_prompt="sys")
    with pytest.raises(ValueError, match=r"m\.parquet, row 1: field 'messages' has no assistant message"):
        load_sft_samples(p, tokenizer, fields, fmt)
    p = _parquet(tmp_path / "ok.parquet", [{"messages": msgs}])
    (s,) = load_sft_samples(p, tokenizer, fields, fmt)
    want = prepare_sft_chat(tokenizer, [{"role": "system", "content": "sys"}] + msgs)
    assert s.input_ids.tolist() == want.input_ids.tolist() and s.loss_mask.tolist() == want.loss_mask.tolist()
    assert tokenizer.decode(s.input_ids.tolist(), skip_special_tokens=False) == \
        "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert _trained_text(tokenizer, s) == "yo<|im_end|>\n"
    with pytest.raises(ValueError, match=r"chat messages need PromptFormat\(chat=True\)"):
        load_sft_samples(p, tokenizer, fields)


def test_sft_chat_pairs_with_smollm2(smol, tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": "What is 2+2?", "completion": "4"}])
    (s,) = load_sft_samples(p, smol, fmt=PromptFormat(chat=True))
    assert smol.decode(s.input_ids.tolist(), skip_special_tokens=False) == (
        SMOL_SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n")
    assert _trained_text(smol, s) == "4<|im_end|>\n"
    assert int(s.loss_mask.sum()) == len(smol("4<|im_end|>\n", add_special_tokens=False).input_ids)


def test_items_from_rows_and_records_keep_the_source(tmp_path):
    rows = Records([{"prompt": "a", "answer": 1}], ["mem:1"])
    assert items_from_rows(rows) == [PromptItem(0, "a", 1, source="mem:1")]
    assert items_from_records([{"prompt": "a", "answer": 1}], where="w")[0].source == "w, record 0"


def test_arithmetic_task_is_seeded_disjoint_and_imperfect():
    spec = ArithmeticTaskSpec(num_train=500, num_heldout=100, carry_error_rate=0.5, seed=1)
    train, held = make_arithmetic_task(spec)
    assert len(train) == 500 and len(held) == 100
    assert not {t.prompt for t in train} & {h.prompt for h in held}
    assert make_arithmetic_task(spec)[0] == train
    demos, wrong = sft_demonstrations(train, spec)
    carry = [needs_carry(t.metadata["a"], t.metadata["b"]) for t in train]
    errors = [c != t.answer for (_, c), t in zip(demos, train)]
    assert all(c for c, e in zip(carry, errors) if e)  # only carry problems are ever wrong
    assert wrong == pytest.approx(np.mean(errors))
    assert 0.35 < sum(errors) / sum(carry) < 0.65
    with pytest.raises(ValueError, match="allows only"):
        make_arithmetic_task(ArithmeticTaskSpec(max_operand=3, num_train=10, num_heldout=10))
