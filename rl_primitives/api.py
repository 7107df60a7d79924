"""The seeds' records, configs, algorithm names and rollout helpers, over ours.

Each name here is the seeds' (``../shared/seeds/``); its docstring says which of ours it maps
to. Where a seed shape is one of the seeds' known errors (seeds README errors 1 to 9), the
function raises an error naming the supported form instead of reproducing the error.
"""
from __future__ import annotations

import inspect
import os
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from primitives.env.rewards import aggregate_vector_rewards as _aggregate_vector_rewards
from primitives.env.rewards import score_rollouts
from primitives.env.rollouts import create_rollout as _create_rollout
from primitives.env.tools import ToolCall, ToolResult, hf_turn_generator, multiturn_rollout, no_tool_calls_stop
from primitives.env.tools import execute_and_track_tools as _execute_and_track_tools
from primitives.hooks import fn_name
from primitives.io.data import PromptItem, as_prompt_items
from primitives.maths.algorithms import AlgorithmConfig, get_algorithm, online_dpo
from primitives.maths.kl import create_ema_updater, create_periodic_updater, fixed_reference, per_token_kl
from primitives.model.generation import generate_rollouts
from primitives.model.logprobs import rollout_logprobs
from primitives.types import Conversation, Generation, Rollout, RolloutBatch
from primitives.types import GenerationConfig as _GenerationConfig
from rl_primitives.ref_cache import ReferenceLogprobCache

Batch = RolloutBatch  # the seeds' Batch(rollouts, batch_metadata): rollouts without padded arrays


# ----------------------------------------------------------------------------- generation settings

def GenerationConfig(max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,  # noqa: N802
                     n: Optional[int] = None, stop: Sequence[str] = (), seed: Optional[int] = None,
                     stop_token_ids: Sequence[int] = (), template_kwargs: Optional[dict] = None, *,
                     decode: str = "auto", max_batch_rows: int = 0,
                     do_sample: Optional[bool] = None, num_return_sequences: Optional[int] = None,
                     stop_strings: Optional[Sequence[str]] = None, logprobs: Optional[bool] = None,
                     custom_params: Optional[dict] = None) -> _GenerationConfig:
    """``primitives.types.GenerationConfig`` (preferred) from its own fields or the seeds'.

    The seeds' names: ``do_sample=False`` is greedy (temperature 0; RL training refuses it),
    ``num_return_sequences`` is ``n`` (the group size G), ``stop_strings`` is ``stop``,
    ``top_k=-1`` (off) is ``top_k=0``; ``logprobs`` is accepted and changes nothing (logprobs
    are always computed: the trainer needs them). ``decode`` and ``max_batch_rows`` are the HF decode
    loop's (``primitives.types.GenerationConfig``). ``custom_params`` (extra ``generate``
    keywords) is refused: every engine here (HF, vLLM) reads only the fields."""
    if custom_params:
        raise ValueError(f"GenerationConfig(custom_params={sorted(custom_params)}): extra generate() keywords do not "
                         f"reach every engine (HF generate, vLLM); use the fields max_new_tokens, temperature, top_p, "
                         f"top_k, n, stop, seed, stop_token_ids, template_kwargs")
    if num_return_sequences is not None and n is not None and num_return_sequences != n:
        raise ValueError(f"GenerationConfig: n={n} and num_return_sequences={num_return_sequences} disagree "
                         f"(they are one setting: the completions per prompt)")
    n = n if n is not None else (num_return_sequences if num_return_sequences is not None else 1)
    if stop_strings is not None:
        if stop and tuple(stop) != tuple(stop_strings):
            raise ValueError("GenerationConfig: stop and stop_strings disagree (they are one setting)")
        stop = stop_strings
    temperature = 0.0 if do_sample is False else temperature
    return _GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                             top_k=max(int(top_k), 0), n=int(n), stop=tuple(stop), seed=seed,
                             stop_token_ids=tuple(stop_token_ids), template_kwargs=template_kwargs, decode=decode,
                             max_batch_rows=int(max_batch_rows))


# ----------------------------------------------------------------------------- algorithms

class SeedAlgorithmConfig(AlgorithmConfig):
    """An ``AlgorithmConfig`` that also reads as the seeds' dict: ``cfg["algorithm"]`` is its
    name, ``cfg["params"]`` its fields that differ from the ``AlgorithmConfig`` defaults."""

    __slots__ = ()

    def __getitem__(self, key):
        if key == "algorithm":
            return self.name
        if key == "params":
            defaults = AlgorithmConfig()
            return {f: v for f, v in zip(self._fields, self) if f != "name" and v != getattr(defaults, f)}
        if isinstance(key, str):
            raise KeyError(f"{key!r}: an algorithm config reads as the seeds' dict only for 'algorithm' and "
                           f"'params'; its fields are attributes ({', '.join(self._fields)})")
        return tuple.__getitem__(self, key)


DAPO_AS_PAIRWISE = ("the seeds' 'DAPO' ({given}) is a DPO-style pairwise loss; here that loss is online DPO: "
                    "create_algorithm_config('online_dpo', {{'beta': 0.1}}) (primitives.maths.algorithms."
                    "online_dpo(beta=0.1)), its pairs chosen within each prompt's group. 'dapo' here is DAPO of "
                    "arXiv 2503.14476 (clip-higher, dynamic sampling, token-mean loss, overlong shaping): "
                    "create_algorithm_config('dapo') (seeds README error 4)")


def check_pair_selector(selector: Callable) -> None:
    """A pair selector takes ``(members, rng)``: one prompt's group. The seeds' ``(batch)``
    shape pairs across the whole batch, answers to different prompts: refused."""
    try:
        inspect.signature(selector).bind([], None)
    except TypeError:
        raise ValueError(f"pair_selector {fn_name(selector)}{inspect.signature(selector)}: the documented signature "
                         f"is pair_selector(members, rng) -> [(chosen, rejected), ...], called on each prompt's group "
                         f"(the seeds' pair_selector(batch) pairs across the whole batch, so chosen and rejected can "
                         f"answer different prompts); e.g. primitives.maths.filters.top_bottom_pairs") from None
    except ValueError:
        pass


def create_algorithm_config(algorithm: str, params: Optional[dict] = None, **kwargs) -> SeedAlgorithmConfig:
    """The seeds' ``create_algorithm_config(algorithm, params)``: our preset
    ``primitives.maths.algorithms.get_algorithm(algorithm, **params)`` (preferred), which also
    reads as the seeds' dict (``cfg["algorithm"]``). The seeds' ``clip_epsilon`` sets both
    clip bounds, ``beta`` of ``online_dpo`` is its ``dpo_beta``. The seeds' pairwise "dapo"
    (``beta``/``pair_selector``) is refused: that loss is ``online_dpo`` here."""
    params = {**(params or {}), **kwargs}
    if algorithm == "dapo" and {"beta", "pair_selector"} & set(params):
        given = ", ".join(sorted({"beta", "pair_selector"} & set(params)))
        raise ValueError(f"create_algorithm_config('dapo', {{{given}}}): " + DAPO_AS_PAIRWISE.format(given=given))
    if "pair_selector" in params and params["pair_selector"] is not None and callable(params["pair_selector"]):
        check_pair_selector(params["pair_selector"])
    if "clip_epsilon" in params:
        eps = params.pop("clip_epsilon")
        params = {"clip_eps_low": eps, "clip_eps_high": eps, **params}
    if algorithm == "online_dpo":
        algo = online_dpo(beta=params.pop("beta", 0.1), **params)
    else:
        if "beta" in params:
            raise ValueError(f"create_algorithm_config({algorithm!r}, {{'beta': ...}}): beta is the pairwise "
                             f"(online DPO) loss's; create_algorithm_config('online_dpo', {{'beta': ...}})")
        algo = get_algorithm(algorithm, **params)
    return SeedAlgorithmConfig._make(algo)


def as_algorithm(config) -> AlgorithmConfig:
    """Our ``AlgorithmConfig`` of an algorithm config or of the seeds' dict
    ``{"algorithm": name, "params": {...}}``."""
    if isinstance(config, AlgorithmConfig):
        return config
    if isinstance(config, dict) and "algorithm" in config:
        return create_algorithm_config(config["algorithm"], dict(config.get("params") or {}))
    raise ValueError(f"algorithm_config: {type(config).__name__} is not an algorithm config; expected "
                     f"create_algorithm_config(name, params) or a primitives.maths.algorithms preset (grpo(...))")


# ----------------------------------------------------------------------------- reference updates

REF_UPDATE_SHAPE = ("a reference update here is ref_update_fn(ref_state, policy_weights, step, kl) -> ref_state, "
                    "with the step explicit (no counter in a closure: seeds README error 9): "
                    "create_ref_update_fn('ema', decay=0.995), create_ref_update_fn('periodic', reset_every=20) or "
                    "create_ref_update_fn('none') (primitives.maths.kl.create_ema_updater / create_periodic_updater / "
                    "fixed_reference)")


def create_ref_update_fn(strategy: str, **kwargs) -> Callable:
    """The seeds' factory: ``"ema"`` (``decay``) is ``create_ema_updater(decay)``,
    ``"periodic"`` (``reset_every``) is ``create_periodic_updater(every)`` keyed on the
    loop's step (not a closure counter), ``"none"`` is ``fixed_reference``."""
    accepted = {"ema": ("decay",), "periodic": ("reset_every",), "none": ()}.get(strategy)
    unknown = sorted(set(kwargs) - set(accepted or ()))
    if accepted is not None and unknown:
        raise ValueError(f"create_ref_update_fn({strategy!r}): unknown argument(s) {unknown}; "
                         f"accepted: {', '.join(accepted) or 'none'}")
    if strategy == "ema":
        return create_ema_updater(float(kwargs.pop("decay", 0.999)))
    if strategy == "periodic":
        return create_periodic_updater(int(kwargs.pop("reset_every", 20)))
    if strategy == "none":
        return fixed_reference
    raise ValueError(f"create_ref_update_fn: unknown strategy {strategy!r} (choose from 'ema', 'periodic', 'none')")


def check_ref_update_fn(fn: Callable) -> Callable:
    """``fn`` if it has our shape; the seeds' ``(ref_model, policy_model)`` shape is refused."""
    try:
        inspect.signature(fn).bind(None, {}, 0, None)
    except TypeError:
        raise ValueError(f"ref_model_update_fn {fn_name(fn)}{inspect.signature(fn)}: " + REF_UPDATE_SHAPE) from None
    except ValueError:
        pass
    return fn


# ----------------------------------------------------------------------------- rollouts

def create_batch_rollouts(model, tokenizer, prompts: Sequence, gen_config: _GenerationConfig,
                          ref_model=None, reward_fn: Optional[Callable] = None, tool_parser: Optional[Callable] = None,
                          batch_size: int = 8, aggregate_fn: Optional[Callable] = None, epoch: int = 0) -> RolloutBatch:
    """The seeds' ``create_batch_rollouts``: ``gen_config.n`` rollouts of each prompt (each
    prompt its own index, so its own group and uids ``e{epoch}/i{k}/s{j}``), generated
    ``batch_size`` prompts at a time; reference logprobs of the same tokens at the sampling
    temperature when ``ref_model`` is given (a model, or a ``ReferenceLogprobCache`` of one: completions
    seen before skip it); scored by ``reward_fn`` (``aggregate_fn`` for a
    vector). The batch's metadata records the sampling temperature and budget
    (``training_step`` needs them). Ours: ``primitives.model.generation.generate_rollouts`` +
    ``rollout_logprobs`` + ``score_rollouts`` (or, for training, ``cluster.loop.train.train``)."""
    if tool_parser is not None:
        raise ValueError("create_batch_rollouts(tool_parser=...): tool use is multi-turn; use "
                         "create_multiturn_rollout(...) per prompt, or train(..., tools=ToolConfig(executor, parser))")
    if batch_size < 1:
        raise ValueError(f"create_batch_rollouts: batch_size must be >= 1, got {batch_size}")
    items = [it._replace(epoch=epoch) for it in as_prompt_items(prompts)]
    rollouts = []
    for start in range(0, len(items), batch_size):
        rollouts += generate_rollouts(model, tokenizer, items[start:start + batch_size], gen_config)
    if ref_model is not None:
        if isinstance(ref_model, ReferenceLogprobCache):  # completions seen before skip the reference
            refs = ref_model(rollouts, gen_config.temperature)
        else:
            with torch.no_grad():
                refs = rollout_logprobs(ref_model, rollouts, tokenizer.pad_token_id, gen_config.temperature)
        rollouts = [r._replace(ref_logprobs=lp) for r, lp in zip(rollouts, refs)]
    if reward_fn is not None:
        rollouts = score_rollouts(rollouts, reward_fn, aggregate_fn)
    return RolloutBatch(tuple(rollouts), {"temperature": gen_config.temperature,
                                          "max_new_tokens": gen_config.max_new_tokens})


def generate_with_logprobs(model, tokenizer, prompt, gen_config: _GenerationConfig) -> Generation:
    """The seeds' ``generate_with_logprobs``: one completion's ``Generation`` (text, logprobs,
    token ids, finish reason) - ``create_rollout(model, tokenizer, prompt, gen_config).generation``."""
    return _create_rollout(model, tokenizer, prompt, gen_config._replace(n=1)).generation


def generate(model, tokenizer, prompt, config: _GenerationConfig, generator: Optional[Callable] = None) -> Generation:
    """The seeds' ``generate(model, tokenizer, prompt, config, generator=None)``: one completion's
    ``Generation``, from ``generator(model, tokenizer, prompt, config)`` (a generation backend of the
    user's; the policy scores the tokens where it returns no logprobs) or the model's own sampler."""
    return _create_rollout(model, tokenizer, prompt, config._replace(n=1), generate_fn=generator).generation


def get_reference_logprobs(*args, **kwargs):
    """Refused: the seeds' ``get_reference_logprobs(ref_model, tokenizer, prompt, token_ids)``
    has no temperature, and reference logprobs must be of the sampling temperature's softmax."""
    raise TypeError("get_reference_logprobs(ref_model, tokenizer, prompt, token_ids) cannot know the sampling "
                    "temperature the reference must score at; use create_rollout(model, tokenizer, prompt, gen_config, "
                    "ref_model=ref_model) (sets rollout.ref_logprobs, same tokens, gen_config.temperature) or "
                    "primitives.model.logprobs.rollout_logprobs(ref_model, rollouts, pad_id, temperature)")


def compute_per_token_kl(logprobs, ref_logprobs, mask=None, estimator: str = "k3") -> np.ndarray:
    """Per-token KL(policy || ref) on the sampled tokens: ``primitives.maths.kl.per_token_kl``
    (Schulman's k1/k2/k3; k3 by default), lists or arrays in, an array out. Not the seeds'
    ``exp(lp) * (lp - ref_lp)``, which estimates nothing (seeds README error 2)."""
    logp = torch.as_tensor(np.asarray(logprobs, dtype=np.float32))
    ref = torch.as_tensor(np.asarray(ref_logprobs, dtype=np.float32))
    m = None if mask is None else torch.as_tensor(np.asarray(mask, dtype=np.float32))
    return per_token_kl(logp, ref, m, estimator).numpy()


def aggregate_vector_rewards(vector, aggregate_fn: Optional[Callable] = None, aggregator: Optional[Callable] = None):
    """``primitives.env.rewards.aggregate_vector_rewards`` with the seeds' keyword
    ``aggregator=`` too. Our ``weighted_sum_aggregator`` / ``min_threshold_aggregator`` /
    ``lexicographic_aggregator`` are factories: pass ``weighted_sum_aggregator([0.4, 0.6])``,
    not the factory itself (refused by name)."""
    fn = aggregate_fn if aggregate_fn is not None else aggregator
    if fn is None:
        raise TypeError("aggregate_vector_rewards(vector, aggregate_fn): no aggregator given")
    value = fn(vector)
    if callable(value):
        raise ValueError(f"aggregator {fn_name(fn)} returned a function: it is a factory; pass "
                         f"{getattr(fn, '__name__', 'it')}(...) (e.g. weighted_sum_aggregator([0.4, 0.3, 0.2, 0.1]))")
    return _aggregate_vector_rewards(vector, lambda v: value)


def compute_grpo_advantages(batch: RolloutBatch, advantage_fn: Optional[Callable] = None) -> list:
    """GRPO advantages of the batch's rollouts, ``(R - mean_G) / (std_G + eps)`` within each
    prompt's group (``primitives.maths.advantages.grpo_advantages``; not the seeds' whole-batch
    mean). ``advantage_fn(rewards) -> advantages`` replaces it, as in the seeds."""
    from primitives.maths.advantages import grpo_advantages

    check_unique_uids(batch.rollouts)
    rewards = [float(r.reward) for r in batch.rollouts]
    if advantage_fn is not None:
        return list(advantage_fn(rewards))
    return grpo_advantages(torch.tensor(rewards), [r.group for r in batch.rollouts]).tolist()


def check_unique_uids(rollouts: Sequence[Rollout]) -> None:
    seen = set()
    for r in rollouts:
        if r.uid in seen:
            raise ValueError(f"two rollouts have uid {r.uid}: rollouts of different prompts made one at a time all "
                             f"get index 0 (one group); make them with create_batch_rollouts (each prompt its own "
                             f"index), or create_multiturn_rollout(..., index=k)")
        seen.add(r.uid)


def compute_grpo_loss(*args, **kwargs):
    """Refused: the seeds' loss is built from Python floats (seeds README error 1)."""
    raise TypeError("compute_grpo_loss(batch, advantages, kl_coef=...) is the seeds' loss built as "
                    "torch.tensor(float, requires_grad=True): no gradient reaches the model (seeds README error 1). "
                    "Train with training_step(state, batch, create_algorithm_config('grpo', {'kl_coef': 0.1})) - "
                    "primitives.model.training.train_on_batch(model, optimizer, make_batch(rollouts, "
                    "grpo(kl_coef=0.1), pad_id), grpo(kl_coef=0.1), temperature), which recomputes logprobs with "
                    "autograd")


def compute_reward_model_score(model, tokenizer, prompt, text) -> float:
    """The score of a sequence-classification reward model (``AutoModelForSequenceClassification``,
    one label) of ``prompt + text``: ``primitives.env.rewards.reward_model_scores``. A causal
    LM is refused: it has no reward head."""
    from primitives.env.rewards import reward_model_scores

    if "ForSequenceClassification" not in type(model).__name__ or getattr(model.config, "num_labels", None) != 1:
        raise ValueError(f"compute_reward_model_score: {type(model).__name__} is not a reward model (a sequence "
                         f"classifier with one label); load one with primitives.env.rewards.load_reward_model(path)")
    return float(reward_model_scores(model, tokenizer, [f"{prompt}{text}"])[0])


# ----------------------------------------------------------------------------- models

def load_tokenizer(config, tokenizer_loader: Optional[Callable] = None):
    """The seeds' ``load_tokenizer(config, tokenizer_loader=None)``: ``tokenizer_loader(config)``, or the
    tokenizer of ``config.model_name_or_path`` (a ``ModelConfig``, or a local directory)."""
    from primitives.types import ModelConfig

    config = ModelConfig(config) if isinstance(config, str) else config
    if tokenizer_loader is not None:
        return tokenizer_loader(config)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.model_name_or_path, trust_remote_code=config.trust_remote_code)


def load_reward_model(config, loader: Optional[Callable] = None, device: str = "cpu"):
    """The seeds' ``load_reward_model(config, loader=None)``: ``loader(config)``, or the sequence
    classifier of ``config.model_name_or_path`` (``primitives.env.rewards.load_reward_model``, which
    returns its tokenizer too: kept on the model as ``reward_tokenizer``, since the score is of text
    tokenized by the reward model's own tokenizer)."""
    from primitives.env.rewards import load_reward_model as ours
    from primitives.types import ModelConfig

    config = ModelConfig(config) if isinstance(config, str) else config
    if loader is not None:
        return loader(config)
    model, tokenizer = ours(config.model_name_or_path, device)
    model.reward_tokenizer = tokenizer
    return model


def create_rm_reward_fn(reward_model, tokenizer, render: Optional[Callable] = None) -> Callable:
    """The seeds' ``create_rm_reward_fn(reward_model, tokenizer)``: ``primitives.env.rewards.create_rm_reward_fn``
    (prompt + completion text scored by the reward model). The seeds pass the policy's tokenizer; one
    whose vocabulary differs from the reward model's own is refused (its ids would mean other tokens)."""
    from primitives.env.rewards import create_rm_reward_fn as ours

    own = getattr(reward_model, "reward_tokenizer", None)
    if own is not None and tokenizer is not own and tokenizer.get_vocab() != own.get_vocab():
        raise ValueError("create_rm_reward_fn: this tokenizer's vocabulary is not the reward model's (the seeds pass "
                         "the policy's); pass the reward model's own: create_rm_reward_fn(reward_model, "
                         "reward_model.reward_tokenizer)")
    return ours(reward_model, tokenizer, render)


SEED_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_model(model_id: str, dtype: str = "float32", device_map: Optional[str] = None, use_lora: bool = False,
               lora_rank: int = 16, lora_alpha: int = 32, model_loader: Optional[Callable] = None):
    """The seeds' ``load_model``: a causal LM from a local directory, with ``use_lora`` wrapped in
    LoRA adapters on the seeds' seven projections (``primitives.model.lora.with_lora``: only the
    adapters train). ``model_loader(model_id, dtype, device_map, use_lora, lora_rank, lora_alpha)``
    replaces the loading, as in the seeds. Unlike the seeds: float32 by default (the CPU's); dropout
    off everywhere, the adapters' too (logprobs must be a function of the weights); nothing is
    downloaded. A Ray job takes the same adapters as ``model.lora`` in its config."""
    from primitives.model.lora import with_lora
    from primitives.types import LoraConfig, ModelConfig
    from rl_actors.common import load_causal_lm

    if model_loader is not None:
        return model_loader(model_id, dtype, device_map, use_lora, lora_rank, lora_alpha)
    if not os.path.isdir(str(model_id)):
        raise ValueError(f"load_model: model_id {model_id!r} is not a local model directory (nothing is downloaded "
                         f"here: save the model with save_pretrained, or see primitives.fixtures)")
    model, _ = load_causal_lm(ModelConfig(model_id, dtype=dtype, device=device_map or "auto"), "load_model")
    if use_lora:
        model = with_lora(model, LoraConfig(rank=lora_rank, alpha=float(lora_alpha), target_modules=tuple(
            t for t in SEED_LORA_TARGETS if any(n.endswith("." + t) for n, _ in model.named_modules()))))
    return model


# ----------------------------------------------------------------------------- tools

class SeedToolCall(ToolCall):
    """A ``ToolCall`` that also reads as the seeds' dict: ``call["name"]``, ``call["arguments"]``,
    ``call["id"]`` (and ``.get``)."""

    __slots__ = ()
    KEYS = {"name": "name", "arguments": "arguments", "id": "id", "args": "arguments"}

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in self.KEYS:
                raise KeyError(f"{key!r} (a tool call has {', '.join(self.KEYS)})")
            return getattr(self, self.KEYS[key])
        return tuple.__getitem__(self, key)

    def get(self, key, default=None):
        return getattr(self, self.KEYS[key]) if key in self.KEYS else default


class SeedToolResult(ToolResult):
    """A ``ToolResult`` that also reads as the seeds' dict: ``r["id"]``, ``r["output"]``,
    ``r["success"]`` (not ``is_error``), ``r.get("success")``."""

    __slots__ = ()
    KEYS = ("id", "output", "success", "name")

    def _seed(self, key):
        return {"id": self.call_id, "output": self.content, "success": not self.is_error, "name": self.name}[key]

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in self.KEYS:
                raise KeyError(f"{key!r} (a tool result has {', '.join(self.KEYS)})")
            return self._seed(key)
        return tuple.__getitem__(self, key)

    def get(self, key, default=None):
        return self._seed(key) if key in self.KEYS else default


def as_tool_call(call, k: int) -> ToolCall:
    if isinstance(call, ToolCall):
        return SeedToolCall._make(call)
    if isinstance(call, dict) and "name" in call:
        args = call.get("arguments", call.get("args", {}))
        return SeedToolCall(str(call["name"]), args if isinstance(args, dict) else {"input": args},
                            str(call.get("id", f"call_{k}")))
    raise ValueError(f"tool_parser returned {type(call).__name__}; expected a ToolCall or the seeds' dict "
                     f"{{'name', 'arguments', 'id'}}")


def as_tool_result(result, call: ToolCall) -> ToolResult:
    if isinstance(result, ToolResult):
        return SeedToolResult._make(result)
    if isinstance(result, dict) and "output" in result:
        return SeedToolResult(str(result.get("id", call.id)), call.name, str(result["output"]),
                              not bool(result.get("success", True)))
    raise ValueError(f"tool_executor returned {type(result).__name__}; expected a primitives.env.tools.ToolResult or "
                     f"the seeds' dict {{'id', 'output', 'success'}}")


def seed_tool_parser(parser: Callable) -> Callable:
    """``parser(text)`` whose calls (``ToolCall``s or the seeds' dicts) read both ways."""
    def parse(text: str) -> list:
        return [as_tool_call(c, k) for k, c in enumerate(parser(text))]

    parse.__name__ = getattr(parser, "__name__", "tool_parser")
    return parse


def seed_tool_executor(executor: Callable) -> Callable:
    """``executor(call)`` whose result (a ``ToolResult`` or the seeds' dict) reads both ways."""
    def execute(call: ToolCall) -> ToolResult:
        return as_tool_result(executor(call), call)

    execute.__name__ = getattr(executor, "__name__", "tool_executor")
    return execute


def create_rollout(model, tokenizer, prompt, gen_config: _GenerationConfig = _GenerationConfig(), ref_model=None,
                   reward_fn: Optional[Callable] = None, tool_parser: Optional[Callable] = None, conversation=None,
                   **ours) -> Rollout:
    """The seeds' ``create_rollout(model, tokenizer, prompt, gen_config, ref_model=None, reward_fn=None,
    tool_parser=None)``: ``primitives.env.rollouts.create_rollout`` (preferred; its other keywords -
    ``aggregate_fn``, ``shaping_fn``, ``generator``/``generate_fn`` - pass through). The seeds'
    ``tool_parser`` may return their dicts (``{"name", "arguments", "id"}``); the rollout's
    ``tool_calls`` read both ways (``call["name"]``). A conversation is given as the prompt."""
    if conversation is not None:
        raise ValueError("create_rollout(conversation=...): here the conversation is the prompt - "
                         "create_rollout(model, tokenizer, Conversation(messages), gen_config), rendered by the "
                         "tokenizer's chat template; a conversation with tool turns is create_multiturn_rollout(...)")
    return _create_rollout(model, tokenizer, prompt, gen_config, ref_model=ref_model, reward_fn=reward_fn,
                           tool_parser=None if tool_parser is None else seed_tool_parser(tool_parser), **ours)


def execute_and_track_tools(rollout: Rollout, tool_executor: Callable,
                            result_tracker: Optional[Callable] = None) -> Rollout:
    """The seeds' ``execute_and_track_tools``: ``primitives.env.tools.execute_and_track_tools``
    (preferred) with the seeds' shapes accepted - an executor that takes and returns their dicts
    (``call["arguments"]`` -> ``{"id", "output", "success"}``), results that read both ways in
    ``result_tracker(results)`` and in ``rollout.tool_results``."""
    seeded = rollout._replace(tool_calls=tuple(SeedToolCall._make(c) for c in rollout.tool_calls))
    return _execute_and_track_tools(seeded, seed_tool_executor(tool_executor), result_tracker)


def create_multiturn_rollout(model, tokenizer, initial_conversation, gen_config: _GenerationConfig,
                             num_turns: int = 4, tool_parser: Optional[Callable] = None,
                             tool_executor: Optional[Callable] = None, stop_condition: Optional[Callable] = None,
                             reward_fn: Optional[Callable] = None, index: int = 0) -> Rollout:
    """The seeds' ``create_multiturn_rollout``: ``primitives.env.tools.multiturn_rollout``
    (preferred; on the loop ``train(..., tools=ToolConfig(...))``) over the model's HF
    generation. Tool output tokens are masked out of the loss (loss_mask 0; not the seeds'
    unmasked concatenation, README error 7). The seeds' dict-shaped calls and results are
    accepted, and the rollout's ``tool_calls`` / ``tool_results`` read both ways
    (``call["name"]``, ``result.get("success")``). ``index`` numbers the prompt (its group)."""
    from primitives.env.tools import parse_xml_tool_calls

    if tool_executor is None:
        raise ValueError("create_multiturn_rollout needs a tool_executor(call) -> result")
    prompt = initial_conversation
    if isinstance(prompt, Conversation) and not isinstance(prompt.messages, tuple):
        prompt = Conversation(tuple(prompt.messages))
    item = prompt if isinstance(prompt, PromptItem) else PromptItem(index=index, prompt=prompt)
    turn = hf_turn_generator(model, tokenizer, gen_config._replace(n=1))
    rollout = multiturn_rollout(item, tokenizer, turn, seed_tool_parser(tool_parser or parse_xml_tool_calls),
                                seed_tool_executor(tool_executor), stop_condition or no_tool_calls_stop,
                                max_turns=num_turns)
    rollout = rollout._replace(tool_calls=tuple(SeedToolCall._make(c) for c in rollout.tool_calls),
                               tool_results=tuple(SeedToolResult._make(r) for r in rollout.tool_results))
    if reward_fn is not None:
        rollout = score_rollouts([rollout], reward_fn)[0]
    return rollout
