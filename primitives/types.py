"""Immutable records that cross every boundary (architecture section 3).

All records are ``NamedTuple``s: update them with ``_replace``. Per-token data is numpy so
that it travels through the Ray object store without copies; actors convert to torch where
they compute. Shapes use P = prompt length, T = completion length, B = batch size,
K = number of reward components, L = P + T.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

ROLES = ("system", "user", "assistant", "tool")


class PromptItem(NamedTuple):
    """One task item. ``epoch`` is set by the prompt source when the item is served."""

    # position in the dataset: with epoch, the stable identity of the prompt (shadows tuple.index)
    index: int  # type: ignore[assignment]
    prompt: Any  # str, or a Conversation for chat models
    answer: Any = None  # reference answer for verifiable rewards
    epoch: int = 0
    metadata: Optional[dict] = None  # the record's other fields, passed on to reward functions
    source: Optional[str] = None  # where the record came from: "file:line" or "file, row k"


class Message(NamedTuple):
    """One chat message. ``role`` is one of system/user/assistant/tool."""

    role: str
    content: str
    tool_calls: Optional[tuple] = None  # tuple of ToolCall, on assistant messages
    tool_call_id: Optional[str] = None  # on tool messages: which call this answers
    name: Optional[str] = None  # on tool messages: the tool's name


class Conversation(NamedTuple):
    """A multi-turn conversation; ``add_message`` returns a new conversation."""

    messages: tuple = ()

    def add_message(self, message: Message) -> "Conversation":
        return Conversation(tuple(self.messages) + (message,))

    def last(self, role: Optional[str] = None) -> Optional[Message]:
        """The last message (of ``role`` if given), or None."""
        for m in reversed(self.messages):
            if role is None or m.role == role:
                return m
        return None


DECODE_MODES = ("auto", "eager", "packed", "static", "captured")  # GenerationConfig.decode


class GenerationConfig(NamedTuple):
    """Sampling settings. ``temperature == 0`` means greedy decoding."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    n: int = 1  # completions per prompt (the group size G for GRPO)
    stop: tuple = ()  # stop strings; the completion ends after the first one produced
    seed: Optional[int] = None  # seeds a private torch.Generator; None = global RNG
    stop_token_ids: tuple = ()  # extra token ids that end a completion (e.g. <|im_end|>)
    template_kwargs: Optional[dict] = None  # extra chat-template variables, e.g. {"enable_thinking": False}
    # HF decode loop: "auto" (captured on CUDA where the model allows a static cache; packed on a CPU for
    # a batch of 8+ rows and 16+ tokens; else eager), "eager", "packed" (eager, the linear weights of
    # 16 MiB or more packed for oneDNN on a CPU), "static" (a static KV cache, uncompiled) or "captured"
    # (static + torch.compile; CUDA graphs on CUDA). vLLM ignores it (primitives.model.static_decode,
    # primitives.model.packed_decode)
    decode: str = "auto"
    # HF decode loop: the most rows (prompts x n) decoded together (0: all of a call's rows at once). A call
    # with more runs them in the fewest batches under it, of even sizes (``generation.batch_rows``), each with
    # its own KV cache and logits, so memory grows with this, not with the call; every batch draws from the
    # call's sampler in turn. vLLM schedules its own batches (it ignores it; a job refuses it with vLLM)
    max_batch_rows: int = 0


class LoraConfig(NamedTuple):
    """Low-rank adapters (LoRA, Hu et al. 2021) through PEFT: the policy trains only the adapters
    ``W + (alpha / rank) * B @ A`` on the target modules; the base weights stay frozen."""

    rank: int = 0  # adapter rank r (0: no LoRA, every weight trains)
    alpha: Optional[float] = None  # the update's scale is alpha / rank (None: alpha = 2 x rank, scale 2)
    dropout: float = 0.0  # must be 0: logprob forwards run without dropout (primitives.model.logprobs.disable_dropout)
    # module names (a name matches a module whose dotted path ends with it), or all-linear: every linear layer but
    # the output head
    target_modules: tuple[str, ...] = ("all-linear",)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return (2.0 * self.rank if self.alpha is None else self.alpha) / self.rank


class ModelConfig(NamedTuple):
    """Where and how to load a model."""

    model_name_or_path: str  # a local Hugging Face model directory (config.json, weights, tokenizer)
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto": the actor's GPU when it has one, else "cpu"; or "cpu", "cuda", "cuda:1"
    trust_remote_code: bool = False  # run the model directory's own modelling code (custom architectures)
    attn_implementation: Optional[str] = None  # e.g. "eager", "sdpa"; None = HF default
    lora: LoraConfig = LoraConfig()  # train low-rank adapters instead of every weight (rank > 0)


VLLM_MIN_TEMPERATURE = 0.01  # vllm.sampling_params raises a temperature in (0, 0.01) to 0.01, with a warning
VLLM_CPU_BLOCK = 32  # vLLM's CPU attention takes KV-cache blocks of a multiple of this many tokens (0.32)


class VLLMConfig(NamedTuple):
    """The vLLM engine's settings a user tunes (``cluster.vllm``); they apply where a generator
    worker runs vLLM (``cluster.generator_backend: vllm``, or auto with GPUs)."""

    tensor_parallel_size: int = 1  # GPUs one generator's engine spans; only 1 runs today (more: a named error)
    gpu_memory_utilization: float = 0.9  # GPU only: share of the GPU vLLM takes for weights and KV cache
    max_model_len: Optional[int] = None  # longest prompt + completion in tokens (None: the model's own limit)
    enable_prefix_caching: bool = True  # reuse the KV cache of shared prompt prefixes (reset at every weight sync)
    cpu_kv_cache_gib: int = 1  # CPU only: KV cache size in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE)
    enable_sleep_mode: bool = False  # GPU only: release GPU memory between generate calls
    # tokens per KV-cache block; prompts share cached KV in whole blocks only (None: 32 on CPU, where vLLM's own 128
    # left a group's ~46-token chat prompts unshared, prefilled once per sample; vLLM's own default on a GPU)
    block_size: Optional[int] = None


class Generation(NamedTuple):
    """One completion as the seeds' ``Generation`` record names it: a read-only view built by
    ``Rollout.generation`` from the rollout's own fields (it stores nothing of its own)."""

    text: str  # Rollout.text
    logprobs: np.ndarray  # (T,) float32 Rollout.logprobs
    token_ids: np.ndarray  # (T,) int64 Rollout.completion_ids
    finish_reason: str  # Rollout.finish_reason


class RolloutFields(NamedTuple):
    """The fields of a ``Rollout`` (see there)."""

    uid: str  # stable id "e{epoch}/i{index}/s{sample}": exact per-epoch accounting
    group: str  # id of the prompt this answers "e{epoch}/i{index}"; G rollouts share it
    prompt: Any  # the prompt as given: str or Conversation
    prompt_ids: np.ndarray  # (P,) int64 token ids of the rendered prompt
    completion_ids: np.ndarray  # (T,) int64 token ids produced after the prompt
    loss_mask: np.ndarray  # (T,) float32 1 where the policy produced the token, 0 for tool output
    logprobs: np.ndarray  # (T,) float32 behaviour-policy logprob of each completion token
    policy_version: int = 0  # version of the weights that produced the completion
    finish_reason: str = "length"  # "stop" (eos or stop string) | "length" | "tool_error"
    text: str = ""  # decoded completion (policy and tool text interleaved for multi-turn)
    ref_logprobs: Optional[np.ndarray] = None  # (T,) float32 reference logprobs, same tokens
    reward: Optional[float] = None  # scalar reward after aggregation and shaping
    reward_vector: Optional[np.ndarray] = None  # (K,) float32 reward components
    tool_calls: tuple = ()  # ToolCall records, in order
    tool_results: tuple = ()  # ToolResult records, in order
    answer: Any = None  # the reference answer of the task item (for verifiable rewards)
    metadata: Optional[dict] = None  # free-form, JSON-friendly


# the seeds' Rollout fields (seeds/000 "Rollout") that are not ours, and what stands for each here
SEED_ROLLOUT_NAMES = {
    "generation": "the read-only view rollout.generation (text, token_ids, logprobs, finish_reason)",
    "conversation": "the read-only view rollout.conversation (prompt + completion, or the multi-turn "
                    "metadata['conversation'])",
    "token_ids": "completion_ids (the read-only view rollout.token_ids reads it)",
    "rewards": "reward (the scalar after aggregation) and reward_vector (the components); rollout.rewards "
               "reads them",
    "reward_metadata": "metadata",
    "kl_divergence": "nothing per rollout: KL is computed in the loss from ref_logprobs by the algorithm's "
                     "kl_fn (k1/k2/k3) and logged as kl/ref_k3 (seeds README errors 1 and 2)",
    "per_token_kl": "nothing per rollout: primitives.maths.kl.per_token_kl(logprobs, ref_logprobs) computes "
                    "it from ref_logprobs (k3 by default)",
}


class Rollout(RolloutFields):
    """One sampled completion with everything the trainer needs.

    Per-token arrays all have length T (the completion) and are aligned token by token.

    The seeds' spellings read as views of these fields: ``rollout.generation`` (``.text``,
    ``.token_ids``, ``.logprobs``, ``.finish_reason``), ``rollout.conversation``,
    ``rollout.rewards`` and ``rollout.token_ids``. Their other names (``kl_divergence``,
    ``reward_metadata``, ...) raise an error naming what stands for them here.
    """

    __slots__ = ()

    def __new__(cls, *args, **kwargs):
        seed = sorted(k for k in kwargs if k in SEED_ROLLOUT_NAMES)
        if seed:
            raise TypeError(f"Rollout({', '.join(k + '=...' for k in seed)}): the seeds' fields; a Rollout here is "
                            f"made by create_rollout(model, tokenizer, prompt, gen_config, ref_model=..., "
                            f"reward_fn=...) (fields {', '.join(RolloutFields._fields)}). "
                            + "; ".join(f"{k}: {SEED_ROLLOUT_NAMES[k]}" for k in seed))
        return super().__new__(cls, *args, **kwargs)

    def _replace(self, **kwargs) -> "Rollout":
        """A new rollout with ``kwargs`` replaced (the rollout itself never changes: keep the
        result). The seeds' ``rewards=<float>`` sets ``reward``."""
        if "rewards" in kwargs and "reward" not in kwargs and isinstance(kwargs["rewards"], (int, float)) \
                and not isinstance(kwargs["rewards"], bool):
            kwargs["reward"] = float(kwargs.pop("rewards"))
            kwargs.setdefault("reward_vector", None)  # a scalar replaces any components
        seed = sorted(k for k in kwargs if k in SEED_ROLLOUT_NAMES)
        if seed:
            raise ValueError(f"Rollout._replace({', '.join(k + '=...' for k in seed)}): not fields here; "
                             + "; ".join(f"{k}: {SEED_ROLLOUT_NAMES[k]}" for k in seed)
                             + ". _replace returns a new rollout, it does not change this one: a reward function "
                               "returns its reward (a vector of components, with aggregate_fn) and the scorer "
                               "keeps it in reward / reward_vector (seeds README error 9)")
        return super()._replace(**kwargs)

    def __getattr__(self, name: str):
        # only for names that are not attributes: the seeds' names get an error naming ours
        view = getattr(type(self), name, None)
        if isinstance(view, property) and view.fget is not None:  # a view raised AttributeError inside: let it through
            return view.fget(self)
        if name in SEED_ROLLOUT_NAMES:
            raise AttributeError(f"'Rollout' object has no attribute '{name}' (the seeds' name); here: "
                                 f"{SEED_ROLLOUT_NAMES[name]}")
        raise AttributeError(f"'Rollout' object has no attribute '{name}'")

    @property
    def num_tokens(self) -> int:
        return int(len(self.completion_ids))

    @property
    def generation(self) -> Generation:
        """The seeds' ``rollout.generation``: text, token ids, logprobs and finish reason."""
        return Generation(self.text, self.logprobs, self.completion_ids, self.finish_reason)

    @property
    def token_ids(self) -> np.ndarray:
        """The seeds' ``rollout.token_ids``: the completion's token ids, ``(T,) int64``."""
        return self.completion_ids

    @property
    def rewards(self):
        """The seeds' ``rollout.rewards``: the components as a list when the reward is a vector,
        else the scalar reward (None before scoring)."""
        if self.reward_vector is not None:
            return [float(v) for v in np.asarray(self.reward_vector).ravel()]
        return self.reward

    @property
    def conversation(self) -> Conversation:
        """The seeds' ``rollout.conversation``: a multi-turn rollout's messages (its
        ``metadata["conversation"]``: prompt, assistant turns and tool results); otherwise the
        prompt (its messages, or a user message of its text) and an assistant message of the
        completion."""
        turns = (self.metadata or {}).get("conversation")
        if turns is not None:
            return Conversation(tuple(message_from_dict(m) for m in turns))
        prompt = self.prompt
        if hasattr(prompt, "prompt") and hasattr(prompt, "index"):  # a PromptItem
            prompt = prompt.prompt
        if isinstance(prompt, Conversation):
            messages = tuple(prompt.messages)
        elif isinstance(prompt, (list, tuple)):
            messages = tuple(message_from_dict(m) if isinstance(m, dict) else m for m in prompt)
        else:
            messages = (Message("user", str(prompt)),)
        return Conversation(messages + (Message("assistant", self.text),))


def message_from_dict(d) -> Message:
    """A ``Message`` of a chat dict (``{"role", "content", "tool_call_id"?, "name"?}``); a
    ``Message`` passes through. Tool calls stay as the dicts they were."""
    if isinstance(d, Message):
        return d
    calls = d.get("tool_calls")
    return Message(d["role"], d.get("content") or "", tuple(calls) if calls else None, d.get("tool_call_id"),
                   d.get("name"))


class RolloutSummary(NamedTuple):
    """What the driver holds of a rollout while the rollout itself stays where it was scored
    (architecture section 2: data moves by reference): O(1) numbers per rollout, no tokens."""

    uid: str
    group: str
    policy_version: int
    reward: Optional[float]
    num_tokens: int  # completion tokens
    has_ref: bool  # ref_logprobs are set
    tool_calls: int = 0
    tool_results: int = 0
    tool_errors: int = 0
    untrained_tokens: int = 0  # completion tokens outside the loss mask (tool output, its template)


def summarize(r: "Rollout") -> RolloutSummary:
    return RolloutSummary(r.uid, r.group, int(r.policy_version), None if r.reward is None else float(r.reward),
                          r.num_tokens, r.ref_logprobs is not None, len(r.tool_calls), len(r.tool_results),
                          sum(bool(res.is_error) for res in r.tool_results),
                          r.num_tokens - int(np.asarray(r.loss_mask).sum()))


class BatchPlan(NamedTuple):
    """A step's rollouts by reference and how to batch them. Every trainer (and critic) rank
    receives the plan and the parts it names - each part a scored chunk of rollouts with, when
    the reference scored beside the reward, that chunk's reference-logprob arrays - and builds
    the same ``Batch`` from them (``primitives.maths.batching.planned_batch``)."""

    rows: tuple  # ((part, index), ...): rollout ``index`` of part ``part``, in training order
    pad_token_id: int
    seed: int = 0  # the pair selector's seed (a pairwise loss)
    budget: int = 0  # the generation budget (GenerationConfig.max_new_tokens)
    component_names: Optional[tuple] = None  # reward component names for ``reward/<name>``


def planned_rollouts(plan: "BatchPlan", parts: Sequence) -> list:
    """The rollouts ``plan`` names, in its order, from ``parts`` (``[(rollouts, reference-logprob
    arrays or None), ...]``); a part's arrays, when given, become its rollouts' ``ref_logprobs``."""
    out = []
    for p, i in plan.rows:
        rollouts, arrays = parts[p]
        out.append(rollouts[i] if arrays is None else rollouts[i]._replace(ref_logprobs=arrays[i]))
    return out


class BatchFields(NamedTuple):
    """The fields of a ``Batch`` (see there)."""

    rollouts: tuple  # B Rollouts
    input_ids: np.ndarray  # (B, P + T) int64
    attention_mask: np.ndarray  # (B, P + T) int64, 0 on padding
    prompt_len: int  # P
    loss_mask: np.ndarray  # (B, T) float32
    behaviour_logprobs: np.ndarray  # (B, T) float32 the generator's logprobs (0 on padding)
    rewards: np.ndarray  # (B,) float32
    advantages: np.ndarray  # (B, T) float32 (0 where loss_mask is 0)
    ref_logprobs: Optional[np.ndarray] = None  # (B, T) float32
    returns: Optional[np.ndarray] = None  # (B, T) float32, PPO value targets
    values: Optional[np.ndarray] = None  # (B, T) float32, critic values at rollout time
    # (B, T) float32 the trainer's own logprobs before this step's first update: the clip
    # ratio's denominator. None: one update per batch, where they equal ``logp.detach()``.
    old_logprobs: Optional[np.ndarray] = None
    budget: int = 0  # the generation budget (max completion tokens): Dr.GRPO's constant normaliser


class Batch(BatchFields):
    """The rollouts of one step and the padded arrays the loss needs.

    Layout (as in veRL): prompts left-padded to P, completions right-padded to T, so the
    logit that predicts completion token t sits at position P - 1 + t for every row.
    ``len(batch)`` is the number of rows.
    """

    __slots__ = ()

    @classmethod
    def _make(cls, iterable):  # type: ignore[override]
        # NamedTuple's _make (behind _replace) checks len(); __len__ counts rows, so check fields here
        result = tuple.__new__(cls, iterable)
        if tuple.__len__(result) != len(cls._fields):
            raise TypeError(f"Batch expects {len(cls._fields)} fields, got {tuple.__len__(result)}")
        return result

    def __len__(self) -> int:
        """The number of rows (rollouts), as for any batch."""
        return len(self.rollouts)

    @property
    def size(self) -> int:
        return len(self.rollouts)

    def select(self, indices: Sequence[int]) -> "Batch":
        """A new batch holding rows ``indices`` (padding is left as it was)."""
        idx = np.asarray(indices, dtype=np.int64)
        pick = lambda a: None if a is None else a[idx]  # noqa: E731
        return self._replace(
            rollouts=tuple(self.rollouts[i] for i in idx),
            input_ids=self.input_ids[idx], attention_mask=self.attention_mask[idx],
            loss_mask=self.loss_mask[idx], behaviour_logprobs=self.behaviour_logprobs[idx],
            rewards=self.rewards[idx], advantages=self.advantages[idx],
            ref_logprobs=pick(self.ref_logprobs), returns=pick(self.returns),
            values=pick(self.values), old_logprobs=pick(self.old_logprobs),
        )

    def filter(self, predicate: Callable[[Rollout], bool]) -> "Batch":
        """A new batch with the rollouts for which ``predicate(rollout)`` is true."""
        return self.select([i for i, r in enumerate(self.rollouts) if predicate(r)])

    def shard(self, rank: int, world_size: int, unit: int = 1) -> "Batch":
        """Rank ``rank``'s contiguous share of the rows, split in whole ``unit``s (2 keeps
        online-DPO pairs together). Shares differ in size by at most one unit."""
        if self.size % unit:
            raise ValueError(f"batch of {self.size} rows is not a whole number of units of {unit}")
        units = self.size // unit
        lo, hi = (units * rank) // world_size, (units * (rank + 1)) // world_size
        return self.select(range(lo * unit, hi * unit))

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_loss_sequences(self) -> int:
        """Rows with at least one loss token (a masked-out truncated row does not count)."""
        return int((self.loss_mask.sum(1) > 0).sum())


class RolloutBatchFields(NamedTuple):
    """The fields of a ``RolloutBatch`` (see there)."""

    rollouts: tuple  # the rollouts, in order
    batch_metadata: Optional[dict] = None  # free-form: e.g. the sampling temperature they were made at


class RolloutBatch(RolloutBatchFields):
    """Rollouts without padded arrays, as the seeds' ``Batch(rollouts, batch_metadata)`` has
    them: what ``iteration_hook(state, batch)`` receives (the step's trained rollouts) and what
    the seeds' ``create_batch_rollouts`` returns. ``len(batch)`` is the number of rollouts;
    ``primitives.maths.batching.make_batch`` makes the trainer's ``Batch`` of them."""

    __slots__ = ()

    @classmethod
    def _make(cls, iterable):  # type: ignore[override]
        result = tuple.__new__(cls, iterable)  # __len__ counts rollouts: check the fields here
        if tuple.__len__(result) != len(cls._fields):
            raise TypeError(f"RolloutBatch expects {len(cls._fields)} fields, got {tuple.__len__(result)}")
        return result

    def __len__(self) -> int:
        return len(self.rollouts)

    def filter(self, predicate: Callable[[Rollout], bool]) -> "RolloutBatch":
        """A new batch of the rollouts for which ``predicate(rollout)`` is true."""
        return self._replace(rollouts=tuple(r for r in self.rollouts if predicate(r)))


class DataPosition(NamedTuple):
    """Where a prompt source stands: epoch and offset into that epoch's order."""

    epoch: int = 0
    offset: int = 0


class TrainState(NamedTuple):
    """Everything the loop needs to resume exactly (weights and optimizer live in checkpoints)."""

    iteration: int = 0
    global_step: int = 0  # RL steps that updated the weights (a skipped step does not count; one update is
    #                     algo.ppo_epochs x algo.mini_batches optimizer steps)
    policy_version: int = 0  # bumped by every weight sync
    data_position: DataPosition = DataPosition()
    rng_seed: int = 0
    metrics_history: tuple = ()  # tuple of flat metric dicts, one per iteration


def make_uid(epoch: int, index: int, sample: int) -> str:
    """Stable rollout id: epoch, dataset index, sample index within the group."""
    return f"e{epoch}/i{index}/s{sample}"


def group_id(epoch: int, index: int) -> str:
    return f"e{epoch}/i{index}"
