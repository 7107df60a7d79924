"""The general jobs behind ``rayrl rl`` and ``rayrl sft``: a config record in, a run directory out.

``prepare_rl`` / ``prepare_sft`` do everything that needs no Ray - resolve paths, check every
value, build or check the model directory, load and check the data, build the rewards - so a
bad config fails in seconds with a message naming the field, file or line. ``run_rl`` /
``run_sft`` then start the actors, train, evaluate and write ``<out>``: config.yaml (the
resolved config), metrics.jsonl, curves.png, summary.json, samples/ (RL), checkpoints/ and
final_model/ (DeepSpeed shards, ``hf/`` for transformers).
"""
from __future__ import annotations

import inspect
import json
import os
import time
from typing import NamedTuple, Optional

import numpy as np

from cluster.jobs.config import (
    RLJob,
    SFTJob,
    dump_config,
    record_to_dict,
    resolve_output_dir,
    resume_errors,
)
from cluster.ray_wing.config import ClusterConfig
from primitives.io.data import (
    EvalData,
    FieldMap,
    PromptFormat,
    Records,
    chat_template_kwargs,
    load_records,
    sft_samples_from_records,
    split_eval,
)
from primitives.io.loggers import mean_of
from primitives.types import ModelConfig
from rl_actors.common import GENERATE_ON_ZERO3

EMBEDDED_MODELS = ("tiny", "smollm2")
MODEL_CACHE_ENV = "RAYRL_MODEL_CACHE"  # where the embedded SmolLM2 is converted to (default ~/.cache/rayrl)
# the learning signal and the generator/trainer gap, summarised as medians over the RL steps
SIGNALS = ("loss/policy", "loss/kl", "kl/ref_k3", "policy/clip_frac", "policy/entropy", "grad_norm",
           "mismatch/k3", "mismatch/max_abs_logp_diff", "mismatch/is_weight_mean", "mismatch/is_clipped_frac")
PHASES = ("time/generate", "time/reward", "time/ref", "time/train", "time/sync", "time/step")


class ConfigErrors(ValueError):
    """Every problem found in a job's config, one per line."""

    def __init__(self, errors):
        self.errors = list(errors)
        super().__init__("bad configuration:\n  - " + "\n  - ".join(self.errors))


def raise_if(errors) -> None:
    if errors:
        raise ConfigErrors(errors)


def checked(prepare):
    """``prepare`` whose input errors (a bad file, row, field, reward, model) all surface as
    ``ConfigErrors``: the command line reports them as usage errors, without a traceback."""
    import functools

    from primitives.io.data import MissingFieldError

    @functools.wraps(prepare)
    def run(*args, **kwargs):
        try:
            return prepare(*args, **kwargs)
        except ConfigErrors:
            raise
        except (ValueError, OSError, MissingFieldError) as e:  # OSError: a missing or unreadable file
            raise ConfigErrors([str(e)]) from e

    return run


# ----------------------------------------------------------------------------- checks of values

def _checks(pairs) -> list:
    return [msg for ok, msg in pairs if not ok]


GENERATOR_FIELDS = ("generators", "generator_cpus", "generator_gpus", "vllm")
REFERENCE_FIELDS = ("reference_workers", "reference_cpus", "reference_gpus")
RL_ROLE_FIELDS = GENERATOR_FIELDS + REFERENCE_FIELDS + ("reward_workers", "reward_cpus", "reference_on_trainers",
                                                        "generate_on_trainers", "sync_bucket_mb", "critics",
                                                        "critic_cpus", "critic_gpus")


def ignored_errors(cluster, fields, why: str, base) -> list:
    """Settings of roles that do not run in this layout: a value other than the job's default
    (``base``) or a count of 0 would be ignored, so it is refused, with ``why``."""
    return [f"cluster.{name} {getattr(cluster, name)!r} would be ignored: {why}" for name in fields
            if getattr(cluster, name) != getattr(base, name) and getattr(cluster, name) != 0]


def cluster_errors(cluster, rl_roles: bool, base=None) -> list:
    """Every check of the ``cluster`` section; ``base`` is the job's default section (the
    settings a user did not make), against which an ignored setting is told apart."""
    base = ClusterConfig() if base is None else base
    checks = [
        (cluster.trainers >= 1, "cluster.trainers must be at least 1"),
        (cluster.zero_stage in (1, 2, 3), f"cluster.zero_stage must be 1, 2 or 3, got {cluster.zero_stage}"),
        (cluster.placement in ("PACK", "SPREAD"), f"cluster.placement must be PACK or SPREAD, got {cluster.placement}"),
        (cluster.call_timeout_s > 0, "cluster.call_timeout_s must be positive"),
        (cluster.micro_batch_size >= 1, "cluster.micro_batch_size must be at least 1"),
        (cluster.threads_per_actor >= 1, "cluster.threads_per_actor must be at least 1"),
    ]
    if rl_roles:
        checks += [
            (cluster.generators >= 1 or cluster.generate_on_trainers, "cluster.generators must be at least 1"),
            (cluster.reward_workers >= 1, "cluster.reward_workers must be at least 1"),
            (cluster.reference_workers >= 1 or cluster.reference_on_trainers,
             f"cluster.reference_workers must be at least 1, got {cluster.reference_workers}"),
            (cluster.generator_backend in ("auto", "hf", "vllm"),
             f"cluster.generator_backend must be auto, hf or vllm, got {cluster.generator_backend}"),
            (cluster.sync_bucket_mb > 0, "cluster.sync_bucket_mb must be positive"),
            (not cluster.generate_on_trainers or cluster.zero_stage != 3, GENERATE_ON_ZERO3),
            (not cluster.generate_on_trainers or cluster.generator_backend != "vllm",
             "cluster.generate_on_trainers generates with the trainers' own HF module; cluster.generator_backend "
             "vllm needs generator workers of its own"),
        ] + vllm_errors(cluster)
    ignored = []
    if rl_roles and cluster.generate_on_trainers:
        ignored += ignored_errors(cluster, GENERATOR_FIELDS, "cluster.generate_on_trainers generates on the trainer "
                                  "ranks (no generator workers)", base)
    if rl_roles and cluster.reference_on_trainers:
        ignored += ignored_errors(cluster, REFERENCE_FIELDS, "cluster.reference_on_trainers keeps the reference on "
                                  "the trainer ranks (no reference workers)", base)
    if not rl_roles:
        ignored += ignored_errors(cluster, RL_ROLE_FIELDS, "an SFT job runs the trainer ranks alone", base)
    return _checks(checks) + ignored


def vllm_errors(cluster) -> list:
    """``cluster.vllm`` settings that cannot apply where the generators run (CPU: no GPUs), and
    the vLLM layouts this project has not run."""
    v, gpus = cluster.vllm, cluster.generator_gpus
    vllm_on_gpus = gpus > 0 and cluster.generator_backend in ("vllm", "auto") and not cluster.generate_on_trainers
    return [
        (v.tensor_parallel_size >= 1, f"cluster.vllm.tensor_parallel_size must be at least 1, got "
                                      f"{v.tensor_parallel_size}"),
        (v.tensor_parallel_size == 1 or gpus > 0,
         f"cluster.vllm.tensor_parallel_size {v.tensor_parallel_size} splits the model over GPUs; the generators "
         f"run on CPU (cluster.generator_gpus 0), where vLLM runs one process per engine"),
        (v.tensor_parallel_size == 1 or gpus == 0,
         f"cluster.vllm.tensor_parallel_size {v.tensor_parallel_size}: each of an engine's GPU workers would need a "
         f"rank of its own in the weight-sync group, which this project does not lay out yet; use 1 (and more "
         f"cluster.generators)"),
        (0 < v.gpu_memory_utilization <= 1,
         f"cluster.vllm.gpu_memory_utilization must be in (0, 1], got {v.gpu_memory_utilization}"),
        (v.max_model_len is None or v.max_model_len >= 2,
         f"cluster.vllm.max_model_len must be at least 2 tokens, got {v.max_model_len}"),
        (v.cpu_kv_cache_gib >= 1, f"cluster.vllm.cpu_kv_cache_gib must be at least 1, got {v.cpu_kv_cache_gib}"),
        (not v.enable_sleep_mode or gpus > 0,
         "cluster.vllm.enable_sleep_mode releases GPU memory; the generators run on CPU (cluster.generator_gpus 0)"),
        (not vllm_on_gpus or cluster.trainer_gpus > 0,
         f"cluster.generator_backend {cluster.generator_backend} with cluster.generator_gpus {gpus} and "
         f"cluster.trainer_gpus 0: vLLM on GPUs receives weights over NCCL, which CPU trainers cannot send; give "
         f"the trainers GPUs, or use cluster.generator_backend hf"),
    ]


def sft_errors(sft, in_rl_job: bool) -> list:
    checks = [
        (sft.steps >= 0, f"sft.steps must be >= 0, got {sft.steps}"),
        (sft.batch >= 1, "sft.batch must be at least 1"),
        (sft.lr > 0, f"sft.lr must be positive, got {sft.lr}"),
        (sft.warmup >= 0, "sft.warmup must be >= 0"),
        (sft.max_len is None or sft.max_len >= 2, "sft.max_len must be at least 2 tokens"),
        (sft.eval_every >= 0, "sft.eval_every must be >= 0"),
        (sft.eval_set.path is None or sft.eval_set.size is None,
         "sft.eval_set: give path (an eval file) or size (a held-out share or count), not both"),
    ]
    if not in_rl_job:
        checks += [(sft.steps >= 1, "sft.steps must be at least 1 in an SFT job"),
                   (sft.path is not None, "sft.path is required: the SFT data file or directory")]
    return _checks(checks)


def algorithm_errors(job: RLJob) -> list:
    """Checks of the algorithm record the section builds: it resolves, its functions take their
    documented arguments, it needs no critic, and each trainer rank gets rows."""
    from primitives.maths.algorithms import check_algorithm_functions, check_algorithm_picklable, needs_values, pairwise

    algo, gen = job.algorithm, job.generation
    try:
        record = algorithm_of(algo)
        check_algorithm_functions(record)
        check_algorithm_picklable(record)
    except ConfigErrors as e:
        return e.errors
    except ValueError as e:
        return [f"algorithm: {e}"]
    rows = algo.prompts_per_step * (2 if pairwise(record) else gen.group_size)  # pairwise loss: a pair per prompt
    init = algo.critic_init
    return _checks([
        (not needs_values(record) or init == "policy" or os.path.isdir(init),
         f"algorithm.critic_init must be 'policy' or a reward model directory, got '{init}'"),
        (not needs_values(record) or job.cluster.critics >= 1, "cluster.critics must be at least 1 for "
                                                               f"'{record.name}', whose advantage reads critic values"),
        (gen.group_size < 2 or rows // algo.mini_batches >= job.cluster.trainers,  # a bad group size is named alone
         f"algorithm.mini_batches {algo.mini_batches} leaves {rows // algo.mini_batches} rows per "
         f"mini-batch for {job.cluster.trainers} trainer ranks; every rank needs rows (raise "
         "algorithm.prompts_per_step or lower algorithm.mini_batches)"),
    ]) + behaviour_logprob_errors(job, record)


def behaviour_logprob_errors(job: RLJob, record) -> list:
    """vLLM with top-k / top-p where the importance weight is applied. vLLM's behaviour logprobs
    (``processed_logprobs``) are renormalised over the tokens top-k / top-p keep; the trainer's
    and the HF generator's are of the full ``softmax(logits / T)``, so the weight would be the
    kept mass, not the gap between the policies (DESIGN sections 6-7). ``auto`` picks vLLM on
    generator workers with GPUs; a pairwise loss (online DPO) only measures the weight."""
    from primitives.maths.algorithms import pairwise

    gen, cluster = job.generation, job.cluster
    truncation = [name for name, on in ((f"generation.top_p {gen.top_p}", gen.top_p < 1),
                                        (f"generation.top_k {gen.top_k}", gen.top_k > 0)) if on]
    vllm = cluster.generator_backend == "vllm" or (cluster.generator_backend == "auto" and cluster.generator_gpus > 0
                                                   and not cluster.generate_on_trainers)
    if not (truncation and vllm and record.is_level != "off" and not pairwise(record)):
        return []
    backend = "vllm" if cluster.generator_backend == "vllm" else \
        f"auto (vLLM on generator workers with cluster.generator_gpus {cluster.generator_gpus})"
    return [f"{' and '.join(truncation)} with cluster.generator_backend {backend} and algorithm.is_level "
            f"{record.is_level}: vLLM's behaviour logprobs are renormalised over the tokens top-p/top-k keep, the "
            "trainer's are of the full softmax(logits / T), so the importance weight would be the kept probability "
            "mass, not the gap between the policies; use generation.top_p 1 and generation.top_k 0, or "
            "cluster.generator_backend hf (its logprobs are of the full distribution), or algorithm.is_level off"]


def rl_errors(job: RLJob) -> list:
    """Every check of an RL job's values that needs no file, model or Ray; the algorithm record
    is checked once the algorithm section's own numbers are sound."""
    from primitives.maths.losses import IS_LEVELS

    algo, gen, ev, data = job.algorithm, job.generation, job.eval, job.data
    errors = _checks([
        (algo.steps >= 0, f"algorithm.steps must be >= 0, got {algo.steps}"),
        (algo.prompts_per_step >= 1, "algorithm.prompts_per_step must be at least 1"),
        (algo.lr > 0, f"algorithm.lr must be positive, got {algo.lr}"),
        (algo.kl_coef is None or algo.kl_coef >= 0, f"algorithm.kl_coef must be >= 0, got {algo.kl_coef}"),
        (algo.ppo_epochs >= 1, f"algorithm.ppo_epochs must be at least 1, got {algo.ppo_epochs}"),
        (algo.mini_batches >= 1, f"algorithm.mini_batches must be at least 1, got {algo.mini_batches}"),
        (algo.is_level in IS_LEVELS, f"algorithm.is_level must be one of {', '.join(IS_LEVELS)}, got {algo.is_level}"),
        (algo.is_cap > 0, f"algorithm.is_cap must be positive, got {algo.is_cap}"),
        (algo.max_resample_rounds >= 0, "algorithm.max_resample_rounds must be >= 0"),
        (algo.max_staleness >= 0, f"algorithm.max_staleness must be >= 0 (0: synchronous), got {algo.max_staleness}"),
        (algo.max_staleness == 0 or not job.cluster.generate_on_trainers,
         f"algorithm.max_staleness {algo.max_staleness} overlaps generation with training, but with "
         "cluster.generate_on_trainers both run in the trainer processes, one after the other: use 0, or "
         "generator workers"),
        (algo.warmup >= 0, "algorithm.warmup must be >= 0"),
        (algo.critic_lr is None or algo.critic_lr > 0, f"algorithm.critic_lr must be positive, got {algo.critic_lr}"),
        (gen.group_size >= 2, f"generation.group_size must be at least 2 (completions per prompt), got "
                              f"{gen.group_size}: group advantages and pairs compare completions of one prompt"),
        (gen.max_new_tokens >= 1, "generation.max_new_tokens must be at least 1"),
        (gen.temperature > 0, f"generation.temperature must be > 0 for RL sampling, got {gen.temperature} "
                              "(logprobs are of softmax(logits / T); set eval.temperature 0 for greedy evaluation)"),
        (0 < gen.top_p <= 1, f"generation.top_p must be in (0, 1], got {gen.top_p}"),
        (gen.top_k >= 0, f"generation.top_k must be >= 0, got {gen.top_k}"),
        (ev.every >= 0, "eval.every must be >= 0"),
        (ev.k >= 1, f"eval.k must be at least 1, got {ev.k}"),
        (ev.temperature >= 0, f"eval.temperature must be >= 0, got {ev.temperature}"),
        (ev.k == 1 or ev.temperature > 0, f"eval.k {ev.k} samples at eval.temperature 0 are all the same greedy "
                                          "completion; set eval.temperature > 0 for pass@k"),
        (ev.max_items is None or ev.max_items >= 1, "eval.max_items must be at least 1"),
        (ev.final_pass_k >= 0, "eval.final_pass_k must be >= 0"),
        (job.checkpoint.every >= 0, "checkpoint.every must be >= 0"),
        ((data.task is None) != (data.path is None), "data: give either task (a generated task) or path (a prompt "
                                                     f"file), not {'both' if data.task else 'neither'}"),
        (data.task is None or (data.eval_set, data.fields, data.format, data.split) == (
            EvalData(), FieldMap(), PromptFormat(), "train"),
         "data.eval_set, fields, format and split apply to a prompt file (data.path); a task brings its own "
         "prompts, formatted, and its eval prompts"),
        (data.max_prompt_tokens >= 1, "data.max_prompt_tokens must be at least 1"),
    ]) + cluster_errors(job.cluster, rl_roles=True) + sft_errors(job.sft, in_rl_job=True)
    return errors + ([] if any(e.startswith("algorithm.") for e in errors) else algorithm_errors(job))


# ----------------------------------------------------------------------------- paths and the model

def with_resolved_paths(job):
    """``job`` with logging.out and checkpoint.resume absolute (inside ``ray job submit`` under
    $RAYRL_OUTPUT_ROOT, not Ray's temporary copy of the checkout)."""
    ckpt = job.checkpoint
    resume = resolve_output_dir(ckpt.resume) if ckpt.resume else None
    return job._replace(logging=job.logging._replace(out=resolve_output_dir(job.logging.out)),
                        checkpoint=ckpt._replace(resume=resume))


def model_dir_errors(path: str) -> list:
    """Why ``path`` is not a local HF causal-LM directory with a tokenizer, if it is not."""
    if not os.path.isdir(path):
        return [f"model.model_name_or_path {path}: no such directory (give a local Hugging Face model directory, "
                f"or one of the embedded models: {', '.join(EMBEDDED_MODELS)})"]
    errors = []
    if not os.path.isfile(os.path.join(path, "config.json")):
        errors.append(f"model.model_name_or_path {path}: no config.json (not a Hugging Face model directory)")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(path, f)) for f in tokenizer_files):
        errors.append(f"model.model_name_or_path {path}: no tokenizer (none of {', '.join(tokenizer_files)}); "
                      "save one beside the weights with tokenizer.save_pretrained(path)")
    return errors


def resolve_model(model: ModelConfig, out: str, seed: int) -> ModelConfig:
    """``model`` with a local directory: the embedded ``tiny`` model is built into
    ``<out>/base_model``; the embedded ``smollm2`` is converted once into ``$RAYRL_MODEL_CACHE``."""
    name = model.model_name_or_path
    if name == "tiny":
        from primitives.fixtures.tiny import save_tiny_model

        return model._replace(model_name_or_path=save_tiny_model(os.path.join(out, "base_model"), seed=seed))
    if name == "smollm2":
        from primitives.fixtures.pretrained import save_smollm2

        cache = os.path.expanduser(os.environ.get(MODEL_CACHE_ENV) or "~/.cache/rayrl")
        return model._replace(model_name_or_path=save_smollm2(os.path.join(cache, "smollm2-135m-instruct")))
    raise_if(model_dir_errors(name))
    return model._replace(model_name_or_path=os.path.abspath(name))


def model_errors(model: ModelConfig) -> list:
    checks = [(model.dtype in ("float32", "bfloat16", "float16"),
               f"model.dtype must be float32, bfloat16 or float16, got {model.dtype}")]
    if model.model_name_or_path not in EMBEDDED_MODELS:
        checks += [(False, e) for e in model_dir_errors(model.model_name_or_path)]
    return _checks(checks)


def load_tokenizer(model: ModelConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.model_name_or_path, trust_remote_code=model.trust_remote_code)


# ----------------------------------------------------------------------------- data

def load_task(name: str, kwargs: Optional[dict], seed: int):
    """The ``TaskData`` of a built-in task or a user ``module:function(seed, **kwargs)``."""
    from primitives.fixtures.tasks import TASKS, TaskData
    from primitives.hooks import did_you_mean, load_function

    if ":" in name:
        fn = load_function(name)
    elif name in TASKS:
        fn = TASKS[name]
    else:
        raise ConfigErrors([f"data.task '{name}' is unknown{did_you_mean(name, TASKS) or ''} (built-in: "
                            f"{', '.join(TASKS)}; or your own as module:function returning a TaskData)"])
    try:
        inspect.signature(fn).bind(seed=seed, **(kwargs or {}))
    except TypeError as e:
        raise ConfigErrors([f"data.task_kwargs {kwargs} do not fit {name}{inspect.signature(fn)}: {e}"]) from None
    task = fn(seed=seed, **(kwargs or {}))
    if not isinstance(task, TaskData):
        raise ConfigErrors([f"data.task {name} returned {type(task).__name__}, not a "
                            "primitives.fixtures.tasks.TaskData"])
    from primitives.io.data import PromptItem

    bad = next((x for x in list(task.train) + list(task.eval) if not isinstance(x, PromptItem)), None)
    if not task.train or bad is not None:
        raise ConfigErrors([f"data.task {name}: " + ("no training prompts (TaskData.train is empty)" if not task.train
                                                     else f"TaskData items must be PromptItems, got {bad!r}")])
    return task


def rl_prompts(job: RLJob, eval_on: bool) -> tuple:
    """``(train_items, eval_items, task)``: from the task or the prompt file."""
    from primitives.io.data import load_train_eval

    data = job.data
    task = None
    if data.task is not None:
        task = load_task(data.task, data.task_kwargs, job.seed)
        train, evals = task.train, (task.eval if eval_on else [])
    else:
        eval_data = data.eval_set if eval_on else None
        if eval_on and data.eval_set.path is None and data.eval_set.size is None:
            raise ConfigErrors(["evaluation is on but data.eval_set has neither path (an eval file) nor size (a "
                                "held-out share or count); set one, or eval.enabled: false"])
        train, evals = load_train_eval(data.path, data.fields, data.format, eval_data, data.split)
    if eval_on and not evals:
        raise ConfigErrors([f"evaluation is on but the task {data.task} has no eval prompts; set eval.enabled: false"])
    return list(train), list(evals), task


def check_prompts(items, tokenizer, data) -> None:
    """The prompts as the generators will render them: a chat template where chat prompts need
    one, and none longer than ``data.max_prompt_tokens``."""
    from primitives.io.data import check_prompt_lengths

    check_prompt_lengths(items, tokenizer, data.max_prompt_tokens, chat_template_kwargs(tokenizer, data.format))


def sft_samples(sft, tokenizer, task=None) -> tuple:
    """``(train_samples, eval_samples)`` of the SFT data: ``sft.path``, else the task's
    demonstrations; eval samples from ``sft.eval_set`` (a file or a held-out part), else ``[]``."""
    from primitives.io.data import PromptFormat, SFTFields

    if sft.path is not None:
        records, fields, fmt = load_records(sft.path, sft.split), sft.fields, sft.format
    elif task is not None and task.sft_rows:
        rows = list(task.sft_rows)
        records = Records(rows, [f"task demonstration {i}" for i in range(len(rows))])
        fields = SFTFields(messages="messages") if task.sft_chat else SFTFields()
        fmt = PromptFormat(chat=task.sft_chat, system_prompt=sft.format.system_prompt)
    else:
        raise ConfigErrors(["sft.steps > 0 but there is no SFT data: set sft.path (a file of chat messages or "
                            "prompt/completion pairs)" + (" - the task brings no demonstrations" if task else "")])
    samples = sft_samples_from_records(records, tokenizer, fields, fmt, sft.max_len)
    if sft.eval_set.path is not None:
        return samples, sft_samples_from_records(load_records(sft.eval_set.path, sft.eval_set.split), tokenizer,
                                                 fields, fmt, sft.max_len)
    if sft.eval_set.size is not None:
        return split_eval(samples, sft.eval_set.size, sft.eval_set.seed)
    return samples, []


# ----------------------------------------------------------------------------- output

def start_output(job) -> tuple:
    """Create ``<out>``, save the resolved config there, and return ``(logger, metrics_path)``."""
    from primitives.io.loggers import multi_logger, run_logger, wandb_logger

    out = job.logging.out
    print(f"writing outputs to {out}", flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write(dump_config(job))
    keys = ["loss/sft", "eval/loss_sft", "reward/mean", "eval/accuracy", "kl/ref_k3"]
    logger, metrics_path = run_logger(out, keys, every=job.logging.console_every)
    if job.logging.wandb_project:
        logger = multi_logger(logger, wandb_logger(job.logging.wandb_project, config=record_to_dict(job),
                                                   directory=out))
    return logger, metrics_path


def finish_output(job, metrics_path: str, plot_keys, title: str, summary: dict) -> dict:
    from primitives.io.loggers import plot_curves, write_summary

    out = job.logging.out
    rows = [json.loads(line) for line in open(metrics_path)]
    plot_curves(rows, [k for k in plot_keys if any(k in r for r in rows)], os.path.join(out, "curves.png"),
                title=title)
    summary = write_summary(out, summary)
    print(f"outputs (config.yaml, summary.json, metrics.jsonl, curves.png, final_model/) are in {out}", flush=True)
    return summary


def phase_means(history) -> dict:
    return {k.replace("time/", "time_") + "_mean_s": round(float(np.mean([m[k] for m in history if k in m])), 4)
            for k in PHASES if any(k in m for m in history)}


def medians(history, keys) -> dict:
    return {k: float(np.median([m[k] for m in history if k in m])) for k in keys if any(k in m for m in history)}


# ----------------------------------------------------------------------------- RL

class RLInputs(NamedTuple):
    """What ``prepare_rl`` checked and built; ``run_rl`` starts the actors with it."""

    job: RLJob  # paths resolved, model a local directory
    train_items: list
    eval_items: list
    sft_samples: list
    sft_eval_samples: list
    reward_fn: object
    aggregate_fn: object
    component_names: tuple
    algo: object  # primitives.maths.algorithms.AlgorithmConfig
    info: dict  # facts of the task for the summary
    template_kwargs: Optional[dict]  # chat-template variables (enable_thinking) the generators render with


SECTION_ALGORITHM_FIELDS = ("name", "kl_coef", "ppo_epochs", "mini_batches", "is_level", "is_cap")


def algorithm_of(rl):
    """The ``AlgorithmConfig`` of the ``algorithm`` section: the preset with the section's
    settings and ``overrides`` (any other field, e.g. ``clip_eps_high``, ``entropy_coef``);
    the preset's own KL coefficient unless ``kl_coef`` is given."""
    from primitives.hooks import did_you_mean
    from primitives.maths.algorithms import AlgorithmConfig, get_algorithm

    overrides = dict(rl.overrides or {})
    for key in overrides:
        if key in SECTION_ALGORITHM_FIELDS:
            raise ConfigErrors([f"algorithm.overrides.{key}: set algorithm.{key} instead"])
        if key not in AlgorithmConfig._fields:
            hint = did_you_mean(key, AlgorithmConfig._fields) or "; see primitives.maths.algorithms.AlgorithmConfig"
            raise ConfigErrors([f"algorithm.overrides.{key}: not an AlgorithmConfig field{hint}"])
    kl = {} if rl.kl_coef is None else {"kl_coef": rl.kl_coef}
    return get_algorithm(rl.name, ppo_epochs=rl.ppo_epochs, mini_batches=rl.mini_batches, is_level=rl.is_level,
                         is_cap=rl.is_cap, **kl, **overrides)


@checked
def prepare_rl(job: RLJob, beside=None) -> RLInputs:
    """Every check and every load that needs no Ray, in order of cost. ``beside(job, algo)``
    runs in this thread once every value is checked and the prompts are read, while the
    model and tokenizer load in another (``run_rl`` starts Ray there: each side keeps about
    one core busy, and Ray's start is mostly waiting for its processes)."""
    from primitives.env.rewards import build_reward

    job = with_resolved_paths(job)
    errors = rl_errors(job) + model_errors(job.model)
    if job.checkpoint.resume:
        errors += resume_errors(job.checkpoint.resume)
    raise_if(errors)
    reward_fn, aggregate_fn, names = build_reward(job.rewards)
    algo = algorithm_of(job.algorithm)
    train, evals, task = rl_prompts(job, job.eval.enabled)  # before the model: a bad file fails in seconds

    def load(job=job) -> RLInputs:
        job = job._replace(model=resolve_model(job.model, job.logging.out, job.seed))
        tokenizer = load_tokenizer(job.model)
        check_prompts(train + evals, tokenizer, job.data)
        sft, sft_eval = sft_samples(job.sft, tokenizer, task) if job.sft.steps and not job.checkpoint.resume \
            else ([], [])
        return RLInputs(job, train, evals[: job.eval.max_items], sft, sft_eval, reward_fn, aggregate_fn, names, algo,
                        dict(task.info or {}) if task else {}, chat_template_kwargs(tokenizer, job.data.format) or None)

    return load() if beside is None else side_by_side(load, lambda: beside(job, algo))


def side_by_side(work, here):
    """``work()``'s result, computed in another thread while ``here()`` runs in this one (which
    must stay: processes it starts may be tied to its thread's life, as Ray's are). Whichever
    raises, the other has finished first; ``work``'s error wins."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="prepare") as pool:
        future = pool.submit(work)
        try:
            here()
        except BaseException as error:
            if future.exception() is not None:  # waits for work
                raise future.exception() from error
            raise
        return future.result()


def process_start_time() -> float:
    """When this process started (``time.time()`` scale), to 10 ms: its start in clock ticks
    since boot (``/proc/self/stat``) against the boot-time clock. psutil's ``create_time`` is
    not used: it adds the boot time in whole seconds and was up to 1 s early. Elsewhere, the
    time ``cluster`` was imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        from cluster import IMPORTED_AT

        return IMPORTED_AT


def startup_figures(process_start: float, run_start: float, cluster_start: float, stages: dict) -> dict:
    """``startup_s``: seconds from the process start to the cluster ready for the first RL step,
    SFT steps and evaluations left out; ``startup``: the seconds of each stage in order
    (``first_step``, the first RL step itself, is reported but not counted)."""
    stages = {"driver_start": round(run_start - process_start, 3), "prepare": round(cluster_start - run_start, 3),
              **stages}
    return {"startup_s": round(sum(v for k, v in stages.items() if k != "first_step"), 2), "startup": stages}


def start_ray_for(job: RLJob, algo) -> str:
    """Start (or join) the Ray the job's roles need: a local one is sized for them."""
    from cluster.ray_wing.roles import NODE_GROUP_PINS, role_specs, start_ray
    from primitives.maths.algorithms import needs_values, uses_reference

    cfg = job.cluster
    return start_ray(cfg, role_specs(cfg, uses_reference(algo), NODE_GROUP_PINS if cfg.pin_roles else None,
                                     with_critic=needs_values(algo)))


def run_rl(job: RLJob) -> dict:
    """The RL job end to end: prepare (no Ray; Ray starts beside the model's loading once
    every value is checked), then actors, SFT stage, RL, evaluation, outputs."""
    run_start = time.time()
    started = []
    try:
        inputs = prepare_rl(job, beside=lambda j, algo: started.append(start_ray_for(j, algo)))
    except BaseException:
        if started:  # a late error (a prompt too long for the model): no Ray left behind
            import ray

            ray.shutdown()
        raise
    job = inputs.job
    start = time.time()
    logger, metrics_path = start_output(job)
    result = train_rl(inputs, logger)
    history = result["history"]
    startup = startup_figures(process_start_time(), run_start, result.pop("cluster_started_at"),
                              result.pop("startup"))
    names = [f"reward/{n}" for n in inputs.component_names] if len(inputs.component_names) > 1 else []
    summary = {
        **{k: v for k, v in result.items() if k != "history"},
        "algorithm": job.algorithm.name, "sft_steps": job.sft.steps, "rl_steps": job.algorithm.steps,
        "model": job.model.model_name_or_path, "train_prompts": len(inputs.train_items),
        "eval_prompts": len(inputs.eval_items), **inputs.info,
        "generators": job.cluster.trainers if job.cluster.generate_on_trainers else job.cluster.generators,
        "trainer_ranks": job.cluster.trainers,
        "zero_stage": job.cluster.zero_stage,
        "reward_mean_first5": mean_of(history[:5], "reward/mean"),
        "reward_mean_last5": mean_of(history[-5:], "reward/mean"),
        **phase_means(history), "median_over_rl_steps": medians(history, SIGNALS),
        "seed": job.seed, "wall_s": round(time.time() - start, 1), **startup, "out": job.logging.out,
    }
    keys = ["loss/sft", "reward/mean", "eval/accuracy", *names, "kl/ref_k3", "policy/entropy", "time/step"]
    model_name = os.path.basename(job.model.model_name_or_path.rstrip("/"))
    return finish_output(job, metrics_path, keys, f"{job.algorithm.name} on Ray ({model_name})", summary)


def sampling_config(g, template_kwargs: Optional[dict]):
    """The ``GenerationConfig`` of the ``generation`` section (n = the group size)."""
    from primitives.types import GenerationConfig

    return GenerationConfig(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                            top_k=g.top_k, n=g.group_size, stop=tuple(g.stop), template_kwargs=template_kwargs)


def sft_stage(cluster, inputs: RLInputs, logger) -> None:
    """The RL job's SFT stage: train, send the weights to the generators, make them the
    reference, and give the trainers a fresh optimizer at the RL learning rate."""
    from cluster.loop.sft import train_sft
    from cluster.ray_wing.backend import RayBackend, copy_policy_to_reference, sync_weights
    from cluster.ray_wing.groups import fan_out, gather
    from primitives.model.training import linear_warmup

    sft = inputs.job.sft
    train_sft(RayBackend(cluster), inputs.sft_samples, sft.steps, sft.batch, linear_warmup(sft.lr, sft.warmup),
              seed=inputs.job.seed, logger=logger, eval_samples=inputs.sft_eval_samples,
              eval_every=sft.eval_every or sft.steps)
    sync_weights(cluster, version=0, move_reference=False)
    copy_policy_to_reference(cluster)
    gather(fan_out(cluster.trainers, "reset_optimizer", inputs.job.algorithm.lr), cluster.timeout_s)


def accuracy_figures(before: dict, after: dict) -> dict:
    """The summary's eval figures before and after RL (``{}`` when evaluation is off)."""
    if not before:
        return {}
    return {"accuracy_before_rl": before["eval/accuracy"], "accuracy_after_rl": after["eval/accuracy"],
            "accuracy_gain_points": round(100 * (after["eval/accuracy"] - before["eval/accuracy"]), 2),
            "eval_reward_mean_before": before["eval/reward_mean"], "eval_reward_mean_after": after["eval/reward_mean"]}


def with_critic(backend, inputs: RLInputs, with_sft: bool):
    """Add the critic group for an algorithm whose advantage reads values (PPO), initialised
    from the policy as it stands (after an SFT stage: its saved HF copy) or a reward model."""
    from cluster.ray_wing.roles import add_critics
    from primitives.types import TrainState
    from rl_actors.trainer import TrainerConfig

    job, cfg, algo = inputs.job, inputs.job.cluster, inputs.job.algorithm
    model = job.model
    if with_sft and algo.critic_init == "policy":
        sft_copy = os.path.join(job.logging.out, "sft_model")
        backend.save(sft_copy, TrainState())
        model = ModelConfig(os.path.join(sft_copy, "hf"), job.model.dtype, job.model.device,
                            job.model.trust_remote_code, job.model.attn_implementation)
    critic_cfg = TrainerConfig(zero_stage=cfg.zero_stage, lr=algo.critic_lr or algo.lr,
                               micro_batch_size=cfg.micro_batch_size)
    backend.cluster = add_critics(backend.cluster, model, cfg, critic_cfg, algo.critic_init, job.seed)


def train_rl(inputs: RLInputs, logger) -> dict:
    """Build the cluster, run the SFT stage (or resume), RL with evaluation, the final pass@k,
    and save the final model. Returns the figures of the run and its metrics history."""
    from cluster.loop.evaluate import evaluate
    from cluster.loop.train import train
    from cluster.ray_wing.backend import RayBackend
    from cluster.ray_wing.roles import build_rl_cluster, shutdown_cluster
    from primitives.io.data import make_prompt_source
    from primitives.maths.algorithms import constant_schedule, needs_values, uses_reference
    from primitives.model.training import linear_warmup
    from primitives.types import TrainState
    from rl_actors.trainer import TrainerConfig

    job, out = inputs.job, inputs.job.logging.out
    cfg, ev, algo = job.cluster, job.eval, job.algorithm
    gen = sampling_config(job.generation, inputs.template_kwargs)
    eval_gen = gen._replace(temperature=ev.temperature, n=ev.k, top_p=1.0, top_k=0)
    with_sft = job.sft.steps > 0 and not job.checkpoint.resume
    trainer_cfg = TrainerConfig(zero_stage=cfg.zero_stage, lr=job.sft.lr if with_sft else algo.lr,
                                micro_batch_size=cfg.micro_batch_size)
    names = inputs.component_names if len(inputs.component_names) > 1 else None
    cluster_start = time.time()
    backend = RayBackend(build_rl_cluster(job.model, cfg, trainer_cfg, inputs.reward_fn, uses_reference(inputs.algo),
                                          aggregate_fn=inputs.aggregate_fn, seed=job.seed,
                                          bucket_mb=cfg.sync_bucket_mb, reserve_critics=needs_values(inputs.algo)))

    def run_eval(b, s, run_gen=eval_gen, k=ev.k, name="step") -> dict:
        return evaluate(b, inputs.eval_items, run_gen, k=k, correct=ev.threshold, step=s.iteration,
                        component_names=names, samples_path=os.path.join(out, "samples", f"{name}_{s.iteration}.jsonl"))

    def save(b, s):
        b.save(os.path.join(out, "checkpoints", f"step_{s.iteration}"), s)

    built, skipped = time.time(), 0.0  # skipped: SFT and evaluation seconds, training rather than start-up
    try:
        if with_sft:
            sft_stage(backend.cluster, inputs, logger)
            skipped = time.time() - built
        if needs_values(inputs.algo):
            with_critic(backend, inputs, with_sft)
        if job.checkpoint.resume:  # weights, optimizer, reference, critic, data position and versions
            start_state = backend.load(job.checkpoint.resume)
        else:
            start_state = TrainState(rng_seed=job.seed)
        t_eval = time.time()
        before = run_eval(backend, start_state) if inputs.eval_items else {}
        skipped += time.time() - t_eval
        if before:  # the curves' first point: the step before the first RL step
            logger({**before, "step": start_state.iteration - 1})
            print(f"eval accuracy {'at the checkpoint' if job.checkpoint.resume else 'before RL'}: "
                  f"{before['eval/accuracy']:.3f}", flush=True)
        startup = {**backend.cluster.startup, "before_rl": round(time.time() - built - skipped, 3)}
        state = train(backend, make_prompt_source(inputs.train_items, seed=job.seed, shuffle=job.data.shuffle),
                      constant_schedule(inputs.algo), gen, algo.steps, algo.prompts_per_step,
                      linear_warmup(algo.lr, algo.warmup), start_state, logger,
                      run_eval if inputs.eval_items else None,
                      ev.every or algo.steps, save, job.checkpoint.every,
                      max_resample_rounds=algo.max_resample_rounds, component_names=names,
                      max_staleness=algo.max_staleness)
        history = list(state.metrics_history[len(start_state.metrics_history):])
        startup["first_step"] = round(history[0]["time/step"], 3) if history else None
        after = next((m for m in reversed(history) if "eval/accuracy" in m), before)
        if after:
            print(f"eval accuracy after {algo.name}: {after['eval/accuracy']:.3f}", flush=True)
        final, k = {}, ev.final_pass_k
        if k and inputs.eval_items:  # pass@k at the sampling temperature (Chen et al. 2021)
            sampled = run_eval(backend, state, gen, k, f"pass_at_{k}_step")
            final = {f"eval/pass@{k}": sampled[f"eval/pass@{k}"], "eval/pass@1_sampled": sampled["eval/pass@1"],
                     "eval/pass_temperature": gen.temperature}
        backend.save(os.path.join(out, "final_model"), state)
        c = backend.cluster
        reference = "trainers" if c.reference_on_trainers else ("workers" if c.reference is not None else None)
        generation = "trainers" if c.generate_on_trainers else "workers"
        engine, address = c.generator_engine, c.ray_address
    finally:
        shutdown_cluster(backend.cluster)
    return {"reference": reference, "generation": generation, "generator_engine": engine, "ray_address": address,
            **accuracy_figures(before, after), **final, "cluster_started_at": cluster_start,
            "startup": startup, "history": history}


# ----------------------------------------------------------------------------- SFT

class SFTInputs(NamedTuple):
    job: SFTJob  # paths resolved, model a local directory
    samples: list
    eval_samples: list


@checked
def prepare_sft(job: SFTJob) -> SFTInputs:
    """Every check and load of an SFT job that needs no Ray."""
    job = with_resolved_paths(job)
    errors = sft_errors(job.sft, in_rl_job=False) + cluster_errors(job.cluster, rl_roles=False,
                                                                   base=SFTJob._field_defaults["cluster"])
    errors += model_errors(job.model) + _checks([(job.checkpoint.every >= 0, "checkpoint.every must be >= 0")])
    if job.checkpoint.resume:
        errors += resume_errors(job.checkpoint.resume)
    raise_if(errors)
    job = job._replace(model=resolve_model(job.model, job.logging.out, job.seed))
    samples, eval_samples = sft_samples(job.sft, load_tokenizer(job.model))
    return SFTInputs(job, samples, eval_samples)


def run_sft(job: SFTJob) -> dict:
    """The SFT job: check and load (no Ray), train on the trainer group with eval loss,
    checkpoints every ``checkpoint.every`` steps and the final model (HF in ``final_model/hf``)."""
    from cluster.loop.sft import evaluate_sft, train_sft
    from cluster.ray_wing.backend import RayBackend, load_cluster_checkpoint
    from cluster.ray_wing.roles import build_sft_cluster, shutdown_cluster
    from primitives.model.training import linear_warmup
    from primitives.types import TrainState
    from rl_actors.trainer import TrainerConfig

    job, samples, eval_samples = prepare_sft(job)
    start, out, sft = time.time(), job.logging.out, job.sft
    logger, metrics_path = start_output(job)
    trainer_cfg = TrainerConfig(zero_stage=job.cluster.zero_stage, lr=sft.lr,
                                micro_batch_size=job.cluster.micro_batch_size)
    cluster = build_sft_cluster(job.model, job.cluster, trainer_cfg, seed=job.seed)
    try:
        first = load_cluster_checkpoint(cluster, job.checkpoint.resume).iteration if job.checkpoint.resume else 0
        if first > sft.steps:
            raise ConfigErrors([f"checkpoint.resume {job.checkpoint.resume} is at step {first}, past sft.steps "
                                f"{sft.steps}; raise sft.steps to train on"])
        backend = RayBackend(cluster)
        before = evaluate_sft(backend, eval_samples)["eval/loss_sft"] if eval_samples else None
        save = lambda b, step: b.save(  # noqa: E731
            os.path.join(out, "checkpoints", f"step_{step}"), TrainState(iteration=step, global_step=step))
        last = train_sft(backend, samples, sft.steps, sft.batch, linear_warmup(sft.lr, sft.warmup), seed=job.seed,
                         logger=logger, eval_samples=eval_samples,
                         eval_every=sft.eval_every or sft.steps, checkpoint_fn=save,
                         checkpoint_every=job.checkpoint.every, start_step=first)
        backend.save(os.path.join(out, "final_model"), TrainState(iteration=sft.steps, global_step=sft.steps))
    finally:
        shutdown_cluster(cluster)
    rows = [json.loads(line) for line in open(metrics_path)]
    summary = {"sft_steps": sft.steps, "resumed_at_step": first, "train_samples": len(samples),
               "eval_samples": len(eval_samples), "loss_sft_first": rows[0].get("loss/sft") if rows else None,
               "loss_sft_last": last.get("loss/sft"), "eval_loss_before": before,
               "eval_loss_after": last.get("eval/loss_sft"), "model": job.model.model_name_or_path,
               "trainer_ranks": job.cluster.trainers, "zero_stage": job.cluster.zero_stage, "seed": job.seed,
               "wall_s": round(time.time() - start, 1), "out": out, "hf_model": os.path.join(out, "final_model", "hf")}
    return finish_output(job, metrics_path, ["loss/sft", "eval/loss_sft", "lr"], "SFT on Ray", summary)
