"""Job configuration: one YAML file mirrors small records, one per concern, every field documented.

``rayrl rl job.yaml`` reads an ``RLJob``, ``rayrl sft job.yaml`` an ``SFTJob``. The file is
checked against the records (an unknown key is an error naming it, its line and the closest
valid key; a value of the wrong type names its field), then tyro derives the command line
from the same records, so every field can be overridden (``--algorithm.lr 1e-5``) and
``--help`` documents each one with the file's values as defaults. Each field's inline comment
is its documentation. Hooks named ``module:function`` and every other check that needs no Ray
run in ``cluster/jobs/checks.py`` and ``inputs.py`` before Ray starts.
"""
from __future__ import annotations

import os
import types
from typing import Any, NamedTuple, Optional, Union, get_args, get_origin, get_type_hints

from cluster.ray_wing.config import ClusterConfig
from primitives.env.rewards import RewardSpec
from primitives.hooks import (
    did_you_mean,
    load_function,  # noqa: F401 (the job's hooks resolve here, before Ray starts)
)
from primitives.io.data import EvalData, FieldMap, PromptFormat, SFTFields
from primitives.types import ModelConfig

EMBEDDED_MODELS = ("tiny", "smollm2")  # model_name_or_path names of the models built in (inputs.resolve_model)
MODEL_CACHE_ENV = "RAYRL_MODEL_CACHE"  # where the embedded SmolLM2 is converted to (default ~/.cache/rayrl)


def embedded_model_dir(name: str, out: str) -> str:
    """The directory an embedded model (``EMBEDDED_MODELS``) is built into: the tiny model into
    ``<out>/base_model``, SmolLM2 converted once into ``$RAYRL_MODEL_CACHE``."""
    if name == "tiny":
        return os.path.join(out, "base_model")
    cache = os.path.expanduser(os.environ.get(MODEL_CACHE_ENV) or "~/.cache/rayrl")
    return os.path.join(cache, "smollm2-135m-instruct")

Scalar = Union[bool, int, float, str]  # a value of a config dict (task or reward arguments)



class DataConfig(NamedTuple):
    task: Optional[str] = None  # a generated task instead of a file: arithmetic, chat_arithmetic or module:function
    task_kwargs: Optional[dict[str, Scalar]] = None  # the task's arguments (e.g. num_heldout: 256)
    path: Optional[str] = None  # prompt file (.jsonl, .json, .csv, .parquet) or a local HF datasets directory
    split: str = "train"  # split of a datasets directory, or name part of the files of a directory
    fields: FieldMap = FieldMap()  # which record fields hold the prompt (or chat messages) and the answer
    format: PromptFormat = PromptFormat()  # chat template or raw text; system prompt; enable_thinking
    eval_set: EvalData = EvalData()  # eval prompts: a file (path) or a held-out share or count (size)
    shuffle: bool = True  # a seeded new order each epoch
    max_prompt_tokens: int = 1024  # longest prompt, in tokens as rendered; longer ones are an error


class RLConfig(NamedTuple):
    # preset (grpo, dapo, dr_grpo, rloo, reinforce, reinforce_pp, gspo, ppo, online_dpo) or module:function
    name: str = "grpo"
    steps: int = 80  # RL iterations in all (one rollout batch each; a resumed run counts on)
    prompts_per_step: int = 32  # prompts per RL step
    lr: float = 3e-4  # RL learning rate
    warmup: int = 0  # linear warm-up steps of the policy's learning rate (the critic trains at critic_lr throughout)
    kl_coef: Optional[float] = None  # KL coefficient (None: the preset's own); > 0 adds a reference worker
    ppo_epochs: int = 1  # passes over each rollout batch
    mini_batches: int = 1  # updates per pass (the rollout batch split into this many parts, at most one a row)
    is_level: str = "token"  # truncated importance weight against the generator's logprobs: off, token, sequence
    is_cap: float = 2.0  # cap of the truncated importance weight
    max_resample_rounds: int = 4  # DAPO dynamic sampling: extra generation rounds per step
    max_staleness: int = 0  # asynchronous RL: generate up to this many steps ahead of training (0: synchronous)
    critic_lr: Optional[float] = None  # the critic's learning rate (PPO; None: algorithm.lr)
    critic_init: str = "policy"  # the value model's start: policy (after any SFT stage) or a reward model directory
    # other AlgorithmConfig fields, e.g. {clip_eps_high: 0.28, kl_fn: k2, advantage_fn: my.module:fn}
    overrides: Optional[dict[str, Scalar]] = None


class PhaseConfig(NamedTuple):
    start: int = 0  # piecewise: the first step of this phase (metric: unused)
    name: str = "dapo"  # the phase's algorithm: a preset or module:function, as algorithm.name
    kl_coef: Optional[float] = None  # None: the preset's own
    overrides: Optional[dict[str, Scalar]] = None  # other AlgorithmConfig fields, as algorithm.overrides


class ScheduleConfig(NamedTuple):
    # constant: the algorithm section at every step; piecewise: the algorithm section, then each phase from its
    # start step; metric: the algorithm section until a step logs metric >= threshold, then phases[0] (it sticks);
    # or module:function, a schedule (iteration, last_metrics) -> AlgorithmConfig with kwargs bound to it
    kind: str = "constant"
    phases: tuple[PhaseConfig, ...] = ()  # the algorithms after the algorithm section (they share its ppo_epochs,
    # mini_batches, is_level and is_cap)
    metric: str = "reward/mean"  # metric: the logged metric to watch
    threshold: float = 0.5  # metric: switch once the watched metric reaches this
    kwargs: Optional[dict[str, Scalar]] = None  # module:function: keyword arguments bound to it


class ReferenceConfig(NamedTuple):
    # fixed; ema (kwargs: decay); periodic (every: reset to the policy every N steps); kl_bound (max_kl: reset
    # when the measured KL exceeds it); or module:function ref_update_fn(ref, policy_weights, step, kl) -> RefState
    update: str = "fixed"
    kwargs: Optional[dict[str, Scalar]] = None  # the built-in's arguments, or bound to a module:function


class ToolSpec(NamedTuple):
    name: str  # calculator, python (sandboxed by bubblewrap), or module:function tool(arguments: dict) -> str
    label: Optional[str] = None  # the name the model calls it by (default: name; a function's own name)
    kwargs: Optional[dict[str, Scalar]] = None  # keyword arguments bound to the tool (python: timeout, memory_mb)


class ToolsConfig(NamedTuple):
    use: tuple[ToolSpec, ...] = ()  # the tools; none: single-turn rollouts
    parser: str = "xml"  # xml (<tool_call name="...">{json}</tool_call>), json, or module:function(text) -> [ToolCall]
    stop: str = "no_tool_calls"  # no_tool_calls (the turn called none), or module:function(conversation) -> bool
    max_turns: int = 4  # assistant turns per rollout at most


class ShapingSpec(NamedTuple):
    # length_penalty (coef, target_len), overlong (max_len, buffer, penalty: DAPO's soft penalty), kl_penalty
    # (coef: the reward minus coef * the sequence KL to the reference), or module:function
    # shaping_fn(rollout, reward) -> reward; several are applied in order
    name: str
    kwargs: Optional[dict[str, Scalar]] = None  # the built-in's arguments, or bound to a module:function


class SamplingConfig(NamedTuple):
    group_size: int = 8  # completions per prompt (G)
    max_new_tokens: int = 5  # completion length limit, in tokens
    temperature: float = 1.0  # sampling temperature (> 0); the trainer and reference score at the same one
    top_p: float = 1.0  # nucleus sampling (1: off)
    top_k: int = 0  # top-k sampling (0: off)
    stop: tuple[str, ...] = ()  # stop strings; a completion ends after the first one (eos always ends it)
    # HF generators' decode loop: auto (a static KV cache captured in CUDA graphs on a GPU; on a CPU, weights of
    # 16 MiB or more packed for oneDNN for 8+ rows and 16+ tokens; else eager), eager, packed, static or captured
    # (primitives.model.static_decode, primitives.model.packed_decode); vLLM has its own
    decode: str = "auto"
    # HF generators (and the trainers' generation): the most rows (prompts x group_size) decoded together; a
    # call with more decodes them in the fewest batches under it, of even sizes (whole groups where it holds
    # one), so its KV cache and logits stay this size (0: every row at once). vLLM schedules its own batches
    # within its KV-cache memory: refused with vLLM generators
    max_batch_rows: int = 0


class SFTConfig(NamedTuple):
    steps: int = 0  # SFT optimizer steps (in an RL job: an SFT stage first; 0: none)
    batch: int = 64  # samples per step (all ranks together)
    lr: float = 1e-5  # peak learning rate
    warmup: int = 0  # linear warm-up steps of the learning rate
    path: Optional[str] = None  # SFT data file or directory; None in an RL job: the task's demonstrations
    split: str = "train"  # split of a datasets directory
    fields: SFTFields = SFTFields()  # chat messages, or prompt and completion fields
    format: PromptFormat = PromptFormat()  # chat: the model's chat template, loss on assistant tokens only
    max_len: Optional[int] = None  # truncate samples to this many tokens
    eval_set: EvalData = EvalData()  # eval loss on a file (path) or a held-out share or count (size); neither: off
    eval_every: int = 100  # eval loss every N steps (and at the end) when an eval set is given
    # an RL job with model.lora: true, the SFT stage trains every weight, and RL's adapters start on the SFT'd model
    # (also RL's reference, the adapters off); false, it trains the adapters, which RL goes on training. None:
    # true for the embedded tiny model (random weights: adapters cannot train its embeddings), else false
    full_weights: Optional[bool] = None
    save: bool = False  # an RL job: keep the SFT stage's model in <out>/sft_model (hf/ loads with from_pretrained)


class EvalConfig(NamedTuple):
    enabled: bool = True  # evaluate on the eval prompts (data.eval_set, or the task's own)
    every: int = 20  # evaluate every N RL steps and at the end (0: only before and after RL)
    k: int = 1  # samples per eval prompt; pass@k is reported (k > 1 needs temperature > 0)
    temperature: float = 0.0  # 0: greedy
    threshold: float = 1.0  # a sample is correct when its reward is at least this (accuracy, pass@k)
    max_items: Optional[int] = None  # evaluate on the first N eval prompts only (None: all)
    final_pass_k: int = 4  # at the end, pass@k with this many samples at the sampling temperature (0: off)


class CheckpointConfig(NamedTuple):
    every: int = 0  # checkpoint every N steps into <out>/checkpoints/step_N (0: not by count)
    # also checkpoint after the first step that ends this many minutes after the start or the last checkpoint (0: off)
    minutes: float = 10.0
    keep: int = 2  # keep the newest N checkpoints in <out>/checkpoints (0: all); final_model/ is written apart, always
    # a checkpoint directory written by this job: continue exactly from it. auto: the newest complete one in
    # <logging.out>/checkpoints, or a fresh start when there is none (a restarted job's command)
    resume: Optional[str] = None
    # continue a run whose training settings (model, data, rewards, algorithm, sampling, seed) this job changes;
    # without it such a resume is refused, the changes listed (cluster.jobs.resume.resume_changes)
    allow_changes: bool = False


class LoggingConfig(NamedTuple):
    out: str = "runs/rl"  # output directory; inside `ray job submit` a relative path goes under $RAYRL_OUTPUT_ROOT
    console_every: int = 10  # a console line every N steps
    wandb_project: Optional[str] = None  # also log to Weights & Biases under this project


class RLJob(NamedTuple):
    """rayrl rl: optional SFT stage, then RL with verifiable or learned rewards, on Ray."""

    model: ModelConfig = ModelConfig("tiny")  # model_name_or_path: tiny, smollm2 (both embedded) or an HF directory
    data: DataConfig = DataConfig()  # a task or a prompt file (one of them is required)
    rewards: tuple[RewardSpec, ...] = (RewardSpec("exact_match"),)  # built-in or module:function, weighted
    shaping: tuple[ShapingSpec, ...] = ()  # reward shaping on the reward workers, after the rewards are combined
    algorithm: RLConfig = RLConfig()
    schedule: ScheduleConfig = ScheduleConfig()  # which algorithm each step runs (switching)
    reference: ReferenceConfig = ReferenceConfig()  # how the KL reference moves
    tools: ToolsConfig = ToolsConfig()  # multi-turn rollouts with tool calls
    generation: SamplingConfig = SamplingConfig()
    cluster: ClusterConfig = ClusterConfig()
    sft: SFTConfig = SFTConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    seed: int = 0  # seeds the model, the data order, sampling and the SFT draws


class SFTJob(NamedTuple):
    """rayrl sft: supervised fine-tuning on chat messages or prompt/completion pairs, on Ray."""

    model: ModelConfig = ModelConfig("tiny")  # model_name_or_path: tiny, smollm2 (both embedded) or an HF directory
    sft: SFTConfig = SFTConfig(steps=100)
    cluster: ClusterConfig = ClusterConfig(generators=0, reward_workers=0)
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig(out="runs/sft")
    seed: int = 0  # seeds the model and the SFT draws


JOBS = {"rl": RLJob, "sft": SFTJob}


# ----------------------------------------------------------------------------- YAML -> records

class ConfigError(ValueError):
    """A config file or value that does not fit the records; the message names the key."""


def _is_record(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields")


def _optional_inner(tp):
    """``X`` of ``Optional[X]``, or None when ``tp`` is not optional."""
    if get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp):
        rest = [a for a in get_args(tp) if a is not type(None)]
        return rest[0] if len(rest) == 1 else Union[tuple(rest)]
    return None


def _where(key: str, lines: dict, source: str) -> str:
    line = lines.get(key)
    return f"{source}:{line}: {key}" if line else f"{source}: {key}"


def _check_scalar(value, tp, key: str, where: str):
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (bool, int, float, str) and (not isinstance(value, tp) or (tp is int and isinstance(value, bool))):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def _convert(value, tp, key: str, lines: dict, source: str, base=None):
    """``value`` (parsed YAML) as type ``tp``, checked; errors name ``key`` and its line. A
    mapping for a record fills ``base`` (the job's default of that section), else the record's."""
    where = _where(key, lines, source)
    inner = _optional_inner(tp)
    if inner is not None:
        return None if value is None else _convert(value, inner, key, lines, source, base)
    if value is None:
        raise ConfigError(f"{where}: may not be empty (null)")
    if _is_record(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields ({', '.join(tp._fields)}), "
                              f"got {value!r}")
        return record_from_dict(tp, value, key + ".", lines, source, base)
    origin = get_origin(tp)
    if origin is tuple:
        elem = get_args(tp)[0]
        items = value if isinstance(value, list) else None
        if items is None:
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(_convert(v, elem, f"{key}.{i}", lines, source) for i, v in enumerate(items))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        for k, v in value.items():
            if not isinstance(v, (bool, int, float, str)):
                raise ConfigError(f"{_where(f'{key}.{k}', lines, source)}: expected a number, string or boolean, "
                                  f"got {v!r}")
        return {str(k): v for k, v in value.items()}
    if get_origin(tp) in (Union, types.UnionType):  # of scalars, e.g. a share (float) or a count (int)
        allowed = get_args(tp)
        if isinstance(value, allowed) and (bool in allowed or not isinstance(value, bool)):
            return value
        raise ConfigError(f"{where}: expected {' or '.join(a.__name__ for a in allowed)}, got {value!r}")
    return _check_scalar(value, tp, key, where)


def record_from_dict(record, values: dict, prefix: str = "", lines: Optional[dict] = None, source: str = "config",
                     base=None):
    """``record`` built from a nested dict over ``base`` (default: the record's own defaults),
    section by section; an unknown key raises ``ConfigError`` naming it (with its line in
    ``source``) and the closest valid key."""
    lines = lines or {}
    hints = get_type_hints(record)
    for key in values:
        if key not in record._fields:
            hint = did_you_mean(key, record._fields) or f"; valid keys: {', '.join(record._fields)}"
            raise ConfigError(f"{_where(prefix + str(key), lines, source)}: unknown key{hint}")
    defaults = base._asdict() if base is not None else record._field_defaults
    fields = {}
    for name in record._fields:
        if name in values:
            sub = defaults.get(name)
            fields[name] = _convert(values[name], hints[name], prefix + name, lines, source,
                                    sub if _is_record(type(sub)) else None)
        elif name in defaults:
            fields[name] = defaults[name]
        else:
            raise ConfigError(f"{_where(prefix.rstrip('.') or record.__name__, lines, source)}: "
                              f"missing required key '{name}'")
    return record(**fields)


def _key_lines(node, prefix: str = "") -> dict:
    """``"a.b.0.c" -> line`` (1-based) for every key and list item of a composed YAML node."""
    import yaml

    lines = {}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = f"{prefix}{k.value}"
            lines[key] = k.start_mark.line + 1
            lines.update(_key_lines(v, key + "."))
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            lines[f"{prefix}{i}"] = v.start_mark.line + 1
            lines.update(_key_lines(v, f"{prefix}{i}."))
    return lines


def job_loader():
    """PyYAML's safe loader as a job file needs it: numbers such as ``1e-3`` are floats (YAML 1.2;
    PyYAML's 1.1 reads an exponent without a dot as a string, which a function's ``kwargs`` then got),
    and a key written twice in one mapping is refused with both lines (the second silently replaced
    the first: a whole section lost)."""
    import re

    import yaml

    class JobLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                key = key_node.value
                if key in seen and key != "<<":
                    raise yaml.constructor.ConstructorError(
                        None, None, f"'{key}' is written twice in one mapping (lines {seen[key]} and "
                        f"{key_node.start_mark.line + 1}); the second would replace the first", key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep)

    JobLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
    return JobLoader


def load_job_config(path: Optional[str], job_type=RLJob):
    """The job record of a YAML file (``None``: the record's defaults); every error names the file."""
    import yaml

    if path is None:
        return job_type()
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path) as f:
            text = f.read()
        loader = job_loader()
        node = yaml.compose(text, Loader=loader)
        values = yaml.load(text, Loader=loader)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of sections ({', '.join(job_type._fields)}), got {values!r}")
    return record_from_dict(job_type, values, "", _key_lines(node), path)


def record_to_dict(record) -> dict:
    """A record as plain nested dicts and lists (YAML- and JSON-ready)."""
    def plain(v):
        if _is_record(type(v)):
            return {k: plain(x) for k, x in v._asdict().items()}
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(record)


def dump_config(record) -> str:
    """YAML text that ``load_job_config`` reads back to ``record``."""
    import yaml

    return yaml.safe_dump(record_to_dict(record), sort_keys=False)


def parse_overrides(job_type, default, args, prog: str, description: str):
    """``default`` with the command-line overrides ``args`` applied (tyro, from the records)."""
    import tyro

    keep_class_sources()
    return tyro.cli(job_type, default=default, args=list(args), prog=prog, description=description,
                    config=(tyro.conf.FlagConversionOff,))


def keep_class_sources() -> None:
    """Make tyro read each record's source once per process. tyro clears its caches at every ``cli``
    call, and reads the field comments of each record class from its source (``inspect.getsource``
    parses the whole module again for each class): 0.6 s of the 0.75 s a job's command line took, in
    every job a process runs (the test suite runs about a hundred). A class's source does not change
    while the process runs. Where tyro's internals differ from those of tyro 1.x, nothing is changed."""
    import functools

    try:
        from tyro import _docstrings
    except ImportError:
        return
    tokenization: Any = getattr(_docstrings, "_ClassTokenization", None)
    make = getattr(tokenization, "make", None)
    if make is None or getattr(make, "cache_info", None) is not None:
        return
    tokenization.make = staticmethod(functools.lru_cache(maxsize=256)(make))
