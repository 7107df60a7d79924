"""``write_adapter``: the PEFT adapter directory a vLLM generator serves, written from a weight
sync's tensors alone (no PEFT model), loads back as the adapter it came from."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from primitives.model.lora import adapter_names, adapter_targets, with_lora, write_adapter
from primitives.types import LoraConfig

LORA = LoraConfig(rank=4, alpha=12.0)  # scale 3, not PEFT's or our default


def test_adapter_targets_are_the_module_names_before_lora():
    names = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight",
             "base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight"]
    assert adapter_targets(names) == ["down_proj", "q_proj"]


@pytest.fixture(scope="module")
def adapted(tiny_model_path):
    """The tiny model in adapters with a random, non-zero B, and the adapter's tensors by name."""
    torch.manual_seed(0)
    model = with_lora(AutoModelForCausalLM.from_pretrained(tiny_model_path), LORA).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in adapter_names(params):
            if ".lora_B." in name:
                params[name].normal_(0.0, 0.05)
    return model, {n: params[n].detach() for n in adapter_names(params)}


def test_the_directory_loads_back_as_the_same_adapter(adapted, tiny_model_path, tmp_path):
    from peft import PeftModel

    model, tensors = adapted
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])  # views into one buffer, as a sync's bucket gives
    views, offset = {}, 0
    for name, t in tensors.items():
        views[name] = flat[offset: offset + t.numel()].view(t.shape)
        offset += t.numel()
    path = write_adapter(str(tmp_path / "adapter"), views, LORA)

    config = json.load(open(os.path.join(path, "adapter_config.json")))
    assert (config["r"], config["lora_alpha"], config["bias"], config["task_type"]) == (4, 12.0, "none", "CAUSAL_LM")
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]
    files = load_file(os.path.join(path, "adapter_model.safetensors"))
    assert len(files) == len(tensors) == 2 * 7 * 3 and not any(".default." in k for k in files)

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), path).eval()
    ids = torch.tensor([[5, 17, 30, 2, 9, 44, 61]])
    with torch.no_grad():
        expected, got = model(ids).logits, loaded(ids).logits
        with model.disable_adapter():
            base = model(ids).logits
    assert torch.equal(got, expected)
    assert (got - base).abs().max() > 1e-2  # the adapter is applied, at its scale


def test_wrong_tensors_are_refused_by_name(adapted, tmp_path):
    _, tensors = adapted
    with pytest.raises(ValueError, match="not parameters of adapter 'default'.*embed_tokens"):
        write_adapter(str(tmp_path / "a"), {**tensors, "base_model.model.model.embed_tokens.weight": torch.zeros(2)},
                      LORA)
    with pytest.raises(ValueError, match=r"model.lora.rank is 8, but the lora_A tensors have rank \[4\]"):
        write_adapter(str(tmp_path / "b"), tensors, LORA._replace(rank=8))
