"""Prompt sources (JSONL, HF datasets, explicit position), SFT sample preparation."""
import json

import numpy as np
import pytest

from primitives.data import (
    FieldMap,
    PromptItem,
    collate_sft,
    load_prompts_dataset,
    load_prompts_jsonl,
    make_prompt_source,
    prepare_sft_chat,
    prepare_sft_text,
    take_prompts,
)
from primitives.tasks import ArithmeticTaskSpec, make_arithmetic_task, needs_carry, sft_demonstrations
from primitives.types import DataPosition


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_loading_and_field_mapping(tmp_path):
    p = _write(tmp_path / "d.jsonl", [json.dumps({"q": "1+1=", "a": "2", "src": "x"}), "",
                                      json.dumps({"q": "2+2=", "a": "4"})])
    items = load_prompts_jsonl(p, FieldMap(prompt="q", answer="a"))
    assert [(i.index, i.prompt, i.answer) for i in items] == [(0, "1+1=", "2"), (1, "2+2=", "4")]
    assert items[0].metadata == {"src": "x"}


def test_jsonl_errors_name_file_and_line(tmp_path):
    p = _write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "a", "answer": 1}), "{not json"])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: malformed JSON"):
        load_prompts_jsonl(p)
    p = _write(tmp_path / "miss.jsonl", [json.dumps({"prompt": "a", "answer": 1}), json.dumps({"prompt": "b"})])
    with pytest.raises(KeyError, match=r"miss\.jsonl, record 2: missing field 'answer'"):
        load_prompts_jsonl(p)
    p = _write(tmp_path / "empty.jsonl", [json.dumps({"prompt": "  ", "answer": 1})])
    with pytest.raises(ValueError, match="empty prompt"):
        load_prompts_jsonl(p)
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        load_prompts_jsonl(str(tmp_path / "nope.jsonl"))
    p = _write(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=r"list\.jsonl:1: expected a JSON object"):
        load_prompts_jsonl(p)


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
