"""What ``cluster.loop.train.train`` checks before its first step (and before each new algorithm a
schedule turns to): the algorithm against the backend, the hooks' arguments, the prompt source's
shape, what must pickle for a remote backend, and the run's temperature and staleness bound.
Each problem is a named error before any work."""
from __future__ import annotations

from typing import Callable, Optional

from cluster.loop.protocol import Backend
from primitives.hooks import check_arity, fn_name
from primitives.maths.algorithms import check_schedule, needs_values, uses_reference
from primitives.types import TrainState


def check_algorithm_for(backend: Backend, algo, group_size: int) -> None:
    """``algo`` fits this backend and run: its functions take their arguments and give the documented
    results on a sample, ``group_size`` completions per prompt are enough for it, it has the critic and
    reference it needs, and on a remote backend every function it carries (filters included) can be
    pickled. Named errors, before a step of ``algo`` (the first one's before any generation)."""
    from primitives.maths.algorithms import (
        check_algorithm_functions,
        check_algorithm_picklable,
        group_size_error,
        validate_algorithm,
    )

    check_algorithm_functions(validate_algorithm(algo))
    too_few = group_size_error(algo, group_size)
    if too_few:
        raise ValueError(too_few)
    if needs_values(algo) and not backend.has_critic:
        raise ValueError(f"algorithm '{algo.name}': its advantage function reads critic values (GAE), but the "
                         f"{backend.name} backend has no critic")
    if uses_reference(algo) and not backend.has_reference:
        raise ValueError(f"algorithm '{algo.name}' needs reference logprobs (kl_coef={algo.kl_coef}, or a loss "
                         f"that reads them), but the {backend.name} backend has no reference model")
    if backend.remote:
        check_algorithm_picklable(algo)


def seen_before(algo, checked: set) -> bool:
    """Whether ``algo`` was checked before (and remember it); a record holding something
    unhashable is checked every time."""
    try:
        if algo in checked:
            return True
        checked.add(algo)
    except TypeError:
        pass
    return False


def check_loader_shape(prompt_source: Callable) -> None:
    """A one-argument ``prompt_loader(iteration)`` (the seeds' shape) given as the prompt source
    is refused with the adapter that makes it one."""
    import inspect

    try:
        sig = inspect.signature(prompt_source)
        sig.bind(0)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None, 1)
    except TypeError:
        raise ValueError(f"prompt_source: {fn_name(prompt_source)}{sig} takes one argument, the seeds' "
                         f"prompt_loader(iteration) -> prompts; train calls prompt_source(position, n) -> (items, "
                         f"position): wrap it as primitives.io.data.prompt_source_from_loader(loader) "
                         f"(rl_primitives.train(prompt_loader=...) does this itself)") from None


def check_train_hooks(backend: Backend, prompt_source: Callable, algorithm_schedule: Callable, logger: Callable,
                      eval_fn: Optional[Callable], checkpoint_fn: Optional[Callable], tools, group_size: int):
    """Every hook of ``train`` takes its documented arguments, and on a remote backend the ones that travel
    to actors can be pickled: named errors before the first step. Returns the schedule's
    first algorithm, checked (one a schedule turns to later is checked when it appears)."""
    from primitives.hooks import check_picklable

    first = check_schedule(algorithm_schedule)
    check_algorithm_for(backend, first, group_size)
    check_loader_shape(prompt_source)
    check_arity(prompt_source, "prompt_source", None, 1)
    check_arity(logger, "logger", {})
    if eval_fn is not None:
        check_arity(eval_fn, "eval_fn", backend, TrainState())
    if checkpoint_fn is not None:
        check_arity(checkpoint_fn, "checkpoint_fn", backend, TrainState())
    if tools is not None:
        check_arity(tools.executor, "tools.executor", None)
        for fn, what, args in ((tools.parser, "tools.parser", ("",)), (tools.stop_condition, "tools.stop_condition",
                                                                       (None,))):
            if fn is not None:
                check_arity(fn, what, *args)
        if backend.remote:
            check_picklable(tools, "tools (parser, executor, stop condition)")
    return first


def run_errors(temperature: float, max_staleness: int, names: tuple = ("temperature", "max_staleness")) -> list:
    """The problems of a run's sampling temperature and staleness bound, named by ``names``: the
    one check of these values, for ``train`` and for a job's config (``generation.temperature``,
    ``algorithm.max_staleness``)."""
    t, s = names
    checks = [(temperature > 0, f"{t} must be > 0 (RL samples at temperature > 0: logprobs are of softmax(logits / "
                                f"T), and T = 0, greedy, samples nothing to learn from), got {temperature}"),
              (max_staleness >= 0, f"{s} must be >= 0 (0: synchronous), got {max_staleness}")]
    return [message for ok, message in checks if not ok]


def check_train_run(backend: Backend, prompt_source: Callable, algorithm_schedule: Callable, run, hooks,
                    tools) -> set:
    """Everything ``train`` checks before its first step: the run's settings (``RLRun``), every hook
    (``Hooks``), the schedule's first algorithm against the backend, and a generator policy against a
    backend that can scale. Returns the set of algorithms checked so far (the first)."""
    from primitives.types import RolloutBatch

    problems = run_errors(run.gen.temperature, run.max_staleness)
    if hooks.checkpoint_minutes < 0:
        problems.append(f"hooks.checkpoint_minutes must be >= 0, got {hooks.checkpoint_minutes}")
    if problems:
        raise ValueError("; ".join(problems))
    checked: set = set()  # algorithms already checked against this backend (records are hashable)
    seen_before(check_train_hooks(backend, prompt_source, algorithm_schedule, hooks.logger, hooks.eval_fn,
                                  hooks.checkpoint_fn, tools, run.gen.n), checked)
    if hooks.iteration_hook is not None:
        check_arity(hooks.iteration_hook, "iteration_hook", TrainState(), RolloutBatch(()))
    if hooks.ledger is not None:
        check_arity(hooks.ledger, "ledger", 0, [])
    if run.generator_policy is not None:
        check_arity(run.generator_policy, "generator_policy", (), 1)
        if not backend.can_scale_generators:
            raise ValueError(f"generator_policy: the {backend.name} backend has no generator workers to scale "
                             f"(one process, or generation on the trainer ranks)")
    return checked
