"""Every check of a job's values that needs no file, model or Ray: each returns the problems it
finds as lines naming the field (``ConfigErrors`` holds them all).
"""
from __future__ import annotations

import os

from cluster.jobs.config import (
    RLJob,
)
from cluster.ray_wing.config import ClusterConfig
from primitives.io.data import (
    EvalData,
    FieldMap,
    PromptFormat,
)
from primitives.types import DECODE_MODES, VLLM_CPU_BLOCK, VLLM_MIN_TEMPERATURE
from rl_actors.common import GENERATE_ON_ZERO3, frozen_recompute_error


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


def failed_checks(pairs) -> list:
    return [msg for ok, msg in pairs if not ok]


def checkpoint_errors(ckpt) -> list:
    """The problems of a job's ``checkpoint`` section (the resume directory is checked once resolved)."""
    return failed_checks([
        (ckpt.every >= 0, f"checkpoint.every must be >= 0 (0: not by count), got {ckpt.every}"),
        (ckpt.minutes >= 0, f"checkpoint.minutes must be >= 0 (0: not by time), got {ckpt.minutes}"),
        (ckpt.keep >= 0, f"checkpoint.keep must be >= 0 (0: keep every checkpoint), got {ckpt.keep}"),
    ])


GENERATOR_FIELDS = ("generators", "generator_cpus", "generator_gpus", "vllm", "scaling")


REFERENCE_FIELDS = ("reference_workers", "reference_cpus", "reference_gpus")


RL_ROLE_FIELDS = GENERATOR_FIELDS + REFERENCE_FIELDS + ("reward_workers", "reward_cpus", "reference_on_trainers",
                                                        "generate_on_trainers", "sync_bucket_mb", "critics",
                                                        "critic_cpus", "critic_gpus")


def ignored_errors(cluster, fields, why: str, base) -> list:
    """Settings of roles that do not run in this layout: a value other than the job's default
    (``base``) or a count of 0 would be ignored, so it is refused, with ``why``."""
    return [f"cluster.{name} {getattr(cluster, name)!r} would be ignored: {why}" for name in fields
            if getattr(cluster, name) != getattr(base, name) and getattr(cluster, name) != 0]


SCALING_POLICIES = ("fixed", "idle", "steps")


def scaling_errors(cluster) -> list:
    """Checks of ``cluster.scaling`` (a module:function policy is loaded when the job builds it)."""
    sc = cluster.scaling
    if sc.policy not in SCALING_POLICIES and ":" not in sc.policy:
        return [f"cluster.scaling.policy '{sc.policy}' is unknown (built-in: {', '.join(SCALING_POLICIES)}; or "
                "module:function)"]
    if sc.policy == "idle" or ":" in sc.policy:  # a user policy's counts are kept within minimum, maximum
        top = sc.maximum or cluster.generators
        return failed_checks([
            (1 <= sc.minimum <= cluster.generators <= top,
             f"cluster.scaling: need 1 <= minimum ({sc.minimum}) <= cluster.generators ({cluster.generators}) <= "
             f"maximum ({top})"),
            (sc.every >= 1, f"cluster.scaling.every must be at least 1, got {sc.every}"),
            (0 <= sc.idle_threshold < 1, f"cluster.scaling.idle_threshold must be in [0, 1), got {sc.idle_threshold}"),
        ])
    if sc.policy == "steps":
        steps = sc.at_steps or {}
        bad = [k for k, v in steps.items() if not str(k).isdigit() or not isinstance(v, int) or v < 1]
        return failed_checks([(bool(steps) and not bad, "cluster.scaling.at_steps must map steps to counts >= 1, "
                                                        f"e.g. {{10: 3, 20: 2}}; got {sc.at_steps}")])
    return []


def cluster_errors(cluster, rl_roles: bool, base=None) -> list:
    """Every check of the ``cluster`` section; ``base`` is the job's default section (the
    settings a user did not make), against which an ignored setting is told apart."""
    base = ClusterConfig() if base is None else base
    checks = [
        (cluster.trainers >= 1, "cluster.trainers must be at least 1"),
        (cluster.zero_stage in (1, 2, 3), f"cluster.zero_stage must be 1, 2 or 3, got {cluster.zero_stage}"),
        (cluster.placement in ("PACK", "SPREAD"), f"cluster.placement must be PACK or SPREAD, got {cluster.placement}"),
        (cluster.call_timeout_s > 0, "cluster.call_timeout_s must be positive"),
        (cluster.start_timeout_s is None or cluster.start_timeout_s > 0,
         "cluster.start_timeout_s must be positive, or None (as cluster.call_timeout_s)"),
        (cluster.heartbeat_s == 0 or cluster.heartbeat_s >= 10,
         f"cluster.heartbeat_s must be 0 (off) or at least 10 s (a beat comes every 2 s), got {cluster.heartbeat_s}"),
        (cluster.max_restarts >= 0, f"cluster.max_restarts must be >= 0, got {cluster.max_restarts}"),
        (cluster.snapshot_every is None or cluster.snapshot_every >= 0,
         f"cluster.snapshot_every must be None (by cost), 0 (none) or a step count, got {cluster.snapshot_every}"),
        (0 < cluster.snapshot_overhead <= 1, f"cluster.snapshot_overhead must be in (0, 1], got "
                                             f"{cluster.snapshot_overhead}"),
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
    ignored = scaling_errors(cluster) if rl_roles else []
    if rl_roles and cluster.generate_on_trainers:
        ignored += ignored_errors(cluster, GENERATOR_FIELDS, "cluster.generate_on_trainers generates on the trainer "
                                  "ranks (no generator workers)", base)
    if rl_roles and cluster.reference_on_trainers:
        ignored += ignored_errors(cluster, REFERENCE_FIELDS, "cluster.reference_on_trainers keeps the reference on "
                                  "the trainer ranks (no reference workers)", base)
    if not rl_roles:
        ignored += ignored_errors(cluster, RL_ROLE_FIELDS, "an SFT job runs the trainer ranks alone", base)
    return failed_checks(checks) + ignored


def lora_errors(job: RLJob) -> list:
    """An RL job with ``model.lora``: the reference lives in the trainer ranks' module (the base model
    with the adapters off), so reference worker settings would be ignored; and gradient checkpointing
    under ZeRO-3 needs a DeepSpeed that recomputes frozen weights (``frozen_recompute_error``)."""
    cluster = job.cluster
    refused = frozen_recompute_error(job.model.lora.enabled, cluster.zero_stage, cluster.gradient_checkpointing)
    errors = [refused] if refused else []
    if not job.model.lora.enabled or job.cluster.reference_on_trainers:
        return errors
    return errors + ignored_errors(cluster, REFERENCE_FIELDS, "with model.lora the reference is the trainer ranks' "
                                   "model with its adapters off (no reference workers)", ClusterConfig())


def lora_reward_reference_errors(job: RLJob, algos, shaping_fn) -> list:
    """Under ZeRO-3 a LoRA reference is the trainer ranks' partitioned module, whose forwards are
    collective: it cannot score rollouts chunk by chunk before the batch is made, which KL in the
    reward (``kl_in_reward`` with a ``kl_coef``: ppo, reinforce_pp) and a shaping that reads the
    reference (kl_penalty) need."""
    if not job.model.lora.enabled or job.cluster.zero_stage != 3:
        return []
    readers = [f"algorithm {a.name} (KL in the reward)" for a in algos if a.kl_in_reward and a.kl_coef]
    if getattr(shaping_fn, "needs_reference", False):
        readers.append("the shaping (it reads reference logprobs)")
    return [f"{', '.join(dict.fromkeys(readers))} with model.lora under cluster.zero_stage 3: the reference is the "
            "trainer ranks' partitioned model with its adapters off, whose forwards are collective, so it cannot score "
            "rollouts chunk by chunk for the reward; use cluster.zero_stage 1 or 2"] if readers else []


def vllm_errors(cluster) -> list:
    """``cluster.vllm`` settings that cannot apply where the generators run (CPU: no GPUs), and
    the vLLM layouts this project has not run."""
    v, gpus = cluster.vllm, cluster.generator_gpus
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
        (v.block_size is None or v.block_size >= 1, f"cluster.vllm.block_size must be positive, got {v.block_size}"),
        (v.block_size is None or gpus > 0 or v.block_size % VLLM_CPU_BLOCK == 0,
         f"cluster.vllm.block_size {v.block_size}: vLLM's CPU attention takes multiples of {VLLM_CPU_BLOCK} tokens, "
         f"and the generators run on CPU (cluster.generator_gpus 0)"),
        (not v.enable_sleep_mode or gpus > 0,
         "cluster.vllm.enable_sleep_mode releases GPU memory; the generators run on CPU (cluster.generator_gpus 0)"),
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
                   (sft.path is not None, "sft.path is required: the SFT data file or directory"),
                   (sft.full_weights is None, f"sft.full_weights {sft.full_weights} would be ignored: rayrl sft "
                                              "trains the adapters with model.lora, else every weight (full_weights is "
                                              "for an RL job's SFT stage before RL on adapters)"),
                   (not sft.save, "sft.save would be ignored: rayrl sft saves its model in <out>/final_model")]
    return failed_checks(checks)


def sft_weights_errors(job: RLJob) -> list:
    """``sft.full_weights`` says what an RL job's SFT stage trains when RL trains adapters: it needs an
    SFT stage, and false (the adapters) needs adapters. ``sft.save`` needs an SFT stage."""
    full = job.sft.full_weights
    saved = failed_checks([(not job.sft.save or job.sft.steps > 0,
                            "sft.save would be ignored: sft.steps is 0 (no SFT stage)")])
    if full is None:
        return saved
    return saved + failed_checks([
        (job.sft.steps > 0, f"sft.full_weights {full} would be ignored: sft.steps is 0 (no SFT stage)"),
        (full or job.model.lora.enabled, "sft.full_weights false needs model.lora (rank > 0): without adapters the "
                                         "SFT stage trains every weight"),
    ])


def algorithm_errors(job: RLJob) -> list:
    """Checks of the algorithm record the section builds: it resolves, its functions take their
    documented arguments, it needs no critic, and each trainer rank gets rows."""
    from primitives.maths.algorithms import check_algorithm_functions, check_algorithm_picklable

    try:
        record = algorithm_of(job.algorithm)
        check_algorithm_functions(record)
        check_algorithm_picklable(record)
    except ConfigErrors as e:
        return e.errors
    except ValueError as e:
        return [f"algorithm: {e}"]
    return record_errors(job, record)


def record_errors(job: RLJob, record, where: str = "") -> list:
    """The job-level checks of one algorithm record the job may run (the algorithm section's,
    or a schedule phase's, named ``where``): its critic, its rows per trainer rank, and vLLM's
    truncated logprobs under its importance weight."""
    from primitives.maths.algorithms import min_group_size, needs_values, pairwise

    algo, gen = job.algorithm, job.generation
    need = min_group_size(record)
    rows = algo.prompts_per_step * (2 if pairwise(record) else gen.group_size)  # pairwise loss: a pair per prompt
    init = algo.critic_init
    errors = failed_checks([
        (not needs_values(record) or init == "policy" or os.path.isdir(init),
         f"algorithm.critic_init must be 'policy' or a reward model directory, got '{init}'"),
        (not needs_values(record) or job.cluster.critics >= 1, "cluster.critics must be at least 1 for "
                                                               f"'{record.name}', whose advantage reads critic values"),
        (gen.group_size < 1 or gen.group_size >= need,
         f"generation.group_size must be at least {need} for '{record.name}' (completions per prompt: its "
         f"advantages or pairs compare completions of one prompt), got {gen.group_size}; algorithm.name reinforce "
         "learns from single completions"),
        (gen.group_size < max(need, 1) or rows // algo.mini_batches >= job.cluster.trainers,  # a bad group size alone
         f"algorithm.mini_batches {algo.mini_batches} leaves {rows // algo.mini_batches} rows per "
         f"mini-batch for {job.cluster.trainers} trainer ranks; every rank needs rows (raise "
         "algorithm.prompts_per_step or lower algorithm.mini_batches)"),
    ]) + behaviour_logprob_errors(job, record)
    return [f"{where}: {e}" for e in errors] if where else errors


def generates_with_vllm(cluster) -> bool:
    """The job's generators are vLLM engines: asked for, or ``auto`` on generator workers with GPUs."""
    return cluster.generator_backend == "vllm" or (cluster.generator_backend == "auto" and cluster.generator_gpus > 0
                                                   and not cluster.generate_on_trainers)


def vllm_backend_words(cluster) -> str:
    """How an error names the backend setting that chose vLLM."""
    return "vllm" if cluster.generator_backend == "vllm" else \
        f"auto (vLLM on generator workers with cluster.generator_gpus {cluster.generator_gpus})"


def behaviour_logprob_errors(job: RLJob, record) -> list:
    """vLLM with top-k / top-p where the importance weight is applied. vLLM's behaviour logprobs
    (``processed_logprobs``) are renormalised over the tokens top-k / top-p keep; the trainer's
    and the HF generator's are of the full ``softmax(logits / T)``, so the weight would be the
    kept mass, not the gap between the policies (architecture sections 6-7). ``auto`` picks vLLM on
    generator workers with GPUs; a pairwise loss (online DPO) only measures the weight."""
    from primitives.maths.algorithms import pairwise

    gen, cluster = job.generation, job.cluster
    truncation = [name for name, on in ((f"generation.top_p {gen.top_p}", gen.top_p < 1),
                                        (f"generation.top_k {gen.top_k}", gen.top_k > 0)) if on]
    vllm, backend = generates_with_vllm(cluster), vllm_backend_words(cluster)
    errors = [f"generation.temperature {gen.temperature} with cluster.generator_backend {backend}: vLLM raises a "
              f"temperature below {VLLM_MIN_TEMPERATURE} to {VLLM_MIN_TEMPERATURE} (a warning), so it would sample "
              f"at {VLLM_MIN_TEMPERATURE} while the trainer and the reference score at {gen.temperature}; use 0 "
              f"(greedy) or at least {VLLM_MIN_TEMPERATURE}"] \
        if vllm and 0 < gen.temperature < VLLM_MIN_TEMPERATURE else []
    if not (truncation and vllm and record.is_level != "off" and not pairwise(record)):
        return errors
    return errors + [f"{' and '.join(truncation)} with cluster.generator_backend {backend} and algorithm.is_level "
            f"{record.is_level}: vLLM's behaviour logprobs are renormalised over the tokens top-p/top-k keep, the "
            "trainer's are of the full softmax(logits / T), so the importance weight would be the kept probability "
            "mass, not the gap between the policies; use generation.top_p 1 and generation.top_k 0, or "
            "cluster.generator_backend hf (its logprobs are of the full distribution), or algorithm.is_level off"]


def rl_errors(job: RLJob) -> list:
    """Every check of an RL job's values that needs no file, model or Ray; the algorithm record
    is checked once the algorithm section's own numbers are sound."""
    from cluster.loop.checks import run_errors
    from primitives.maths.algorithms import number_errors

    algo, gen, ev, data = job.algorithm, job.generation, job.eval, job.data
    errors = number_errors(algo.kl_coef, algo.ppo_epochs, algo.mini_batches, algo.is_level, algo.is_cap,
                           prefix="algorithm.")
    errors += run_errors(gen.temperature, algo.max_staleness, ("generation.temperature", "algorithm.max_staleness"))
    errors += failed_checks([
        (algo.steps >= 0, f"algorithm.steps must be >= 0, got {algo.steps}"),
        (algo.prompts_per_step >= 1, "algorithm.prompts_per_step must be at least 1"),
        (algo.lr > 0, f"algorithm.lr must be positive, got {algo.lr}"),
        (algo.max_resample_rounds >= 0, "algorithm.max_resample_rounds must be >= 0"),
        (algo.max_staleness == 0 or not job.cluster.generate_on_trainers,
         f"algorithm.max_staleness {algo.max_staleness} overlaps generation with training, but with "
         "cluster.generate_on_trainers both run in the trainer processes, one after the other: use 0, or "
         "generator workers"),
        (algo.warmup >= 0, "algorithm.warmup must be >= 0"),
        (algo.critic_lr is None or algo.critic_lr > 0, f"algorithm.critic_lr must be positive, got {algo.critic_lr}"),
        (gen.group_size >= 1, f"generation.group_size must be at least 1 (completions per prompt), got "
                              f"{gen.group_size}"),
        (gen.max_new_tokens >= 1, "generation.max_new_tokens must be at least 1"),
        (0 < gen.top_p <= 1, f"generation.top_p must be in (0, 1], got {gen.top_p}"),
        (gen.top_k >= 0, f"generation.top_k must be >= 0, got {gen.top_k}"),
        (gen.max_batch_rows >= 0, f"generation.max_batch_rows must be >= 0 (0: every row at once), got "
                                  f"{gen.max_batch_rows}"),
        (gen.max_batch_rows == 0 or not generates_with_vllm(job.cluster),
         f"generation.max_batch_rows {gen.max_batch_rows} caps the rows an HF generator decodes together; "
         f"cluster.generator_backend {vllm_backend_words(job.cluster)} generates with vLLM, which schedules its "
         "own batches within its KV-cache memory (cluster.vllm.gpu_memory_utilization, cpu_kv_cache_gib): use 0, "
         "or cluster.generator_backend hf"),
        (gen.decode in DECODE_MODES, f"generation.decode must be one of {', '.join(DECODE_MODES)}, got {gen.decode!r}"),
        (gen.decode != "packed" or not (job.cluster.trainer_gpus if job.cluster.generate_on_trainers
                                        else job.cluster.generator_gpus),
         "generation.decode packed packs weights for oneDNN on a CPU, and generation here runs on GPUs "
         "(cluster.generator_gpus, or cluster.trainer_gpus with cluster.generate_on_trainers): use auto"),
        (ev.every >= 0, "eval.every must be >= 0"),
        (ev.k >= 1, f"eval.k must be at least 1, got {ev.k}"),
        (ev.temperature >= 0, f"eval.temperature must be >= 0, got {ev.temperature}"),
        (not (0 < ev.temperature < VLLM_MIN_TEMPERATURE and generates_with_vllm(job.cluster)),
         f"eval.temperature {ev.temperature} with cluster.generator_backend {vllm_backend_words(job.cluster)}: vLLM "
         f"raises a temperature below {VLLM_MIN_TEMPERATURE} to {VLLM_MIN_TEMPERATURE} (a warning), so the "
         f"evaluation would sample at {VLLM_MIN_TEMPERATURE}; use 0 (greedy) or at least {VLLM_MIN_TEMPERATURE}"),
        (ev.k == 1 or ev.temperature > 0, f"eval.k {ev.k} samples at eval.temperature 0 are all the same greedy "
                                          "completion; set eval.temperature > 0 for pass@k"),
        (ev.max_items is None or ev.max_items >= 1, "eval.max_items must be at least 1"),
        (ev.final_pass_k >= 0, "eval.final_pass_k must be >= 0"),
        ((data.task is None) != (data.path is None), "data: give either task (a generated task) or path (a prompt "
                                                     f"file), not {'both' if data.task else 'neither'}"),
        (data.task is None or (data.eval_set, data.fields, data.format, data.split) == (
            EvalData(), FieldMap(), PromptFormat(), "train"),
         "data.eval_set, fields, format and split apply to a prompt file (data.path); a task brings its own "
         "prompts, formatted, and its eval prompts"),
        (data.max_prompt_tokens >= 1, "data.max_prompt_tokens must be at least 1"),
    ]) + checkpoint_errors(job.checkpoint)
    errors += cluster_errors(job.cluster, rl_roles=True) + sft_errors(job.sft, in_rl_job=True) + lora_errors(job)
    errors += sft_weights_errors(job)
    return errors + ([] if any(e.startswith("algorithm.") for e in errors) else algorithm_errors(job))


# ----------------------------------------------------------------------------- paths and the model


SECTION_ALGORITHM_FIELDS = ("name", "kl_coef", "ppo_epochs", "mini_batches", "is_level", "is_cap")


def algorithm_of(rl, where: str = "algorithm"):
    """The ``AlgorithmConfig`` of the ``algorithm`` section (or a schedule phase, named
    ``where`` in errors): the preset with the section's settings and ``overrides`` (any other
    field, e.g. ``clip_eps_high``, ``entropy_coef``); the preset's own KL coefficient unless
    ``kl_coef`` is given."""
    from primitives.hooks import did_you_mean
    from primitives.maths.algorithms import AlgorithmConfig, get_algorithm

    overrides = dict(rl.overrides or {})
    for key in overrides:
        if key in SECTION_ALGORITHM_FIELDS:
            own = where == "algorithm" or key in ("name", "kl_coef")
            raise ConfigErrors([f"{where}.overrides.{key}: set {where if own else 'algorithm'}.{key} instead"
                                + ("" if own else " (every phase shares it)")])
        if key not in AlgorithmConfig._fields:
            hint = did_you_mean(key, AlgorithmConfig._fields) or "; see primitives.maths.algorithms.AlgorithmConfig"
            raise ConfigErrors([f"{where}.overrides.{key}: not an AlgorithmConfig field{hint}"])
    overrides = {key: typed_override(f"{where}.overrides.{key}", key, value) for key, value in overrides.items()}
    kl = {} if rl.kl_coef is None else {"kl_coef": rl.kl_coef}
    return get_algorithm(rl.name, ppo_epochs=rl.ppo_epochs, mini_batches=rl.mini_batches, is_level=rl.is_level,
                         is_cap=rl.is_cap, **kl, **overrides)


def typed_override(where: str, key: str, value):
    """``value`` as the type of ``AlgorithmConfig.<key>`` where that is a number or a boolean: an
    ``overrides`` mapping takes any scalar, so the command line's ``false`` (tyro reads only ``False`` as
    a boolean) and YAML 1.1's ``1e9`` (no dot: a string) arrived as strings, and the string ``'false'``
    is true. A string that does not read as the type is refused, naming ``where``."""
    from typing import Union, get_args, get_origin, get_type_hints

    from primitives.maths.algorithms import AlgorithmConfig

    tp = get_type_hints(AlgorithmConfig).get(key)
    inner = [a for a in get_args(tp) if a is not type(None)]
    if get_origin(tp) is Union and len(inner) == 1 and value is not None:  # Optional[float] takes a float
        tp = inner[0]
    if tp is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if tp in (int, float) and isinstance(value, str):
        try:
            return tp(value)
        except ValueError:
            pass
    if tp in (bool, int, float) and not (isinstance(value, tp) or (tp is float and isinstance(value, int))) \
            or tp in (int, float) and isinstance(value, bool):
        raise ConfigErrors([f"{where}: expected {tp.__name__}, got {value!r}"])
    return float(value) if tp is float else value
