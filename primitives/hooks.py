"""Naming things the user gave: hooks as ``module:function``, and hints for a misspelt name.

One resolver of ``module:function`` for every extension point (STYLE point 5: resolved once,
where the job starts), and one "did you mean" for every error that names a wrong name.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import traceback
from typing import Callable, Iterable


def load_function(spec: str) -> Callable:
    """Resolve ``"package.module:function"`` (also ``path/to/file.py:function``) to the callable."""
    if ":" not in spec:
        raise ValueError(f"hook '{spec}' must look like module:function")
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise ImportError(f"no file {module_name}")
            mod_spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            if mod_spec is None or mod_spec.loader is None:
                raise ImportError(f"{module_name} cannot be loaded as a module")
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"hook '{spec}': cannot import '{module_name}' ({e})") from None
    except SyntaxError as e:  # the user's module does not parse: its file and line, not Python's traceback
        raise ValueError(f"hook '{spec}': {e.filename}:{e.lineno}: syntax error: {e.msg}"
                         + (f"\n    {e.text.strip()}" if e.text and e.text.strip() else "")) from None
    except Exception as e:  # the module raised while it ran: where, and what
        frame = traceback.extract_tb(e.__traceback__)[-1]
        raise ValueError(f"hook '{spec}': importing '{module_name}' raised {type(e).__name__}: {e} "
                         f"({frame.filename}:{frame.lineno})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"hook '{spec}': '{module_name}' has no callable '{attr}'")
    return fn


def did_you_mean(name, valid: Iterable, n: int = 1) -> str:
    """``"; did you mean 'a' or 'b'?"`` for the closest of ``valid`` to ``name`` (difflib), or ""."""
    close = difflib.get_close_matches(str(name), [str(v) for v in valid], n=n)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def fn_name(fn) -> str:
    """A readable name for a user function (``module.qualname``; partials name their function)."""
    inner = getattr(fn, "func", fn)  # functools.partial
    qual = getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None)
    if qual is None:
        return repr(fn)
    module = getattr(inner, "__module__", None)
    return f"{module}.{qual}" if module and module != "builtins" else qual


def with_traits(**traits) -> Callable:
    """Decorator marking what a hook needs, read by ``trait``: e.g. ``@with_traits(pairwise=True,
    needs_reference=True)`` on a loss over (chosen, rejected) rows, ``needs_values=True`` on an
    advantage function that reads critic values. Traits are plain attributes, so they travel
    with the function to the actors."""
    def mark(fn: Callable) -> Callable:
        for key, value in traits.items():
            setattr(fn, key, value)
        return fn

    return mark


def trait(fn, name: str, default=False):
    """The trait ``name`` of ``fn`` (see ``with_traits``), looking through ``functools.partial``."""
    if fn is None:
        return default
    if hasattr(fn, name):
        return getattr(fn, name)
    return getattr(getattr(fn, "func", None), name, default)


# the documented signature of each extension point (architecture section 5), as the code calls it;
# keyed by the name ``check_arity`` is given (after any "algorithm '...': " prefix)
HOOK_SIGNATURES = {
    "reward_fn": "reward_fn(rollout) -> float or a sequence of floats (one per component)",
    "aggregate_fn": "aggregate_fn(vector) -> float",
    "shaping_fn": "shaping_fn(rollout, reward) -> float",
    "ref_update_fn": "ref_update_fn(ref_state, policy_weights, step, kl) -> ref_state (kl: the step's kl/ref_k3, "
                     "or None; e.g. primitives.maths.kl.create_ema_updater(0.99))",
    "prompt_source": "prompt_source(position, n) -> (items, position)",
    "algorithm_schedule": "algorithm_schedule(iteration, last_metrics) -> AlgorithmConfig",
    "logger": "logger(metrics)",
    "eval_fn": "eval_fn(backend, state) -> dict",
    "checkpoint_fn": "checkpoint_fn(backend, state)",
    "advantage_fn": "advantage_fn(inputs, algo) -> (advantages (B, T), returns (B, T) or None)",
    "policy_loss_fn": "policy_loss_fn(logp, old_logp, advantages, mask, algo) -> (loss (B, T), clipped (B, T))",
    "loss_fn": "loss_fn(inputs, algo) -> (loss, metrics)",
    "aggregation": "aggregation(loss (B, T), mask, counts) -> scalar",
    "kl_fn": "kl_fn(logp, ref_logp, mask) -> (B, T)",
    "pair_selector": "pair_selector(members, rng) -> [(chosen, rejected), ...]",
    "filter": "filter(rollouts) -> rollouts",
    "tools.parser": "tool_parser(text) -> calls",
    "tools.executor": "tool_executor(call) -> result",
    "tools.stop_condition": "stop_condition(conversation) -> bool",
}


def check_arity(fn: Callable, what: str, *args) -> None:
    """``what`` (a hook) must accept ``args`` positionally: a ``TypeError`` from binding, turned
    into a ValueError that names the hook, its function and the documented signature
    (``HOOK_SIGNATURES``)."""
    import inspect

    if not callable(fn):
        raise ValueError(f"{what}: {fn!r} is not callable")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    try:
        sig.bind(*args)
    except TypeError as e:
        documented = HOOK_SIGNATURES.get(what.rsplit(": ", 1)[-1])
        raise ValueError(f"{what}: {fn_name(fn)}{sig} cannot be called with {len(args)} argument(s) ({e})"
                         + (f"; the documented signature is {documented}" if documented else "")) from None


def check_picklable(fn, what: str) -> None:
    """``fn`` must travel to Ray actors (by cloudpickle, as Ray sends it); a closure over a
    lock, an open file or a model does not. Raises a ValueError naming the hook."""
    import cloudpickle

    try:
        cloudpickle.dumps(fn)
    except Exception as e:
        raise ValueError(f"{what}: {fn_name(fn)} cannot be sent to the Ray actors (cloudpickle: "
                         f"{type(e).__name__}: {e}); define it at module level, or close over plain data only") \
            from None


class UserFunctionError(RuntimeError):
    """A user's hook raised; the message names the hook, the function and where it ran."""


def call_hook(fn: Callable, what: str, *args, where: str = ""):
    """``fn(*args)``; an exception becomes a ``UserFunctionError`` naming ``what`` (the extension
    point), the function and ``where`` (an actor's role and rank, a rollout uid)."""
    try:
        return fn(*args)
    except UserFunctionError:
        raise
    except Exception as e:
        place = f" ({where})" if where else ""
        message = f"{what} {fn_name(fn)} raised{place}: {type(e).__name__}: {e}"
        if isinstance(e, ValueError):  # bad input stays a ValueError, with the place added
            raise ValueError(message) from e
        raise UserFunctionError(message) from e


def arguments_of(fn: Callable, skip: int = 0) -> str:
    """``fn``'s parameters after the first ``skip`` as ``"a, b=1.0"`` for error messages."""
    params = list(inspect.signature(fn).parameters.values())[skip:]
    return ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params)


def check_kwargs(what: str, fn: Callable, kwargs: dict, positional: int = 0) -> None:
    """A ``ValueError`` naming ``what`` and ``fn``'s accepted arguments unless ``fn`` can be
    called with ``positional`` arguments (a hook's own, which ``kwargs`` may not name) and
    ``kwargs``."""
    params = list(inspect.signature(fn).parameters.values())
    own = [p.name for p in params[:positional]]
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        for key in kwargs:
            if key in own or key not in [p.name for p in params]:
                hint = did_you_mean(key, [p.name for p in params[positional:]]) or ";"
                raise ValueError(f"{what}: unknown argument {key!r}{hint} accepted arguments: "
                                 f"{arguments_of(fn, positional) or 'none'}")
    try:
        inspect.signature(fn).bind(*[None] * positional, **kwargs)
    except TypeError as e:
        raise ValueError(f"{what}: {e}; accepted arguments: {arguments_of(fn, positional) or 'none'}") from None


def bind_keywords(what: str, fn: Callable, kwargs: dict, positional: int) -> Callable:
    """``fn`` with ``kwargs`` bound as keyword arguments after its first ``positional``
    parameters (a hook's own arguments: a reward's rollout, a shaping function's rollout and
    reward, ...), checked by ``check_kwargs``; the bound function keeps ``fn``'s attributes
    (e.g. ``needs_reference``). Without ``kwargs``, ``fn`` itself."""
    import functools

    check_kwargs(what, fn, kwargs, positional)
    if not kwargs:
        return fn
    bound = functools.partial(fn, **kwargs)
    bound.__dict__.update(getattr(fn, "__dict__", {}))
    return bound
