"""Naming things the user gave: hooks as ``module:function``, and hints for a misspelt name.

One resolver of ``module:function`` for every extension point (STYLE point 5: resolved once,
where the job starts), and one "did you mean" for every error that names a wrong name.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
from typing import Callable, Sequence


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
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"hook '{spec}': cannot import '{module_name}' ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"hook '{spec}': '{module_name}' has no callable '{attr}'")
    return fn


def did_you_mean(name, valid: Sequence, n: int = 1) -> str:
    """``"; did you mean 'a' or 'b'?"`` for the closest of ``valid`` to ``name`` (difflib), or ""."""
    close = difflib.get_close_matches(str(name), [str(v) for v in valid], n=n)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
