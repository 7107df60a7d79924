"""The PPO critic: a value model, its values for rollouts, and its clipped value loss step.

A value model is a causal LM's backbone (the transformer without its LM head) with a
scalar head: ``V(s_t)`` for every position. In the ``Batch`` layout (prompts left-padded to
P, completions right-padded to T) the value of completion token t is read at position
``P - 1 + t``, the state *before* token t is produced - the same position whose logits
predict it (OpenRLHF's critic takes ``values[:, -num_actions - 1:-1]``). GAE
(``primitives.maths.advantages.gae_advantages``; Schulman et al. 2015, arXiv 1506.02438) turns
these values and the token rewards into advantages and returns; the critic then regresses
on the returns with the clipped value loss (``primitives.maths.losses.clipped_value_loss``).

``value_forward_backward`` takes ``backward`` and ``loss_scale`` like
``primitives.model.training.forward_backward``, so the same function serves one process and a
DeepSpeed rank (``backward=engine.backward``); ``optim_step`` steps the critic's own
optimizer.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from primitives.files import atomic_directory
from primitives.maths.losses import LossCounts, aggregate_loss, clipped_value_loss
from primitives.model.logprobs import check_layout, disable_dropout
from primitives.padding import pack_completions, position_ids_from_mask
from primitives.types import Batch

HEAD_FILE = "value_head.safetensors"
META_FILE = "value_model.json"


class ValueModel(nn.Module):
    """``backbone`` (an HF base model: embeddings + decoder layers + final norm, no LM head)
    followed by ``value_head`` (``nn.Linear(hidden_size, 1)``, with or without bias).

    A plain ``nn.Module`` whose parameters are ``backbone.*`` and ``value_head.*``, so a
    DeepSpeed engine can wrap it and ``named_parameters`` is stable across save and load.
    """

    def __init__(self, backbone: nn.Module, value_head: nn.Linear):
        super().__init__()
        if value_head.out_features != 1:
            raise ValueError(f"value head must have one output, got {value_head.out_features}")
        if value_head.in_features != backbone.config.hidden_size:
            raise ValueError(f"value head takes {value_head.in_features} features but the backbone's "
                             f"hidden size is {backbone.config.hidden_size}")
        self.backbone = backbone
        self.value_head = value_head
        self.config = backbone.config  # DeepSpeed's "auto" settings read hidden_size here

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Value at every position. (B, L), (B, L) -> (B, L) float32

        ``position_ids`` default to positions counted over real tokens (from the attention
        mask), so left padding does not change a row's values.
        """
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state  # (B, L, H)
        return self.value_head(hidden).squeeze(-1).float()  # (B, L)


def _check_model_dir(path: str, what: str) -> None:
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{what} path '{path}' is not a model directory (no config.json; "
                                f"pass a saved Hugging Face checkpoint)")


def backbone_of(lm: nn.Module) -> nn.Module:
    """The transformer inside an HF model with a head: ``getattr(lm, lm.base_model_prefix)``
    (``lm.model`` for Qwen2 / Llama, ``lm.transformer`` for GPT-2)."""
    backbone = getattr(lm, getattr(lm, "base_model_prefix", ""), None)
    if not isinstance(backbone, nn.Module):
        raise ValueError(f"{type(lm).__name__} has no backbone at base_model_prefix "
                         f"'{getattr(lm, 'base_model_prefix', None)}'")
    heads = getattr(backbone, "get_output_embeddings", None)
    if callable(heads) and heads() is not None:  # a wrapper forwarding attributes (PEFT) handed the LM back
        raise ValueError(f"{type(lm).__name__}.{lm.base_model_prefix} is {type(backbone).__name__}, a model with "
                         f"an LM head, not its backbone")
    return backbone


def value_model_from_policy(path_or_model, head_init_std: float = 0.0, dtype: torch.dtype = torch.float32,
                            seed: int = 0) -> ValueModel:
    """A value model whose backbone is a copy of a causal LM's (a path or a loaded model; a model in
    adapters gives its weights with its active adapter merged, every weight trainable; an adapter on a
    head tied to the embeddings is merged into the table the backbone reads).

    The head is zero-initialised by default, so every initial value is 0: the first
    advantages are GAE of the rewards alone, not of a random head's noise, and at the first
    step the backbone gets no gradient (the head's weight is 0) while the head starts
    learning - the pretrained features are not disturbed by a head that knows nothing yet.
    OpenRLHF and veRL draw the head from a small normal instead (``head_init_std > 0`` does
    that, from ``seed``; the bias starts at 0).
    """
    if isinstance(path_or_model, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        path = os.fspath(path_or_model)
        _check_model_dir(path, "policy")
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        backbone = backbone_of(lm)
    elif hasattr(path_or_model, "merge_and_unload"):
        # a policy in adapters (PEFT, primitives.model.lora.with_lora): a copy with its active adapter merged
        # into the weights, unwrapped; the critic is a full value model, every weight of it trained
        backbone = backbone_of(copy.deepcopy(path_or_model).merge_and_unload()).requires_grad_(True)
    else:
        backbone = copy.deepcopy(backbone_of(path_or_model))  # the policy's own weights stay untouched
    backbone = backbone.to(dtype)
    head = nn.Linear(backbone.config.hidden_size, 1, bias=True, dtype=dtype)
    with torch.no_grad():
        nn.init.zeros_(head.bias)
        if head_init_std > 0:
            head.weight.normal_(0.0, head_init_std, generator=torch.Generator().manual_seed(seed))
        else:
            nn.init.zeros_(head.weight)
    return ValueModel(backbone, head)


def value_model_from_reward_model(path: str, dtype: torch.dtype = torch.float32) -> ValueModel:
    """A value model from an HF ``AutoModelForSequenceClassification`` with ``num_labels == 1``:
    its backbone, and its ``score`` head as the value head. The reward model scores a
    sequence at its last token, so this critic's value there starts as that score."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    _check_model_dir(path, "reward model")
    num_labels = AutoConfig.from_pretrained(path).num_labels
    if num_labels != 1:
        raise ValueError(f"reward model '{path}' has num_labels={num_labels}; a value head needs 1")
    rm = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    head = getattr(rm, "score", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(f"reward model '{path}' ({type(rm).__name__}) has no linear 'score' head on the "
                         f"hidden states")
    return ValueModel(backbone_of(rm), head)


def save_value_model(model: ValueModel, path: str) -> str:
    """Write the backbone in HF format (``save_pretrained``), the head as safetensors and a
    small json, atomically (temp dir, then rename). Returns ``path``."""
    from safetensors.torch import save_file

    def write(tmp: str) -> None:
        model.backbone.save_pretrained(tmp)
        head = {k: v.detach().cpu().contiguous() for k, v in model.value_head.state_dict().items()}
        save_file(head, os.path.join(tmp, HEAD_FILE))
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump({"hidden_size": model.value_head.in_features, "bias": model.value_head.bias is not None}, f)

    return atomic_directory(path, write)


def load_value_model(path: str, dtype: torch.dtype = torch.float32) -> ValueModel:
    """The value model ``save_value_model`` wrote to ``path``."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    _check_model_dir(path, "value model")
    if not os.path.isfile(os.path.join(path, HEAD_FILE)) or not os.path.isfile(os.path.join(path, META_FILE)):
        raise FileNotFoundError(f"'{path}' is not a saved value model (no {HEAD_FILE} / {META_FILE}); build one "
                                f"from a policy or reward model with value_model_from_policy / "
                                f"value_model_from_reward_model")
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    backbone = AutoModel.from_pretrained(path, dtype=dtype)
    head = nn.Linear(meta["hidden_size"], 1, bias=meta["bias"], dtype=dtype)
    head.load_state_dict(load_file(os.path.join(path, HEAD_FILE)))
    return ValueModel(backbone, head)


def completion_values(value_model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                      micro_batch_size: Optional[int] = None) -> torch.Tensor:
    """Values of the completion tokens of a ``Batch``-layout input. (B, P+T), (B, P+T) -> (B, T) float32

    ``V_t`` is the value at position ``P - 1 + t``: the state before completion token t is
    produced. Gradients flow unless the caller disables them; dropout is switched off.
    """
    check_layout(input_ids, attention_mask, prompt_len)
    disable_dropout(value_model)
    step = micro_batch_size or input_ids.shape[0]
    parts = []
    for s in range(0, input_ids.shape[0], step):
        ids, mask = input_ids[s: s + step], attention_mask[s: s + step]
        values = value_model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
        parts.append(values[:, prompt_len - 1: -1])  # (b, T)
    return torch.cat(parts)


@torch.no_grad()
def rollout_values(value_model, rollouts: Sequence, pad_id: int, micro_batch_size: Optional[int] = None) -> list:
    """Per-rollout value arrays (T_i,) float32, one per completion token (``make_batch(values=...)``)."""
    ids, mask, P, _ = pack_completions([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id)
    device = next(value_model.parameters()).device
    values = completion_values(value_model, torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device),
                               P, micro_batch_size).cpu().numpy()
    return [values[i, : len(r.completion_ids)].astype(np.float32) for i, r in enumerate(rollouts)]


def _default_backward(loss: torch.Tensor) -> None:
    loss.backward()


def value_clip_taken(values, old_values, returns, clip: float):
    """Where the clipped branch of ``clipped_value_loss`` is the larger: the new value moved
    more than ``clip`` from the old one, and the clipped value is the farther from the return.
    (B, T) bool. (A clamp that does not bind is not counted, whatever the rounding.)"""
    moved = values - old_values
    v_clip = old_values + moved.clamp(-clip, clip)
    return (moved.abs() > clip) & ((v_clip - returns) ** 2 > (values - returns) ** 2)


def value_forward_backward(value_model, batch: Batch, counts: LossCounts, clip: float = 0.2,
                           micro_batch_size: Optional[int] = None, backward: Callable = _default_backward,
                           loss_scale: float = 1.0) -> dict:
    """Accumulate gradients of the clipped value loss over ``batch`` in micro-batches.

    The loss is PPO's clipped value loss (OpenAI baselines ppo2; Schulman et al. 2017,
    arXiv 1707.06347) against ``batch.returns``, with ``batch.values`` (the values at
    rollout time) as the clip's anchor, on ``batch.loss_mask`` tokens, token-mean over the
    step's global token count ``counts.num_tokens``: the ranks' and micro-batches' losses add
    up to the whole step's. ``backward`` and ``loss_scale`` as in
    ``primitives.model.training.forward_backward``. Returns shares that add over micro-batches and
    ranks (``primitives.maths.metrics.merge_metrics``): ``critic/value_loss``, ``critic/values_mean``,
    ``critic/clip_frac`` (tokens where the clipped branch is taken), ``critic/returns_mean``.
    """
    if batch.size == 0:
        raise ValueError("value_forward_backward: empty batch")
    if batch.values is None or batch.returns is None:
        missing = [name for name in ("values", "returns") if getattr(batch, name) is None]
        raise ValueError(f"value_forward_backward: batch.{' and batch.'.join(missing)} is None (the value loss "
                         f"needs the rollout-time values and the GAE returns: make_batch(..., values=...) "
                         f"with an algorithm whose advantage is 'gae')")
    device = next(value_model.parameters()).device
    n = max(counts.num_tokens, 1)
    step = micro_batch_size or batch.size
    metrics = {"critic/value_loss": 0.0, "critic/values_mean": 0.0, "critic/clip_frac": 0.0,
               "critic/returns_mean": 0.0}
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    value_model.train()
    for s in range(0, batch.size, step):
        mb = batch.select(range(s, min(s + step, batch.size)))
        values = completion_values(value_model, as_tensor(mb.input_ids), as_tensor(mb.attention_mask),
                                   mb.prompt_len)  # (b, T)
        old, returns, mask = as_tensor(mb.values).float(), as_tensor(mb.returns).float(), as_tensor(mb.loss_mask)
        loss = aggregate_loss(clipped_value_loss(values, old, returns, mask, clip), mask, "token-mean", counts)
        backward(loss * loss_scale)
        with torch.no_grad():
            metrics["critic/value_loss"] += float(loss)
            metrics["critic/values_mean"] += float((values * mask).sum()) / n
            metrics["critic/clip_frac"] += float((value_clip_taken(values, old, returns, clip) * mask).sum()) / n
            metrics["critic/returns_mean"] += float((returns * mask).sum()) / n
    return metrics


def train_values_on_batch(value_model, optimizer, batch: Batch, algo, max_grad_norm: Optional[float] = 1.0,
                          micro_batch_size: Optional[int] = None) -> list:
    """The value model's updates of one rollout batch in one process: the policy's
    ``algo.ppo_epochs`` x ``algo.mini_batches`` (``primitives.model.training.updates_of``), each a
    ``value_forward_backward`` clipped by ``algo.value_clip`` and an ``optim_step``. Returns one
    metric dict per update, with ``critic/grad_norm`` and ``critic/lr`` (as ``train_on_batch``
    does for the policy)."""
    from primitives.model.training import optim_step, step_counts, updates_of

    updates = []
    for part, _ in updates_of(batch, algo, lambda p, fix_old: p):  # the clip's anchor is batch.values
        m = value_forward_backward(value_model, part, step_counts(part), algo.value_clip, micro_batch_size)
        m["critic/grad_norm"] = optim_step(value_model, optimizer, max_grad_norm)
        m["critic/lr"] = float(optimizer.param_groups[0]["lr"])
        updates.append(m)
    return updates
