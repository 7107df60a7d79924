"""LoRA through PEFT: wrap a causal LM in low-rank adapters, name and move only the adapters,
score with them off, merge them into plain weights.

The policy (a trainer rank's module, a generator's copy) is a ``peft`` ``PeftModelForCausalLM``
whose adapter ``"default"`` trains; every base weight is frozen. What differs from full
fine-tuning is small and lives here:

* **which weights move**: ``adapter_names`` (the parameters of one adapter), so a weight sync,
  a snapshot and an optimizer cover the adapters only (``rank * (in + out)`` per target
  layer instead of ``in * out``);
* **the reference for free**: the base model is the policy with its adapters off
  (``adapters_off``), so a fixed reference needs no copy of the model; a reference that moves
  (after an SFT stage, EMA, periodic reset) is a second, frozen adapter ``"reference"``
  (``add_reference_adapter``, ``active_adapter``) of the same module;
* **plain weights out**: ``merged_state`` folds ``(alpha / r) B @ A`` into each target's base
  weight under the model's own parameter names, so a merged checkpoint loads with
  ``AutoModelForCausalLM`` (and a generator without PEFT could take it).

Every function takes the module's parameters by name, so the same code reads a rank's module
under ZeRO-1/2 or a ZeRO-3 rank's gathered ``full_state``.
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Iterable

import torch

from primitives.types import LoraConfig

POLICY = "default"  # PEFT's name for the first adapter: the one that trains
REFERENCE = "reference"  # the frozen adapter a moving reference keeps
WRAPPER_PREFIX = "base_model.model."  # PeftModelForCausalLM's prefix on the wrapped model's names


def peft_config(cfg: LoraConfig):
    """PEFT's ``LoraConfig`` for ``cfg`` (a causal LM; no bias training)."""
    from peft import LoraConfig as PeftLoraConfig

    targets = cfg.target_modules
    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.scale * cfg.rank, lora_dropout=cfg.dropout, bias="none",
                          task_type="CAUSAL_LM",
                          target_modules="all-linear" if tuple(targets) == ("all-linear",) else list(targets))


def with_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """``model`` wrapped in adapters (``"default"``, trainable; every base weight frozen). The
    adapters start as PEFT starts them: ``A`` random (from torch's generator, so a seeded rank
    gets the same ``A`` as its peers), ``B`` zero, so the wrapped model computes what ``model`` did."""
    from peft import get_peft_model

    return get_peft_model(model, peft_config(cfg))


def adapter_names(names: Iterable[str], adapter: str = POLICY) -> list:
    """The names among ``names`` that are parameters of ``adapter`` (``...lora_A.<adapter>.weight``)."""
    pattern = re.compile(rf"\.lora_(A|B|embedding_A|embedding_B)\.{re.escape(adapter)}(\.|$)")
    return [n for n in names if pattern.search(n)]


def renamed(name: str, source: str, target: str) -> str:
    """An adapter parameter's name in another adapter (``lora_A.default.weight`` -> ``lora_A.reference.weight``)."""
    return re.sub(rf"\.lora_(A|B|embedding_A|embedding_B)\.{re.escape(source)}(\.|$)",
                  rf".lora_\1.{target}\2", name)


def add_reference_adapter(model) -> None:
    """A second adapter ``"reference"`` on the policy's targets, frozen, equal to the policy's adapter
    now; the policy's adapter stays the active, trainable one."""
    cfg = model.peft_config[POLICY]
    model.add_adapter(REFERENCE, cfg)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in adapter_names(params):
            params[renamed(name, POLICY, REFERENCE)].copy_(params[name])
    with kept_requires_grad(model):
        model.base_model.set_adapter(POLICY)
    for name in adapter_names(params, REFERENCE):
        params[name].requires_grad_(False)


@contextlib.contextmanager
def kept_requires_grad(model):
    """Whatever PEFT's adapter switching does to ``requires_grad`` is undone after the block: the
    optimizer (and DeepSpeed's gradient hooks) were built for the policy's adapter alone."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


@contextlib.contextmanager
def active_adapter(model, name: str):
    """Forwards inside the block use adapter ``name`` (the reference's), then the policy's again."""
    with kept_requires_grad(model):
        model.base_model.set_adapter(name)
        try:
            yield model
        finally:
            model.base_model.set_adapter(POLICY)


def adapters_off(model):
    """Forwards inside the block use the base weights alone: the model as loaded."""
    return model.disable_adapter()


def base_name(name: str) -> str:
    """A wrapped base weight's name in the plain model (``base_model.model.x.q_proj.base_layer.weight``
    -> ``x.q_proj.weight``)."""
    if name.startswith(WRAPPER_PREFIX):
        name = name[len(WRAPPER_PREFIX):]
    return name.replace(".base_layer.", ".")


def merged_state(state: dict, cfg: LoraConfig, adapter: str = POLICY) -> dict:
    """The plain model's weights, by its own names, from a wrapped model's full ``state`` (name ->
    tensor or array, every parameter): each target's base weight plus ``(alpha / r) B @ A`` of
    ``adapter``; the other adapters' parameters are left out. Linear targets only
    (``fan_in_fan_out`` off), as ``with_lora`` makes them."""
    tensors = {k: v if isinstance(v, torch.Tensor) else torch.tensor(v) for k, v in state.items()}
    out = {}
    for name, value in tensors.items():
        if ".lora_" in name:
            continue
        out[base_name(name)] = value
    for name in adapter_names(tensors, adapter):
        if ".lora_A." not in name:
            continue
        layer = name[: name.index(".lora_A.")]
        a, b = tensors[name], tensors[name.replace(".lora_A.", ".lora_B.")]
        weight = base_name(f"{layer}.base_layer.weight")
        if weight not in out:
            raise KeyError(f"merged_state: {name} has no base weight {layer}.base_layer.weight")
        base = out[weight]
        out[weight] = (base.double() + cfg.scale * (b.double() @ a.double())).to(base.dtype)
    return out


def adapter_state(state: dict, adapter: str = POLICY) -> dict:
    """``adapter``'s parameters from a wrapped model's ``state``, under the names a PEFT adapter
    directory's ``adapter_model.safetensors`` holds (no adapter name: ``...lora_A.weight``)."""
    infix = re.compile(rf"(\.lora_(?:A|B|embedding_A|embedding_B))\.{re.escape(adapter)}(?=\.|$)")
    return {infix.sub(r"\1", n): state[n] for n in adapter_names(state, adapter)}


def save_adapter(model, path: str, state: dict, adapter: str = POLICY) -> str:
    """A PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) of
    ``adapter`` from ``state`` (the wrapped model's parameters, gathered): ``PeftModel.from_pretrained``
    (and vLLM's ``LoRARequest``) loads it onto the base model."""
    tensors = {k: (v if isinstance(v, torch.Tensor) else torch.as_tensor(v)).detach().cpu().contiguous()
               for k, v in state.items() if k in set(adapter_names(state, adapter))}
    model.save_pretrained(path, state_dict=tensors, selected_adapters=[adapter])
    return path


def adapter_targets(names: Iterable[str]) -> list:
    """The target module names (last component) an adapter's parameter names adapt, sorted
    (``...layers.0.self_attn.q_proj.lora_A.default.weight`` -> ``q_proj``)."""
    return sorted({n[: n.index(".lora_")].rsplit(".", 1)[-1] for n in names})


def write_adapter(path: str, tensors: dict, cfg: LoraConfig, adapter: str = POLICY) -> str:
    """A PEFT adapter directory at ``path`` (made if missing) from ``adapter``'s parameters alone,
    by the wrapped model's names (name -> tensor: what a weight sync sends), without a PEFT model:
    ``adapter_config.json`` (``cfg``'s rank and alpha, the targets the names hold) and
    ``adapter_model.safetensors`` (``adapter_state``'s names). ``PeftModel.from_pretrained`` and
    vLLM's ``LoRARequest`` load it onto the base model."""
    from safetensors.torch import save_file

    others = sorted(set(tensors) - set(adapter_names(tensors, adapter)))
    if others:
        raise ValueError(f"write_adapter: {len(others)} tensors are not parameters of adapter '{adapter}' "
                         f"(e.g. {others[0]}); only '...lora_A.{adapter}.weight' / '...lora_B.{adapter}.weight'")
    ranks = {n: t.shape[0] for n, t in tensors.items() if ".lora_A." in n}
    wrong = {n: r for n, r in ranks.items() if r != cfg.rank}
    if not ranks or wrong:
        raise ValueError(f"write_adapter: model.lora.rank is {cfg.rank}, but the lora_A tensors have rank "
                         f"{sorted(set(ranks.values()))} (none: no lora_A tensor)")
    os.makedirs(path, exist_ok=True)
    peft_config(cfg._replace(target_modules=tuple(adapter_targets(tensors)))).save_pretrained(path)
    # clones: a sync's tensors are views into one bucket, and safetensors refuses tensors that share memory
    files = {k: v.detach().to("cpu").clone() for k, v in adapter_state(tensors, adapter).items()}
    save_file(files, os.path.join(path, "adapter_model.safetensors"))
    return path


def value_errors(cfg: LoraConfig) -> list:
    """Settings of ``model.lora`` that cannot hold, whatever the model."""
    checks = [(cfg.rank >= 0, f"model.lora.rank must be 0 (off) or more, got {cfg.rank}"),
              (cfg.alpha is None or cfg.alpha > 0, f"model.lora.alpha must be > 0, got {cfg.alpha}"),
              (cfg.dropout == 0.0, f"model.lora.dropout must be 0, got {cfg.dropout}: every forward that computes "
                                   "logprobs (training, SFT, scoring) runs without dropout, so the trainer's "
                                   "ratio and KL compare the function the sampler drew from; it would not apply"),
              (bool(cfg.target_modules), "model.lora.target_modules is empty; name modules (e.g. q_proj, v_proj) "
                                         "or all-linear"),
              ("all-linear" not in cfg.target_modules or len(cfg.target_modules) == 1,
               f"model.lora.target_modules: all-linear stands alone, got {list(cfg.target_modules)}")]
    return [message for ok, message in checks if not ok]


def target_errors(model_path: str, cfg: LoraConfig, trust_remote_code: bool = False) -> list:
    """Target modules of ``cfg`` that the model at ``model_path`` lacks, or that are not linear
    layers, checked on an empty (meta-device) copy before anything loads; each error names
    ``model.lora.target_modules`` and the model's linear layers."""
    from primitives.hooks import did_you_mean

    field = "model.lora.target_modules"
    if not cfg.enabled or tuple(cfg.target_modules) == ("all-linear",) or value_errors(cfg):
        return []
    model = meta_model(model_path, trust_remote_code)
    modules = dict(model.named_modules())
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, torch.nn.Linear)})
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is getattr(model.get_input_embeddings(), "weight", None)
    errors = []
    for target in cfg.target_modules:
        hits = [m for n, m in modules.items() if n == target or n.endswith("." + target)]
        if tied and any(m is head for m in hits):
            errors.append(f"{field}: '{target}' is the output head, whose weight is the input embeddings' (tied "
                          f"in {model_path}): adapting it would change both, and a merged model could not keep "
                          f"them tied; leave it out (all-linear does)")
        elif not hits:
            errors.append(f"{field}: '{target}' matches no module of {model_path}{did_you_mean(target, linear)}; "
                          f"its linear layers are {', '.join(linear)}")
        elif not all(isinstance(m, torch.nn.Linear) for m in hits):
            kinds = sorted({type(m).__name__ for m in hits if not isinstance(m, torch.nn.Linear)})
            errors.append(f"{field}: '{target}' names {', '.join(kinds)} modules, not linear layers; LoRA here "
                          f"adapts linear layers ({', '.join(linear)})")
    return errors


def meta_model(model_path: str, trust_remote_code: bool = False):
    """The model at ``model_path`` built on the meta device (no weights read, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
