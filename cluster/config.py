"""Job configuration: small records per concern, each field documented, and the command line
derived from them (one flag per field). Hooks named ``module:function`` are resolved once,
here, before Ray starts; bad values fail here too.
"""
from __future__ import annotations

import argparse
import os
from typing import Annotated, NamedTuple, Optional, get_args, get_origin, get_type_hints

from primitives.hooks import load_function  # noqa: F401 (the job's hooks resolve here, before Ray starts)


class ClusterConfig(NamedTuple):
    generators: Annotated[int, "generator workers (scaled independently of the trainers)"] = 2
    trainers: Annotated[int, "trainer ranks (one DeepSpeed ZeRO data-parallel group)"] = 2
    reward_workers: Annotated[int, "reward workers"] = 1
    zero_stage: Annotated[int, "DeepSpeed ZeRO stage (1, 2 or 3)"] = 2
    generator_cpus: Annotated[float, "CPUs per generator"] = 1.0
    generator_gpus: Annotated[float, "GPUs per generator"] = 0.0
    trainer_cpus: Annotated[float, "CPUs per trainer rank"] = 1.0
    trainer_gpus: Annotated[float, "GPUs per trainer rank"] = 0.0
    reference_cpus: Annotated[float, "CPUs of the reference worker"] = 1.0
    reference_gpus: Annotated[float, "GPUs of the reference worker"] = 0.0
    reward_cpus: Annotated[float, "CPUs per reward worker"] = 1.0
    placement: Annotated[str, "placement of each role's actors: PACK or SPREAD across nodes"] = "PACK"
    generator_backend: Annotated[str, "auto (vLLM if installed and a GPU is visible), hf or vllm"] = "auto"
    pin_roles: Annotated[bool, "pin generators to nodes with the generator_node resource and trainers to "
                               "trainer_node ones (as the k8s/ worker groups advertise)"] = False
    threads_per_actor: Annotated[int, "torch threads in each actor"] = 1
    ray_address: Annotated[Optional[str], "Ray address to join (default: RAY_ADDRESS, else a local Ray)"] = None
    local_cpus: Annotated[Optional[int], "logical CPUs of a local Ray (default: enough for all actors)"] = None
    call_timeout_s: Annotated[float, "bound on every wait for actors; a dead or stuck actor fails the job"] = 600.0


class SFTConfig(NamedTuple):
    sft_steps: Annotated[int, "SFT optimizer steps"] = 1500
    sft_batch: Annotated[int, "SFT samples per step (all ranks together)"] = 64
    sft_lr: Annotated[float, "SFT peak learning rate"] = 1e-3
    sft_warmup: Annotated[int, "linear warm-up steps of the SFT learning rate"] = 50


class RLConfig(NamedTuple):
    algorithm: Annotated[str, "preset: grpo, dapo, dr_grpo, rloo, reinforce_pp, gspo, online_dpo "
                              "(ppo needs a critic, which this job does not build yet)"] = "grpo"
    rl_steps: Annotated[int, "RL iterations in all (one optimizer step each; a resumed run counts on)"] = 80
    prompts_per_step: Annotated[int, "prompts per RL step"] = 32
    group_size: Annotated[int, "completions per prompt (G)"] = 8
    max_new_tokens: Annotated[int, "completion length limit"] = 5
    temperature: Annotated[float, "sampling temperature"] = 1.0
    rl_lr: Annotated[float, "RL learning rate"] = 3e-4
    kl_coef: Annotated[Optional[float], "KL coefficient (default: the preset's own; any value > 0 adds a "
                                        "reference worker)"] = None
    ppo_epochs: Annotated[int, "passes over each rollout batch"] = 1
    mini_batches: Annotated[int, "optimizer updates per pass (the rollout batch split into this many parts)"] = 1
    is_level: Annotated[str, "truncated importance weight against the generator's logprobs: off, token "
                             "or sequence"] = "token"
    is_cap: Annotated[float, "cap of the truncated importance weight"] = 2.0
    sync_bucket_mb: Annotated[float, "weight-sync bucket size in MB"] = 64.0
    max_resample_rounds: Annotated[int, "DAPO dynamic sampling: extra generation rounds per step"] = 4
    eval_every: Annotated[int, "evaluate every N steps (0: only at the end)"] = 20
    checkpoint_every: Annotated[int, "checkpoint every N steps (0: off)"] = 0


class JobConfig(NamedTuple):
    out: Annotated[str, "output directory; inside `ray job submit` a relative path goes under $RAYRL_OUTPUT_ROOT "
                        "(default ~/rayrl), not into Ray's temporary copy of the checkout"] = "runs/grpo_tiny"
    seed: Annotated[int, "seed for the model, the task and sampling"] = 0
    model: Annotated[Optional[str], "local HF model path (default: build the embedded tiny model)"] = None
    reward_fn: Annotated[Optional[str], "reward hook as module:function (default: the task's exact match)"] = None
    heldout: Annotated[int, "held-out problems for accuracy"] = 256
    resume: Annotated[Optional[str], "a checkpoint directory written by --checkpoint-every: continue from it"] = None
    carry_error_rate: Annotated[float, "share of carry problems whose SFT demonstration drops the carry"] = 0.7


RECORDS = (JobConfig, ClusterConfig, SFTConfig, RLConfig)


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_record_arguments(parser: argparse.ArgumentParser, record) -> None:
    """One ``--field-name`` flag per field, typed and documented from its annotation."""
    hints = get_type_hints(record, include_extras=True)
    group = parser.add_argument_group(record.__name__)
    for name in record._fields:
        hint = hints[name]
        doc = hint.__metadata__[0] if hasattr(hint, "__metadata__") else ""
        base = get_args(hint)[0] if hasattr(hint, "__metadata__") else hint
        if get_origin(base) is not None and type(None) in get_args(base):  # Optional[X]
            base = next(a for a in get_args(base) if a is not type(None))
        kind = _parse_bool if base is bool else base
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=kind,
                           default=record._field_defaults[name], help=doc + " (default: %(default)s)")


def build_parser(description: str, records=RECORDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    for record in records:
        add_record_arguments(parser, record)
    return parser


def records_from_args(ns: argparse.Namespace, records=RECORDS) -> tuple:
    values = vars(ns)
    return tuple(r(**{f: values[f] for f in r._fields}) for r in records)


def validate(job: JobConfig, cluster: ClusterConfig, sft: SFTConfig, rl: RLConfig) -> None:
    """Every check that needs no Ray: raise ``ValueError`` naming the flag and what is allowed."""
    from primitives.algorithms import PRESETS
    from primitives.losses import IS_LEVELS

    rows = rl.prompts_per_step * (2 if rl.algorithm == "online_dpo" else rl.group_size)  # DPO: a pair per prompt
    checks = [
        (cluster.generators >= 1, "--generators must be at least 1"),
        (cluster.trainers >= 1, "--trainers must be at least 1"),
        (cluster.reward_workers >= 1, "--reward-workers must be at least 1"),
        (cluster.zero_stage in (1, 2, 3), f"--zero-stage must be 1, 2 or 3, got {cluster.zero_stage}"),
        (cluster.placement in ("PACK", "SPREAD"), f"--placement must be PACK or SPREAD, got {cluster.placement}"),
        (cluster.generator_backend in ("auto", "hf", "vllm"),
         f"--generator-backend must be auto, hf or vllm, got {cluster.generator_backend}"),
        (rl.algorithm in PRESETS,
         f"--algorithm '{rl.algorithm}' is unknown (choose from {', '.join(sorted(PRESETS))})"),
        (rl.algorithm != "ppo", "--algorithm ppo needs a critic (a value model), which this job does not build yet; "
                                "use reinforce_pp (REINFORCE++, critic-free) or grpo"),
        (rl.temperature > 0, f"--temperature must be > 0 for RL sampling, got {rl.temperature} "
                             "(logprobs are of softmax(logits / T); evaluation is greedy anyway)"),
        (rl.rl_lr > 0, f"--rl-lr must be positive, got {rl.rl_lr}"),
        (sft.sft_lr > 0, f"--sft-lr must be positive, got {sft.sft_lr}"),
        (rl.ppo_epochs >= 1, f"--ppo-epochs must be at least 1, got {rl.ppo_epochs}"),
        (rl.mini_batches >= 1, f"--mini-batches must be at least 1, got {rl.mini_batches}"),
        (rl.mini_batches < 1 or rows // rl.mini_batches >= cluster.trainers,
         f"--mini-batches {rl.mini_batches} leaves {rows // max(rl.mini_batches, 1)} rows per mini-batch for "
         f"{cluster.trainers} trainer ranks; every rank needs rows (raise --prompts-per-step or lower --mini-batches)"),
        (rl.is_level in IS_LEVELS, f"--is-level must be one of {', '.join(IS_LEVELS)}, got {rl.is_level}"),
        (rl.is_cap > 0, f"--is-cap must be positive, got {rl.is_cap}"),
        (rl.kl_coef is None or rl.kl_coef >= 0, f"--kl-coef must be >= 0, got {rl.kl_coef}"),
        (rl.group_size >= 2, "--group-size must be at least 2: group advantages compare completions of one prompt"),
        (rl.prompts_per_step >= 1, "--prompts-per-step must be at least 1"),
        (rl.max_new_tokens >= 1, "--max-new-tokens must be at least 1"),
        (rl.rl_steps >= 0 and sft.sft_steps >= 0, "--rl-steps and --sft-steps must be >= 0"),
        (sft.sft_batch >= 1, "--sft-batch must be at least 1"),
        (rl.sync_bucket_mb > 0, "--sync-bucket-mb must be positive"),
        (cluster.call_timeout_s > 0, "--call-timeout-s must be positive"),
        (job.heldout >= 1, "--heldout must be at least 1"),
    ]
    errors = [msg for ok, msg in checks if not ok]
    if job.resume is not None:
        errors += resume_errors(job.resume)
    if job.model is not None and not os.path.isfile(os.path.join(job.model, "config.json")):
        errors.append(f"--model {job.model}: not a local Hugging Face model directory (no config.json)")
    if errors:
        raise ValueError("bad configuration:\n  - " + "\n  - ".join(errors))


OUTPUT_ROOT_ENV = "RAYRL_OUTPUT_ROOT"  # where relative output paths of a submitted job go
DEFAULT_OUTPUT_ROOT = "~/rayrl"


def inside_submitted_job(environ=os.environ, cwd: Optional[str] = None) -> bool:
    """Whether this driver runs from ``ray job submit``: its working directory is then Ray's
    temporary copy of the job's ``--working-dir``, which vanishes with the Ray session."""
    here = cwd if cwd is not None else os.getcwd()
    return bool(environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")) or f"{os.sep}working_dir_files{os.sep}" in here + os.sep


def resolve_output_dir(path: str, environ=os.environ, cwd: Optional[str] = None) -> str:
    """The absolute directory a job writes to. An absolute ``path`` is used as given. A relative
    one is relative to the current directory - except inside a submitted job, where that is
    Ray's temporary copy of the checkout: there it goes under ``$RAYRL_OUTPUT_ROOT`` (a shared
    volume on a multi-node cluster), else under ``~/rayrl`` on the node that runs the driver.
    ``~`` is expanded; the root must be absolute, and a relative path may not leave it."""
    path = os.path.expanduser(path)
    if os.path.isabs(path):
        return os.path.normpath(path)
    if not inside_submitted_job(environ, cwd):
        return os.path.normpath(os.path.join(cwd if cwd is not None else os.getcwd(), path))
    root = os.path.expanduser(environ.get(OUTPUT_ROOT_ENV) or DEFAULT_OUTPUT_ROOT)
    if not os.path.isabs(root):
        raise ValueError(f"${OUTPUT_ROOT_ENV}={root!r} must be an absolute path: relative to a submitted job's "
                         "working directory it would land in Ray's temporary copy of the checkout")
    resolved = os.path.normpath(os.path.join(root, path))
    if os.path.relpath(resolved, os.path.normpath(root)).startswith(os.pardir):
        raise ValueError(f"output path {path!r} leaves ${OUTPUT_ROOT_ENV} ({root}); give an absolute path instead")
    return resolved


def resume_errors(path: str) -> list:
    """Why ``path`` is not a cluster checkpoint (as ``--checkpoint-every`` writes), if it is not."""
    if not os.path.isfile(os.path.join(path, "train_state.json")):
        return [f"--resume {path}: not a checkpoint directory (no train_state.json)"]
    if not os.path.isdir(os.path.join(path, "deepspeed")):
        kind = ("a single-process checkpoint (primitives.checkpoint.save_checkpoint: optimizer.pt, rng.pt)"
                if os.path.isfile(os.path.join(path, "rng.pt")) else "not a cluster checkpoint")
        return [f"--resume {path}: {kind}; the Ray job resumes from a cluster checkpoint written by "
                "--checkpoint-every (deepspeed/, train_state.json)"]
    return []
