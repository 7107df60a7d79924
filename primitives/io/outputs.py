"""Where a run writes: one call, ``output_dir(path)``, gives a script the same persistent
output root as ``rayrl`` jobs. Under ``ray job submit --working-dir .`` the driver runs in
Ray's temporary copy of the checkout, which vanishes with the Ray session; a relative output
path then goes under ``$RAYRL_OUTPUT_ROOT`` (a shared volume on a multi-node cluster) or
``~/rayrl`` instead.
"""
from __future__ import annotations

import os
from typing import Optional

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


def output_dir(path: str, environ=os.environ, cwd: Optional[str] = None) -> str:
    """The absolute output directory of a run, created: ``path`` as ``resolve_output_dir``
    places it (inside ``ray job submit``: under ``$RAYRL_OUTPUT_ROOT``, not in Ray's temporary
    copy of the working directory). Every script calls it on its ``--out`` before writing."""
    resolved = resolve_output_dir(path, environ, cwd)
    os.makedirs(resolved, exist_ok=True)
    if inside_submitted_job(environ, cwd):
        print(f"writing outputs to {resolved}", flush=True)
    return resolved
