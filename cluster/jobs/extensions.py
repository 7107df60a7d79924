"""The job file's extension points beyond rewards and algorithm functions, built and checked
before Ray starts: the algorithm schedule (``schedule``), the reference update
(``reference``), tools (``tools``) and reward shaping (``shaping``).

Each names a built-in with its arguments, or the user's ``module:function`` (also
``path/file.py:function``) with keyword arguments bound to it. A wrong name, a wrong argument
or a function that cannot take the hook's arguments is a ``ConfigErrors`` naming the field.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

from cluster.jobs.checks import ConfigErrors, algorithm_of
from primitives.hooks import (
    bind_keywords,
    check_arity,
    check_kwargs,
    check_picklable,
    did_you_mean,
    load_function,
)


def named_function(field: str, name: str, kwargs: Optional[dict], builtins: dict, hook: str, args: tuple,
                   factories: bool = True) -> Optional[Callable]:
    """The function a config field names: a built-in (``builtins[name]``: a factory called with
    ``kwargs`` when ``factories``, else a function with ``kwargs`` bound), or ``module:function``
    with ``kwargs`` bound. It must take ``args`` (the hook ``hook``'s arguments) and pickle
    (it travels to the actors by value). A factory may make None (nothing to run). A bound
    function keeps its attributes (``needs_reference`` of a shaping function)."""
    kwargs = dict(kwargs or {})
    try:
        if ":" in name or not factories:
            if ":" in name:
                fn = load_function(name)
            elif name in builtins:
                fn = builtins[name]
            else:
                raise ValueError(unknown_name(name, builtins))
            fn = bind_keywords(f"{field} {name!r}", fn, kwargs, len(args))
        elif name in builtins:
            check_kwargs(f"{field} {name!r}", builtins[name], kwargs)
            fn = builtins[name](**kwargs)
        else:
            raise ValueError(unknown_name(name, builtins))
        if fn is not None:
            check_arity(fn, f"{field}: {hook}", *args)
            check_picklable(fn, field)
    except (ValueError, TypeError) as e:  # TypeError: a factory given an argument of the wrong type
        message = str(e)
        raise ConfigErrors([message if message.startswith(field) else f"{field}: {message}"]) from None
    return fn


def required_function(field: str, name: str, kwargs: Optional[dict], builtins: dict, hook: str,
                      args: tuple, factories: bool = True) -> Callable:
    """``named_function`` where the field must name something to run: a built-in factory that makes
    None is refused, naming the field."""
    fn = named_function(field, name, kwargs, builtins, hook, args, factories)
    if fn is None:
        raise ConfigErrors([f"{field}: {name!r} with these arguments makes no {hook} (None); this field needs one"])
    return fn


def unknown_name(name: str, builtins: dict) -> str:
    return (f"unknown name {name!r}{did_you_mean(name, builtins) or ''} (built-in: {', '.join(builtins) or 'none'}; "
            "or your own as module:function)")


# ----------------------------------------------------------------------------- the algorithm schedule

def phase_algorithms(job) -> list:
    """The algorithm section's record, then each phase's (a phase shares the section's
    ppo_epochs, mini_batches, is_level and is_cap); each checked as the section is (its
    functions, its critic, its rows per trainer rank, vLLM's logprobs under its weight)."""
    from cluster.jobs.checks import record_errors
    from primitives.maths.algorithms import check_algorithm_functions, check_algorithm_picklable

    algos, errors = [algorithm_of(job.algorithm)], []
    for i, phase in enumerate(job.schedule.phases):
        where = f"schedule.phases.{i}"
        try:
            record = algorithm_of(job.algorithm._replace(name=phase.name, kl_coef=phase.kl_coef,
                                                         overrides=phase.overrides), where=where)
            check_algorithm_functions(record)
            check_algorithm_picklable(record)
        except ValueError as e:
            raise ConfigErrors([str(e) if str(e).startswith(where) else f"{where}: {e}"]) from None
        errors += record_errors(job, record, where)
        algos.append(record)
    if errors:
        raise ConfigErrors(errors)
    return algos


SCHEDULE_KINDS = ("constant", "piecewise", "metric")


def build_schedule(job) -> tuple:
    """``(schedule, algorithms)``: the ``(iteration, last_metrics) -> AlgorithmConfig`` of the
    ``schedule`` section and every algorithm it can return (the first is step 0's), from
    which the job decides whether it needs a reference or a critic."""
    from primitives.maths.algorithms import (
        check_schedule,
        constant_schedule,
        metric_switch_schedule,
        piecewise_schedule,
    )

    sc = job.schedule
    algos = phase_algorithms(job)
    if ":" in sc.kind:
        schedule = required_function("schedule.kind", sc.kind, sc.kwargs, {}, "algorithm_schedule", (0, {}))
        try:  # what it returns over the run's steps when no metric moves it: the algorithms to provide for
            check_schedule(schedule)
            seen: dict = {}
            for step in range(job.algorithm.steps):
                algo = schedule(step, {})
                seen.setdefault(algo.name, algo)
        except ValueError as e:
            raise ConfigErrors([f"schedule.kind {sc.kind}: {e}"]) from None
        return schedule, list(seen.values()) or algos[:1]
    errors = []
    if sc.kind not in SCHEDULE_KINDS:
        errors.append(f"schedule.kind '{sc.kind}' is unknown{did_you_mean(sc.kind, SCHEDULE_KINDS) or ''} "
                      f"(built-in: {', '.join(SCHEDULE_KINDS)}; or module:function)")
    elif sc.kind == "constant" and sc.phases:
        errors.append("schedule.phases are given but schedule.kind is constant: set kind: piecewise or metric")
    elif sc.kind == "piecewise":
        starts = [p.start for p in sc.phases]
        if not starts:
            errors.append("schedule.kind piecewise needs schedule.phases (each with its start step)")
        elif starts[0] < 1 or any(b <= a for a, b in zip(starts, starts[1:])):
            errors.append(f"schedule.phases start at steps {starts}: they must rise, from 1 on (the algorithm "
                          "section runs from step 0)")
    elif sc.kind == "metric":
        if len(sc.phases) != 1:
            errors.append(f"schedule.kind metric switches to one phase; got {len(sc.phases)} schedule.phases")
        elif algos[1].name == algos[0].name:
            errors.append(f"schedule.phases.0 is named '{algos[1].name}' like the algorithm section: the switch is "
                          "recognised by the logged name; use another preset or a module:function")
    if sc.kwargs and ":" not in sc.kind:
        errors.append(f"schedule.kwargs are for a module:function schedule, not kind {sc.kind}")
    if errors:
        raise ConfigErrors(errors)
    if sc.kind == "constant":
        return constant_schedule(algos[0]), algos[:1]
    if sc.kind == "piecewise":
        return piecewise_schedule([(0, algos[0])] + [(p.start, a) for p, a in zip(sc.phases, algos[1:])]), algos
    return metric_switch_schedule(algos[0], algos[1], sc.metric, sc.threshold), algos


# ----------------------------------------------------------------------------- reference, shaping, tools

def _fixed():
    return None


def reference_updates() -> dict:
    from primitives.maths.kl import create_ema_updater, create_kl_bound_updater, create_periodic_updater

    return {"fixed": _fixed, "ema": create_ema_updater, "periodic": create_periodic_updater,
            "kl_bound": create_kl_bound_updater}


def build_ref_update(job) -> Optional[Callable]:
    """``ref_update_fn(ref, policy_weights, step, kl) -> RefState`` of the ``reference`` section
    (None: a fixed reference)."""
    ref = job.reference
    return named_function("reference.update", ref.update, ref.kwargs, reference_updates(), "ref_update_fn",
                          (None, {}, 0, None))


def build_shaping(job) -> Optional[Callable]:
    """One ``shaping_fn(rollout, reward) -> reward`` applying the ``shaping`` entries in order."""
    from primitives.env.rewards import chain_shaping, dapo_overlong_shaping, kl_penalty_shaping, length_penalty

    builtins = {"length_penalty": length_penalty, "overlong": dapo_overlong_shaping, "kl_penalty": kl_penalty_shaping}
    made = [named_function(f"shaping.{i}", s.name, s.kwargs, builtins, "shaping_fn", (None, 0.0))
            for i, s in enumerate(job.shaping)]
    fns = [fn for fn in made if fn is not None]  # a factory that makes None (a zero coefficient) shapes nothing
    if not fns:
        return None
    return fns[0] if len(fns) == 1 else chain_shaping(*fns)


class BuiltTools(NamedTuple):
    config: object  # primitives.env.tools.ToolConfig
    names: tuple  # the names the model calls the tools by


def build_tools(job):
    """The ``ToolConfig`` of the ``tools`` section, or None without tools. The python tool is
    tried once here: a machine whose sandbox cannot run is named before Ray starts."""
    from primitives.env.tools import (
        SandboxUnavailable,
        ToolConfig,
        calculator_tool,
        create_tool_executor,
        no_tool_calls_stop,
        parse_json_tool_calls,
        parse_xml_tool_calls,
        python_tool,
        run_python_sandboxed,
    )

    cfg = job.tools
    if not cfg.use:
        return None
    tools, errors = {}, []
    for i, spec in enumerate(cfg.use):
        label = spec.label or spec.name.rpartition(":")[2]
        if label in tools:
            errors.append(f"tools.use.{i}: a second tool called '{label}'; give it another label")
            continue
        try:
            tools[label] = named_function(f"tools.use.{i}", spec.name, spec.kwargs,
                                          {"calculator": calculator_tool, "python": python_tool}, "tool", ({},),
                                          factories=False)
        except ConfigErrors as e:
            errors += e.errors
            continue
        if spec.name == "python":
            try:
                run_python_sandboxed("pass")
            except SandboxUnavailable as e:
                errors.append(f"tools.use.{i}: the python tool's sandbox cannot run here: {e}")
    parser = stop = None
    try:
        parser = required_function("tools.parser", cfg.parser, None, {"xml": parse_xml_tool_calls,
                                                                   "json": parse_json_tool_calls},
                                "tool_parser", ("",), factories=False)
    except ConfigErrors as e:
        errors += e.errors
    try:
        stop = required_function("tools.stop", cfg.stop, None, {"no_tool_calls": no_tool_calls_stop}, "stop_condition",
                              (None,), factories=False)
    except ConfigErrors as e:
        errors += e.errors
    if cfg.max_turns < 1:
        errors.append(f"tools.max_turns must be at least 1, got {cfg.max_turns}")
    if errors or parser is None or stop is None:
        raise ConfigErrors(errors)
    return BuiltTools(ToolConfig(create_tool_executor(tools), parser, stop, cfg.max_turns), tuple(tools))


# ----------------------------------------------------------------------------- generator scaling

def build_generator_policy(job) -> Optional[Callable]:
    """``policy(history, current) -> count`` of ``cluster.scaling`` (None: a fixed count)."""
    from primitives.maths.scaling import idle_scaling_policy, step_scaling_policy

    cfg = job.cluster
    sc = cfg.scaling
    if sc.policy == "fixed" or cfg.generate_on_trainers:
        return None
    if sc.policy == "idle":
        return idle_scaling_policy(sc.minimum, sc.maximum or cfg.generators, sc.every, sc.idle_threshold)
    if sc.policy == "steps":
        counts = {0: cfg.generators, **{int(k): int(v) for k, v in (sc.at_steps or {}).items()}}
        return step_scaling_policy(sorted(counts.items()))
    user = required_function("cluster.scaling.policy", sc.policy, None, {}, "generator_policy", ((), 1))
    return clamped_policy(user, sc.minimum, sc.maximum or cfg.generators)


def clamped_policy(policy: Callable, lowest: int, highest: int) -> Callable:
    """``policy`` whose counts stay within ``[lowest, highest]`` (a local Ray has room for ``highest``)."""
    def within(history, current: int) -> int:
        wanted = policy(history, current)
        return min(max(wanted, lowest), highest) if isinstance(wanted, int) and not isinstance(wanted, bool) \
            else wanted  # not a count: the loop names the error

    within.__qualname__ = f"{getattr(policy, '__qualname__', 'policy')} within [{lowest}, {highest}]"
    return within
