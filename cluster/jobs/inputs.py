"""A job's inputs, checked and loaded before Ray starts: paths, the model directory (built for
the embedded models), prompts and SFT samples, rewards (``prepare_rl`` / ``prepare_sft``).
"""
from __future__ import annotations

import inspect
import json
import os
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

from cluster.jobs.checks import (
    ConfigErrors,
    algorithm_of,
    checked,
    checkpoint_errors,
    cluster_errors,
    failed_checks,
    lora_reward_reference_errors,
    raise_if,
    rl_errors,
    sft_errors,
)
from cluster.jobs.config import EMBEDDED_MODELS, RLJob, SFTJob, embedded_model_dir
from cluster.jobs.resume import resume_change_errors, resume_errors
from cluster.ray_wing.config import with_lora_reference
from primitives.io.data import (
    PromptFormat,
    Records,
    chat_template_kwargs,
    load_records,
    sft_samples_from_records,
    split_eval,
)
from primitives.io.outputs import resolve_output_dir
from primitives.types import ModelConfig

if TYPE_CHECKING:
    from cluster.jobs.extensions import BuiltTools
    from primitives.maths.algorithms import AlgorithmConfig


def with_resolved_paths(job):
    """``job`` with logging.out and checkpoint.resume absolute (inside ``ray job submit`` under
    $RAYRL_OUTPUT_ROOT, not Ray's temporary copy of the checkout), and ``resume: auto``
    resolved (``resolve_resume``)."""
    out = resolve_output_dir(job.logging.out)
    return job._replace(logging=job.logging._replace(out=out),
                        checkpoint=job.checkpoint._replace(resume=resolve_resume(job.checkpoint.resume, out)))


RESUME_AUTO = "auto"  # checkpoint.resume: the newest complete checkpoint of the run, if any


def resolve_resume(resume: Optional[str], out: str) -> Optional[str]:
    """The checkpoint a job continues from: ``resume`` made absolute, or for ``auto`` the newest
    complete ``step_N`` in ``<out>/checkpoints`` (leftovers of a killed write are skipped), or
    None - a fresh start - when there is none. So a driver that was killed continues when
    the same command runs again with ``--checkpoint.resume auto``. Says which it chose."""
    from primitives.io.checkpoint import latest_checkpoint

    if resume != RESUME_AUTO:
        return resolve_output_dir(resume) if resume else None
    directory = os.path.join(out, "checkpoints")
    found = latest_checkpoint(directory)
    chosen = f"resuming from {found}" if found else f"no checkpoint in {directory}: a fresh start"
    print(f"checkpoint.resume auto: {chosen}", flush=True)
    return found


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

        return model._replace(model_name_or_path=save_tiny_model(embedded_model_dir(name, out), seed=seed))
    if name == "smollm2":
        from primitives.fixtures.pretrained import save_smollm2

        return model._replace(model_name_or_path=save_smollm2(embedded_model_dir(name, out)))
    raise_if(model_dir_errors(name))
    return model._replace(model_name_or_path=os.path.abspath(name))


def model_errors(model: ModelConfig) -> list:
    from primitives.model.lora import value_errors

    checks = [(model.dtype in ("float32", "bfloat16", "float16"),
               f"model.dtype must be float32, bfloat16 or float16, got {model.dtype}")]
    if model.model_name_or_path not in EMBEDDED_MODELS:
        checks += [(False, e) for e in model_dir_errors(model.model_name_or_path)]
    return failed_checks(checks) + value_errors(model.lora)


def resolved_model(model: ModelConfig, out: str, seed: int) -> ModelConfig:
    """``resolve_model``, then the checks that need the model's directory: LoRA's target modules
    against the model's own modules (an empty copy: no weights read)."""
    from primitives.model.lora import target_errors

    model = resolve_model(model, out, seed)
    raise_if(target_errors(model.model_name_or_path, model.lora, model.trust_remote_code))
    return model


def load_tokenizer(model: ModelConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.model_name_or_path, trust_remote_code=model.trust_remote_code)


# ----------------------------------------------------------------------------- data


def load_task(name: str, kwargs: Optional[dict], seed: int):
    """The ``TaskData`` of a built-in task or a user ``module:function(seed, **kwargs)``."""
    from primitives.fixtures.tasks import TASKS, TaskData
    from primitives.hooks import did_you_mean, load_function

    fn: Callable
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
        if data.path is None:
            raise ConfigErrors(["data: name a task (data.task) or a prompt file (data.path)"])
        train, evals = load_train_eval(data.path, data.fields, data.format, eval_data, data.split)
    if eval_on and not evals:
        raise ConfigErrors([f"evaluation is on but the task {data.task} has no eval prompts; set eval.enabled: false"])
    return list(train), list(evals), task


def check_prompts(items, tokenizer, data):
    """The prompts as the generators will render them: a chat template where chat prompts need
    one, and none longer than ``data.max_prompt_tokens``. Their lengths in tokens."""
    from primitives.io.data import check_prompt_lengths

    return check_prompt_lengths(items, tokenizer, data.max_prompt_tokens, chat_template_kwargs(tokenizer, data.format))


def vllm_room_errors(items, lengths, job) -> list:
    """With vLLM generators and ``cluster.vllm.max_model_len``: the first prompt with no room for
    ``generation.max_new_tokens`` after it. vLLM refuses a prompt over its engine's length mid-job,
    and cuts a completion short at it without a word (a first turn, with tools: later turns are
    longer still)."""
    from cluster.jobs.checks import generates_with_vllm

    limit, room = job.cluster.vllm.max_model_len, job.generation.max_new_tokens
    if not generates_with_vllm(job.cluster) or limit is None or not len(lengths) or lengths.max() + room <= limit:
        return []
    k = int((lengths + room > limit).argmax())
    where = items[k].source or f"item {items[k].index}"
    return [f"{where}: prompt is {lengths[k]} tokens, and generation.max_new_tokens {room} after it is over "
            f"cluster.vllm.max_model_len {limit} (the longest prompt is {lengths.max()} tokens); raise "
            f"cluster.vllm.max_model_len or lower generation.max_new_tokens"]


def sft_samples(sft, tokenizer, task=None) -> tuple:
    """``(train_samples, eval_samples)`` of the SFT data: ``sft.path``, else the task's
    demonstrations; eval samples from ``sft.eval_set`` (a file or a held-out part), else ``[]``."""
    from primitives.io.data import SFTFields

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


class RLInputs(NamedTuple):
    """What ``prepare_rl`` checked and built; ``run_rl`` starts the actors with it."""

    job: RLJob  # paths resolved, model a local directory
    train_items: list
    eval_items: list
    sft_samples: list
    sft_eval_samples: list
    reward_fn: Callable
    aggregate_fn: Optional[Callable]
    component_names: tuple
    algo: AlgorithmConfig  # of step 0
    info: dict  # facts of the task for the summary
    template_kwargs: Optional[dict]  # chat-template variables (enable_thinking) the generators render with
    schedule: Optional[Callable] = None  # (iteration, last_metrics) -> AlgorithmConfig (the schedule section)
    algos: tuple = ()  # every algorithm the schedule can return (step 0's first)
    ref_update_fn: Optional[Callable] = None  # how the reference moves (None: fixed)
    shaping_fn: Optional[Callable] = None  # reward shaping on the reward workers (None: none)
    tools: Optional[BuiltTools] = None  # None: single-turn rollouts
    generator_policy: Optional[Callable] = None  # (history, current) -> generator workers (cluster.scaling)


@checked
def prepare_rl(job: RLJob, beside=None) -> RLInputs:
    """Every check and every load that needs no Ray, in order of cost. ``beside(job, algo)``
    runs in this thread once every value is checked and the prompts are read, while the
    model and tokenizer load in another (``run_rl`` starts Ray there: each side keeps about
    one core busy, and Ray's start is mostly waiting for its processes)."""
    from primitives.env.rewards import build_reward

    found = job.checkpoint.resume == RESUME_AUTO
    job = with_resolved_paths(job)
    errors = rl_errors(job) + model_errors(job.model)
    if job.checkpoint.resume:
        errors += resume_errors(job.checkpoint.resume, ("algorithm.steps", job.algorithm.steps), found)
    raise_if(errors)
    reward_fn, aggregate_fn, names = build_reward(job.rewards)
    algo = algorithm_of(job.algorithm)
    extensions = job_extensions(job)
    raise_if(lora_reward_reference_errors(job, extensions["algos"], extensions["shaping_fn"]))
    job = with_sft_weights(job._replace(cluster=with_lora_reference(job.cluster, job.model.lora)))
    if job.checkpoint.resume:  # compared as the run's config.yaml holds it: SFT weights and reference resolved
        raise_if(resume_change_errors(job.checkpoint.resume, job, "algorithm.steps"))
    train, evals, task = rl_prompts(job, job.eval.enabled)  # before the model: a bad file fails in seconds

    def load(job=job) -> RLInputs:
        job = job._replace(model=resolved_model(job.model, job.logging.out, job.seed))
        if job.checkpoint.resume and job.sft.full_weights and job.model.lora.enabled:
            job = job._replace(model=job.model._replace(model_name_or_path=adapters_base(job.checkpoint.resume)))
        tokenizer = load_tokenizer(job.model)
        raise_if(vllm_room_errors(train + evals, check_prompts(train + evals, tokenizer, job.data), job))
        sft, sft_eval = sft_samples(job.sft, tokenizer, task) if job.sft.steps and not job.checkpoint.resume \
            else ([], [])
        return RLInputs(job, train, evals[: job.eval.max_items], sft, sft_eval, reward_fn, aggregate_fn, names, algo,
                        dict(task.info or {}) if task else {}, chat_template_kwargs(tokenizer, job.data.format) or None,
                        **extensions)

    return load() if beside is None else side_by_side(load, lambda: beside(job, extensions))


def with_sft_weights(job: RLJob) -> RLJob:
    """``sft.full_weights`` decided for an RL job with an SFT stage before RL on adapters (``model.lora``):
    None becomes true for the embedded ``tiny`` model and false for any other. The tiny model starts
    random: adapters cannot train its embeddings, which are also its output head, so their scale caps the
    logits (an adapter-trained SFT stage samples near-uniformly at temperature 1). Without adapters or an
    SFT stage the field stays as given."""
    sft = job.sft
    if sft.full_weights is not None or not (job.model.lora.enabled and sft.steps > 0):
        return job
    return job._replace(sft=sft._replace(full_weights=job.model.model_name_or_path == "tiny"))


# <out>/sft_model: the SFT stage's model (sft.save; the PPO critic's start; LoRA's base after a full-weight stage)
SFT_MODEL = "sft_model"


def adapters_base(checkpoint: str) -> str:
    """The model a LoRA checkpoint's adapters were trained on, as its ``adapter/adapter_config.json`` names
    it: after a full-weight SFT stage (``sft.full_weights``) that is the stage's model, not the job's. The
    stage's model of the checkpoint's own run comes first (``<run>/sft_model`` beside ``<run>/checkpoints``):
    a run set aside (``cluster.jobs.outputs.set_aside_earlier_run``) took it along, and the named path may
    hold a newer run's."""
    config = os.path.join(checkpoint, "adapter", "adapter_config.json")
    base = json.load(open(config)).get("base_model_name_or_path") if os.path.isfile(config) else None
    _, named, tail = os.path.normpath(base or "").rpartition(os.sep + SFT_MODEL)
    if named and (not tail or tail.startswith(os.sep)):  # <a run>/sft_model[/...]
        run = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))  # <run>/checkpoints/step_N
        own = os.path.join(run, SFT_MODEL) + tail
        base = own if os.path.isdir(own) else base
    raise_if([] if base and os.path.isdir(base) else [
        f"checkpoint.resume {checkpoint}: a LoRA job whose SFT stage trained every weight resumes on that "
        f"stage's model, but {config} {'names ' + repr(base) + ', not a directory' if base else 'does not name it'}"])
    return str(base)


def job_extensions(job: RLJob) -> dict:
    """The schedule, reference update, shaping and tools of the job file, built and checked
    (every section's errors together); a reference that moves must be one some step reads."""
    from cluster.jobs.extensions import (
        build_generator_policy,
        build_ref_update,
        build_schedule,
        build_shaping,
        build_tools,
    )
    from primitives.maths.algorithms import uses_reference

    built: dict = {}
    errors: list = []
    for key, build in (("schedule", build_schedule), ("ref_update_fn", build_ref_update),
                       ("shaping_fn", build_shaping), ("tools", build_tools),
                       ("generator_policy", build_generator_policy)):
        try:
            built[key] = build(job)
        except ConfigErrors as e:
            errors += e.errors
    raise_if(errors)
    schedule, algos = built.pop("schedule")
    reads_reference = any(uses_reference(a) for a in algos) or getattr(built["shaping_fn"], "needs_reference", False)
    raise_if(failed_checks([(built["ref_update_fn"] is None or reads_reference,
                             f"reference.update {job.reference.update} moves a reference that no step reads: every "
                             "algorithm has kl_coef 0 and no loss or shaping reads reference logprobs")]))
    return {"schedule": schedule, "algos": tuple(algos), **built}


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
            failed = future.exception()  # waits for work
            if failed is not None:
                raise failed from error
            raise
        return future.result()


class SFTInputs(NamedTuple):
    job: SFTJob  # paths resolved, model a local directory
    samples: list
    eval_samples: list


@checked
def prepare_sft(job: SFTJob) -> SFTInputs:
    """Every check and load of an SFT job that needs no Ray."""
    found = job.checkpoint.resume == RESUME_AUTO
    job = with_resolved_paths(job)
    errors = sft_errors(job.sft, in_rl_job=False) + cluster_errors(job.cluster, rl_roles=False,
                                                                   base=SFTJob._field_defaults["cluster"])
    errors += model_errors(job.model) + checkpoint_errors(job.checkpoint)
    if job.checkpoint.resume:
        errors += resume_errors(job.checkpoint.resume, ("sft.steps", job.sft.steps), found)
        errors += resume_change_errors(job.checkpoint.resume, job, "sft.steps")
    raise_if(errors)
    job = job._replace(model=resolved_model(job.model, job.logging.out, job.seed))
    samples, eval_samples = sft_samples(job.sft, load_tokenizer(job.model))
    return SFTInputs(job, samples, eval_samples)
