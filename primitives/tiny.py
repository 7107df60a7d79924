"""The embedded default model: a character-level tokenizer and a tiny Qwen2 (DESIGN section 9).

Both are built locally (no network) and saved in Hugging Face format, so that
``AutoTokenizer.from_pretrained(path)`` and ``AutoModelForCausalLM.from_pretrained(path)``
(and vLLM) load them by path like any real checkpoint.
"""
from __future__ import annotations

import os
import string
from typing import NamedTuple

import torch

PAD, EOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, EOS, IM_START, IM_END)
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"

# Qwen-style chat template, tool messages included; the assistant turn ends with <|im_end|>.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'tool' %}{{ '<tool_response>' + m['content'] + '</tool_response>' }}"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TinyModelSpec(NamedTuple):
    """Size of the tiny Qwen2 (about 0.4M parameters with the defaults)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256


def _bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable unicode map, which byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
    bs += list(range(ord("\xae"), ord("\xff") + 1))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def build_char_tokenizer():
    """A character-level tokenizer in Qwen2's own format: byte-level BPE with no merges.

    transformers loads any ``qwen2`` checkpoint with ``Qwen2Tokenizer`` whatever class the
    tokenizer config names, so a custom pre-tokenizer would be dropped on reload; a BPE
    vocabulary without merges reloads identically and still yields one token per character.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_char = _bytes_to_unicode()
    vocab = {}
    for ch in CHARS:
        vocab.setdefault(byte_to_char[ord(ch)], len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        padding_side="left", clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(tokenizer, spec: TinyModelSpec = TinyModelSpec(), seed: int = 0):
    """A randomly initialised Qwen2ForCausalLM sized by ``spec`` (fp32)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_tiny_model(path: str, spec: TinyModelSpec = TinyModelSpec(), seed: int = 0) -> str:
    """Build the tokenizer and model and save both to ``path`` (HF format); returns path."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, spec, seed)
    os.makedirs(path, exist_ok=True)
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return path
