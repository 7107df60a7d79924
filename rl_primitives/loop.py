"""The seeds' training loop (``train(initial_state=..., prompt_loader=..., ...)``,
``quick_start_training``, ``training_step``, ``training_iteration``) over ours: the one RL
loop ``cluster.loop.train.train`` on a ``cluster.local.LocalBackend`` (one process, plain
torch). For a Ray cluster, ``rayrl rl job.yaml`` or ``train(RayBackend(...), ...)``.
"""
from __future__ import annotations

import inspect
import json
import os
from collections import Counter
from typing import Any, Callable, Literal, NamedTuple, Optional, Sequence

from cluster.local import LocalBackend, loaded_tokenizer
from cluster.loop.train import Hooks, RLRun
from cluster.loop.train import train as loop_train
from primitives.hooks import call_hook, fn_name
from primitives.io.checkpoint import load_checkpoint as _load_checkpoint
from primitives.io.checkpoint import save_checkpoint as _save_checkpoint
from primitives.io.data import make_prompt_source, prompt_source_from_loader
from primitives.maths.algorithms import AlgorithmConfig, constant_schedule, group_size_error, uses_reference
from primitives.maths.batching import make_batch, rollout_metrics
from primitives.maths.metrics import mean_over_updates
from primitives.model.training import train_on_batch
from primitives.types import GenerationConfig, RolloutBatch, TrainState
from rl_actors.trainer import TrainerConfig
from rl_primitives.api import as_algorithm, check_ref_update_fn, check_unique_uids, create_batch_rollouts


class TrainingStats(NamedTuple):
    """The seeds' step statistics, read from our step metrics (``custom_metrics`` holds them all)."""

    loss: float  # metrics["loss/total"]
    grad_norm: float  # metrics["grad_norm"] (before clipping)
    learning_rate: float  # metrics["lr"]
    kl_divergence: float  # metrics["kl/ref_k3"]: k3 KL to the reference on the trained tokens (0 without one)
    rewards_mean: float  # metrics["reward/mean"]
    rewards_std: float  # metrics["reward/std"]
    custom_metrics: Optional[dict] = None  # every metric of the step


def stats_from_metrics(metrics: dict) -> TrainingStats:
    """``TrainingStats`` of one step's flat metrics (NaN where the step logged none: a skipped update)."""
    def get(key: str, default: float = float("nan")) -> float:
        return float(metrics.get(key, default))

    return TrainingStats(get("loss/total"), get("grad_norm"), get("lr"), get("kl/ref_k3", 0.0), get("reward/mean"),
                         get("reward/std"), dict(metrics))


class TrainingState(NamedTuple):
    """The seeds' training state. ``model`` is a loaded causal LM (trained in place), a local
    model directory or a ``ModelConfig``; ``optimizer`` one over its parameters (None: AdamW
    at 1e-5); ``scheduler`` a torch LR scheduler stepped after every iteration; ``ref_model``
    the reference (None: a frozen copy of the starting policy when the algorithm's KL or a
    reference update needs one). Ours is ``primitives.types.TrainState`` (``loop_state``):
    iteration, data position, policy version and metrics, everything a resume needs."""

    iteration: int = 0
    global_step: int = 0
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    ref_model: Any = None
    stats_history: tuple = ()  # TrainingStats, one per iteration
    metadata: Optional[dict] = None
    tokenizer: Any = None  # None: loaded from the model's directory
    loop_state: Optional[TrainState] = None  # our loop's state; train(initial_state=...) resumes from it
    # the reference update function's state (primitives.maths.kl.RefState: its last reset, its float32 weights);
    # train(initial_state=...) goes on from it
    ref_update_state: Any = None


def _arity(fn: Callable, *candidates: int) -> Optional[int]:
    """The first count in ``candidates`` of positional arguments ``fn`` accepts (None: none)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return candidates[0]
    for k in candidates:
        try:
            sig.bind(*([None] * k))
            return k
        except TypeError:
            continue
    return None


def as_schedule(algorithm_config) -> Callable:
    """``algorithm_schedule(iteration, last_metrics)`` of an algorithm config (constant), of a
    schedule, or of the seeds' ``get_config(iteration)`` (a function of the iteration alone).
    A ``get_config()`` of no arguments keeps its state hidden in an object: refused."""
    if isinstance(algorithm_config, (AlgorithmConfig, dict)):
        return constant_schedule(as_algorithm(algorithm_config))
    if not callable(algorithm_config):
        raise ValueError(f"algorithm_config: {type(algorithm_config).__name__} is neither an algorithm config nor "
                         f"a schedule")
    k = _arity(algorithm_config, 2, 1)
    if k == 2:
        return lambda iteration, last_metrics: as_algorithm(algorithm_config(iteration, last_metrics))
    if k == 1:
        return lambda iteration, last_metrics: as_algorithm(algorithm_config(iteration))
    raise ValueError(f"algorithm_config {fn_name(algorithm_config)}{inspect.signature(algorithm_config)}: a schedule "
                     f"is a function of the iteration - get_config(iteration) - or "
                     f"algorithm_schedule(iteration, last_metrics) -> AlgorithmConfig, so switches are reproducible "
                     f"and resume exactly; state kept in the object between calls (reward_history, a counter) is "
                     f"hidden (seeds README error 9): read the previous step's metrics from last_metrics")


def as_prompt_source(prompt_loader) -> Callable:
    """Our ``prompt_source(position, n)`` of a list of prompts, of the seeds'
    ``prompt_loader(iteration)`` or of a prompt source."""
    if isinstance(prompt_loader, (list, tuple)):
        return make_prompt_source(prompt_loader, shuffle=False)
    k = _arity(prompt_loader, 2, 1)
    if k == 2:
        return prompt_loader
    if k == 1:
        return prompt_source_from_loader(prompt_loader)
    raise ValueError(f"prompt_loader {fn_name(prompt_loader)}: expected prompt_loader(iteration) -> prompts or "
                     f"prompt_source(position, n) -> (items, position)")


def facade_state(backend: LocalBackend, loop_state: TrainState, initial: TrainingState, start: int) -> TrainingState:
    """The seeds' ``TrainingState`` of our loop's state and the backend's models."""
    stats = tuple(stats_from_metrics(m) for m in loop_state.metrics_history[start:])
    return initial._replace(iteration=loop_state.iteration, global_step=loop_state.global_step, model=backend.policy,
                            optimizer=backend.optimizer, ref_model=backend.reference,
                            stats_history=tuple(initial.stats_history) + stats, tokenizer=backend.tokenizer,
                            loop_state=loop_state, ref_update_state=backend.ref_state)


def train(initial_state: TrainingState, prompt_loader, num_iterations: int, gen_config: GenerationConfig,
          algorithm_config, reward_fn: Callable, ref_model_update_fn: Optional[Callable] = None,
          checkpoint_fn: Optional[Callable] = None, eval_fn: Optional[Callable] = None, eval_every: int = 10,
          logger: Optional[Callable] = None, iteration_hook: Optional[Callable] = None, *,
          aggregate_fn: Optional[Callable] = None, shaping_fn: Optional[Callable] = None, tools=None,
          prompts_per_step: Optional[int] = None, trainer: TrainerConfig = TrainerConfig(), seed: int = 0,
          progress: bool = False) -> TrainingState:
    """The seeds' ``train(...)``: ``cluster.loop.train.train`` (preferred: the same loop runs on
    Ray) over a ``LocalBackend`` built from ``initial_state``.

    * ``prompt_loader(iteration) -> prompts`` (``prompt_source_from_loader``; called once more
      before the first step to size it), a list of prompts, or our ``prompt_source(position, n)``
      (then ``prompts_per_step``).
    * ``algorithm_config``: ``create_algorithm_config(...)`` or a preset; a schedule
      ``get_config(iteration)`` or ``(iteration, last_metrics)``.
    * ``reward_fn(rollout)`` reads the seeds' views (``rollout.generation.text``); a vector
      reward with ``aggregate_fn``.
    * ``ref_model_update_fn(ref_state, policy_weights, step, kl)`` (``create_ref_update_fn``).
    * ``logger(state, stats)`` (the seeds', e.g. ``log_to_console``) or ``logger(metrics)``;
      ``iteration_hook(state, batch)`` after every step, with the state after it and the
      step's trained rollouts (``RolloutBatch``; the seeds call it before the update);
      ``eval_fn(state) -> dict`` and ``checkpoint_fn(state)`` every ``eval_every`` steps after
      the update (evaluation also at the last; ours take ``(backend, state)``).

    Returns the final ``TrainingState``: the trained model, ``stats_history`` and our
    ``loop_state`` (pass the state back to go on)."""
    if not isinstance(initial_state, TrainingState):
        raise ValueError(f"initial_state: {type(initial_state).__name__}; expected rl_primitives.TrainingState("
                         f"model=..., optimizer=..., ref_model=...)")
    if initial_state.model is None:
        raise ValueError("initial_state.model is None: give a loaded causal LM or a local model directory")
    schedule = as_schedule(algorithm_config)
    # the reference is made when any step may read it: the schedule over the run's iterations (with no metrics)
    reads_reference = any(uses_reference(schedule(i, {})) for i in range(max(int(num_iterations), 1)))
    ref_update = check_ref_update_fn(ref_model_update_fn) if ref_model_update_fn is not None else None
    if isinstance(initial_state.model, str) and initial_state.optimizer is not None:
        raise ValueError("initial_state.optimizer is over a model's parameters, but initial_state.model is a path: "
                         "give the loaded model, or no optimizer")
    check_seed_hooks(checkpoint_fn, logger)
    tools = _seed_tools(tools)
    backend = LocalBackend(initial_state.model, reward_fn, aggregate_fn, shaping_fn,
                           with_reference=reads_reference or ref_update is not None, ref_update_fn=ref_update,
                           trainer=trainer, seed=seed, tokenizer=initial_state.tokenizer,
                           optimizer=initial_state.optimizer, reference_model=initial_state.ref_model,
                           reference_state=initial_state.ref_update_state if ref_update is not None else None)
    source = as_prompt_source(prompt_loader)
    loop_state = initial_state.loop_state or TrainState(iteration=initial_state.iteration,
                                                        global_step=initial_state.global_step, rng_seed=seed)
    # a state passed back holds the trained model and optimizer: the new backend serves that policy version
    # (its rollouts are stamped with it, and its sampler draws that version's stream), as a restore would
    backend.policy_version = loop_state.policy_version
    if prompts_per_step is None:
        if source is prompt_loader or isinstance(prompt_loader, (list, tuple)):
            raise ValueError("train: a list of prompts or a prompt_source(position, n) needs prompts_per_step= "
                             "(a prompt_loader(iteration) says how many itself)")
        prompts_per_step = len(source(loop_state.data_position, 1)[0])
    start = len(loop_state.metrics_history)
    seed_logger = logger if logger is not None and _arity(logger, 1, 2) != 1 else None
    scheduler = initial_state.scheduler

    def after_step(state: TrainState, batch: RolloutBatch) -> None:
        if scheduler is not None:
            scheduler.step()
        seen = facade_state(backend, state, initial_state, start)
        if seed_logger is not None:
            call_hook(seed_logger, "logger", seen, seen.stats_history[-1])
        if iteration_hook is not None:
            call_hook(iteration_hook, "iteration_hook", seen, batch)

    def seed_call(fn: Optional[Callable], what: str) -> Optional[Callable]:
        """``fn(state)`` (the seeds') as ``fn(backend, state)``; ours pass through."""
        if fn is None or _arity(fn, 2, 1) == 2:
            return fn
        return lambda b, state: call_hook(fn, what, facade_state(b, state, initial_state, start))

    run = RLRun(gen_config, num_steps=loop_state.iteration + num_iterations, prompts_per_step=prompts_per_step,
                lr_schedule=(lambda it: None) if initial_state.optimizer is not None else (lambda it: trainer.lr),
                progress=progress)
    eval_wrapped = seed_call(eval_fn, "eval_fn")
    hooks = Hooks(logger=logger if logger is not None and seed_logger is None else (lambda metrics: None),
                  eval_fn=(lambda b, s: dict(eval_wrapped(b, s) or {})) if eval_wrapped is not None else None,
                  eval_every=eval_every if eval_fn is not None else 0,
                  checkpoint_fn=seed_call(checkpoint_fn, "checkpoint_fn"),
                  checkpoint_every=eval_every if checkpoint_fn is not None else 0,
                  iteration_hook=after_step)
    final = loop_train(backend, source, schedule, run, loop_state, hooks, tools)
    return facade_state(backend, final, initial_state, start)


def check_seed_hooks(checkpoint_fn: Optional[Callable], logger: Optional[Callable]) -> None:
    """Refuse, before any step, the seeds' hooks that cannot be called as ``train`` calls them: their
    ``save_checkpoint`` (it needs a directory) and a logger of neither ``logger(metrics)`` nor
    ``logger(state, stats)`` (the seeds' ``log_to_wandb`` needs its project)."""
    if checkpoint_fn is save_checkpoint:
        raise ValueError('train(checkpoint_fn=save_checkpoint): save_checkpoint(state, checkpoint_dir) needs a '
                         'directory; give checkpoint_fn=lambda state: save_checkpoint(state, '
                         'f"checkpoints/iter_{state.iteration}")')
    if logger is not None and _arity(logger, 1, 2) is None:
        hint = ' (functools.partial(log_to_wandb, project="my-project"))' if logger is log_to_wandb else ""
        raise ValueError(f"train(logger={fn_name(logger)}{inspect.signature(logger)}): a logger is logger(metrics) "
                         f"or the seeds' logger(state, stats); bind its other arguments first{hint}")


def _seed_tools(tools):
    """A ``ToolConfig`` whose parser and executor may speak the seeds' dicts."""
    if tools is None:
        return None
    from primitives.env.tools import parse_xml_tool_calls
    from rl_primitives.api import seed_tool_executor, seed_tool_parser

    return tools._replace(parser=seed_tool_parser(tools.parser or parse_xml_tool_calls),
                          executor=seed_tool_executor(tools.executor))


def quick_start_training(model_name: str, prompts: Sequence, reward_fn: Callable, num_iterations: int = 100, *,
                         gen_config: Optional[GenerationConfig] = None, algorithm_config=None,
                         prompts_per_step: int = 8, learning_rate: float = 1e-5, logger: Optional[Callable] = None,
                         seed: int = 0) -> TrainingState:
    """The seeds' one call: GRPO on ``prompts`` (each its own index, served in order, epoch
    after epoch) from the local model directory ``model_name``, in this process
    (``LocalBackend``). Defaults: 4 completions per prompt at temperature 1.0, 64 new tokens,
    ``prompts_per_step`` prompts a step, AdamW at ``learning_rate``, no KL (no reference).
    A cluster run is ``rayrl rl job.yaml``."""
    from primitives.maths.algorithms import grpo

    if not os.path.isdir(str(model_name)):
        raise ValueError(f"quick_start_training: model_name {model_name!r} is not a local model directory (nothing "
                         f"is downloaded here: save the model with save_pretrained, or see primitives.fixtures)")
    gen_config = gen_config or GenerationConfig(max_new_tokens=64, temperature=1.0, n=4)
    return train(TrainingState(model=model_name), make_prompt_source(prompts, shuffle=False), num_iterations,
                 gen_config, algorithm_config if algorithm_config is not None else grpo(kl_coef=0.0), reward_fn,
                 logger=logger, prompts_per_step=min(prompts_per_step, len(prompts)),
                 trainer=TrainerConfig(lr=learning_rate), seed=seed)


def training_step(state: TrainingState, batch: RolloutBatch, algorithm_config,
                  optimizer_step_fn: Optional[Callable] = None, max_grad_norm: float = 1.0) -> tuple:
    """The seeds' ``training_step(state, batch, algorithm_config) -> (state, stats)``: one
    update of ``state.model`` by ``state.optimizer`` on the batch's rollouts
    (``make_batch`` + ``primitives.model.training.train_on_batch``, which recomputes logprobs
    with autograd at the batch's sampling temperature); ``state.scheduler`` steps after it.
    The batch comes from ``create_batch_rollouts`` (it records the temperature)."""
    if optimizer_step_fn is not None:
        raise ValueError("training_step(optimizer_step_fn=...): the optimizer step is train_on_batch's "
                         "(clip to max_grad_norm, step, zero); pass max_grad_norm=, or a scheduler in the state")
    if state.optimizer is None or state.model is None:
        raise ValueError("training_step needs state.model and state.optimizer (e.g. torch.optim.AdamW("
                         "model.parameters(), lr=1e-5))")
    meta = batch.batch_metadata or {}
    if "temperature" not in meta:
        raise ValueError("training_step: the batch does not record the temperature it was sampled at (the trainer's "
                         "logprobs must be of the same softmax(logits / T)); make it with create_batch_rollouts, or "
                         "set batch_metadata={'temperature': T, 'max_new_tokens': N}")
    check_unique_uids(batch.rollouts)
    algo = as_algorithm(algorithm_config)
    sizes = Counter(r.group for r in batch.rollouts)
    too_few = group_size_error(algo, min(sizes.values())) if sizes else None
    if too_few:
        raise ValueError(f"training_step: {too_few}")
    tokenizer = state.tokenizer if state.tokenizer is not None else loaded_tokenizer(state.model)
    trainer_batch = make_batch(list(batch.rollouts), algo, tokenizer.pad_token_id,
                               budget=int(meta.get("max_new_tokens", 0)))
    updates = train_on_batch(state.model, state.optimizer, trainer_batch, algo, float(meta["temperature"]),
                             max_grad_norm, None, None)
    if state.scheduler is not None:
        state.scheduler.step()
    stats = stats_from_metrics({**mean_over_updates(updates), **rollout_metrics(trainer_batch),
                                "algorithm": algo.name})
    return state._replace(global_step=state.global_step + 1, tokenizer=tokenizer,
                          stats_history=tuple(state.stats_history) + (stats,)), stats


def training_iteration(state: TrainingState, prompts: Sequence, model, tokenizer, gen_config: GenerationConfig,
                       algorithm_config, reward_fn: Callable, ref_model_update_fn: Optional[Callable] = None,
                       iteration_hook: Optional[Callable] = None) -> tuple:
    """The seeds' ``training_iteration -> (state, batch, stats)``: ``create_batch_rollouts``
    (the prompts of iteration k as epoch k, so uids never repeat), ``iteration_hook(state,
    batch)``, ``training_step``, and the iteration counted. A reference update belongs to the
    loop (``train(..., ref_model_update_fn=create_ref_update_fn(...))``): refused here."""
    if ref_model_update_fn is not None:
        raise ValueError("training_iteration(ref_model_update_fn=...): the reference moves at the loop's weight "
                         "sync with an explicit step; use train(..., ref_model_update_fn=create_ref_update_fn('ema', "
                         "decay=0.995))")
    too_few = group_size_error(as_algorithm(algorithm_config), gen_config.n)
    if too_few:  # before generating
        raise ValueError(f"training_iteration: {too_few}")
    batch = create_batch_rollouts(model, tokenizer, prompts, gen_config, ref_model=state.ref_model,
                                  reward_fn=reward_fn, epoch=state.iteration)
    if iteration_hook is not None:
        iteration_hook(state, batch)
    state, stats = training_step(state._replace(model=model, tokenizer=tokenizer), batch, algorithm_config)
    return state._replace(iteration=state.iteration + 1), batch, stats


def log_to_console(state: TrainingState, stats: TrainingStats, log_fn: Optional[Callable[[str], None]] = None) -> None:
    """The seeds' console logger, ``logger(state, stats)``; ours is
    ``primitives.io.loggers.console_logger()`` (``logger(metrics)``)."""
    msg = (f"[Iter {state.iteration}] Loss: {stats.loss:.4f}, Reward: {stats.rewards_mean:.4f}, "
           f"KL: {stats.kl_divergence:.4f}")
    (log_fn or print)(msg)


REFERENCE_FILE, REFERENCE_UPDATE_FILE = "reference.pt", "reference_update.pt"  # in a seeds' checkpoint


def save_checkpoint(state_or_path, checkpoint_dir=None, *args, **kwargs) -> str:
    """The seeds' ``save_checkpoint(state, checkpoint_dir)``: the state's model, tokenizer,
    optimizer, scheduler, loop state, reference model (``REFERENCE_FILE``: its weights) and the
    reference update's state (``REFERENCE_UPDATE_FILE``) (``primitives.io.checkpoint.save_checkpoint``,
    one atomic directory; ``load_checkpoint`` reads it back). Called our way - ``save_checkpoint(path,
    model, ...)`` - it is ours."""
    if isinstance(state_or_path, TrainingState):
        if args or kwargs.get("saver") is not None:
            raise ValueError("save_checkpoint(state, dir, saver=...): a custom saver is a checkpoint_fn(state) of "
                             "your own")
        if checkpoint_dir is None:
            raise ValueError("save_checkpoint(state): give the directory, save_checkpoint(state, checkpoint_dir)")
        state = state_or_path
        tokenizer = state.tokenizer if state.tokenizer is not None else loaded_tokenizer(state.model)
        extra = {}
        if state.scheduler is not None:
            extra["scheduler"] = state.scheduler.state_dict()
            try:
                json.dumps(extra)
            except TypeError as e:
                raise ValueError(f"save_checkpoint: the scheduler's state_dict() cannot be written as JSON ({e}); "
                                 f"save it yourself in a checkpoint_fn(state)") from None
        return _save_checkpoint(str(checkpoint_dir), state.model, tokenizer, state.optimizer, state.loop_state,
                                extra=extra, also=lambda tmp: _save_reference(state, tmp))
    return _save_checkpoint(state_or_path, checkpoint_dir, *args, **kwargs)


def _save_reference(state: TrainingState, directory: str) -> None:
    """The state's reference (a model apart from the policy) and its update's state, into ``directory``."""
    import torch

    if isinstance(state.ref_model, torch.nn.Module) and state.ref_model is not state.model:
        torch.save(state.ref_model.state_dict(), os.path.join(directory, REFERENCE_FILE))
    if state.ref_update_state is not None:
        torch.save({"weights": dict(state.ref_update_state.weights),
                    "last_reset_step": int(state.ref_update_state.last_reset_step)},
                   os.path.join(directory, REFERENCE_UPDATE_FILE))


def _load_reference(path: str, model) -> tuple:
    """``(reference model or None, RefState or None)`` that ``_save_reference`` wrote to ``path``: the
    reference a copy of ``model`` with the saved weights."""
    import copy

    import torch

    from primitives.maths.kl import RefState

    reference, update = None, None
    if os.path.isfile(os.path.join(path, REFERENCE_FILE)):
        reference = copy.deepcopy(model)
        reference.load_state_dict(torch.load(os.path.join(path, REFERENCE_FILE), weights_only=True))
    if os.path.isfile(os.path.join(path, REFERENCE_UPDATE_FILE)):
        saved = torch.load(os.path.join(path, REFERENCE_UPDATE_FILE), weights_only=True)
        update = RefState(saved["weights"], int(saved["last_reset_step"]))
    return reference, update


def load_checkpoint(checkpoint_path: str, model, optimizer=None, scheduler=None, loader: Optional[Callable] = None):
    """The seeds' ``load_checkpoint(checkpoint_path, model, optimizer, scheduler) -> TrainingState``:
    what ``save_checkpoint(state, dir)`` wrote, loaded into ``model``, ``optimizer`` and
    ``scheduler`` in place, with the reference (a copy of ``model`` holding the saved reference's
    weights) and its update's state; ``train(initial_state=<it>, ...)`` then goes on as if never stopped.
    Called our way - ``load_checkpoint(path, model, optimizer, restore_rng=...)`` - it is ours
    (``primitives.io.checkpoint.load_checkpoint``: ``(TrainState, extra)``)."""
    if loader is not None:
        raise ValueError("load_checkpoint(..., loader=...): a custom loader is code of your own that builds the "
                         "TrainingState; this one reads what save_checkpoint(state, dir) writes")
    if isinstance(scheduler, bool):  # ours: load_checkpoint(path, model, optimizer, restore_rng)
        return _load_checkpoint(checkpoint_path, model, optimizer, scheduler)
    loop_state, extra = _load_checkpoint(checkpoint_path, model, optimizer)
    if loop_state is None:
        raise ValueError(f"{checkpoint_path}: no loop state in this checkpoint (it was not written by "
                         f"save_checkpoint(state, dir) of a trained state)")
    if scheduler is not None:
        if "scheduler" not in extra:
            raise ValueError(f"{checkpoint_path}: no scheduler state was saved (the state had none)")
        scheduler.load_state_dict(extra["scheduler"])
    stats = tuple(stats_from_metrics(m) for m in loop_state.metrics_history)
    reference, update = _load_reference(checkpoint_path, model)
    return TrainingState(iteration=loop_state.iteration, global_step=loop_state.global_step, model=model,
                         optimizer=optimizer, scheduler=scheduler, stats_history=stats, loop_state=loop_state,
                         ref_model=reference, ref_update_state=update)


def log_to_wandb(state: TrainingState, stats: TrainingStats, project: str, entity: Optional[str] = None) -> None:
    """The seeds' W&B logger ``log_to_wandb(state, stats, project, entity)``: every metric of the step
    and the seeds' names for the main ones, at step ``state.iteration``; one run per project and
    entity, offline unless ``WANDB_API_KEY`` is set (``wandb sync`` later). As a ``train`` logger give
    it its project: ``logger=functools.partial(log_to_wandb, project="my-project")``. Ours is
    ``primitives.io.loggers.wandb_logger(project)`` (``logger(metrics)``)."""
    import wandb

    key = (project, entity)
    run = _WANDB_RUNS.get(key)
    if run is None:
        mode: Literal["online", "offline"] = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        # WANDB_DIR read here, not only at wandb's first setup in the process (it keeps the first one's)
        run = _WANDB_RUNS[key] = wandb.init(project=project, entity=entity, mode=mode, reinit="create_new",
                                            dir=os.environ.get("WANDB_DIR"))
    run.log({**(stats.custom_metrics or {}), "iteration": state.iteration, "loss": stats.loss,
             "grad_norm": stats.grad_norm, "learning_rate": stats.learning_rate,
             "kl_divergence": stats.kl_divergence, "rewards_mean": stats.rewards_mean,
             "rewards_std": stats.rewards_std}, step=state.iteration)


_WANDB_RUNS: dict = {}  # log_to_wandb's run of each (project, entity) in this process
