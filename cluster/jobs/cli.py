"""``rayrl``: one command, one config file.

    rayrl rl job.yaml [--section.field VALUE ...] [--print-config] [--help]
    rayrl sft job.yaml [...]
    rayrl rl job.yaml --resume auto      (--checkpoint.resume auto: continue from the run's newest checkpoint)
    python -m cluster rl job.yaml            (the same, from a checkout; what `ray job submit` runs)

The YAML file mirrors the records of ``cluster/jobs/config.py``; without a file the records'
defaults are used (``rayrl rl`` alone is the default job: the embedded tiny model and
arithmetic task). Any field can be overridden on the command line; ``--help`` lists every
field with its documentation and the value the file gives it; ``--print-config`` prints
the resolved config as YAML and exits.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from cluster.jobs.config import JOBS, ConfigError, dump_config, load_job_config, parse_overrides

USAGE = "usage: rayrl {rl,sft} [CONFIG.yaml] [--section.field VALUE ...] [--resume auto] [--print-config] [--help]"
ALIASES = {"--resume": "--checkpoint.resume"}  # short names on the command line


def expand_aliases(args: Sequence[str]) -> list:
    """``args`` with each short name (``ALIASES``) written out, also as ``--name=VALUE``."""
    out = []
    for arg in args:
        name, eq, value = arg.partition("=")
        out.append(ALIASES[name] + eq + value if name in ALIASES else arg)
    return out


def parse(argv: Optional[Sequence[str]] = None, prog: str = "rayrl"):
    """``(command, job record, print_only)`` from the command line; a bad config file or
    override exits with a usage error naming it."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in JOBS:
        if args and args[0] in ("-h", "--help"):
            print(__doc__.strip())
            raise SystemExit(0)
        raise SystemExit(f"{USAGE}\n{prog}: expected a command, rl or sft, got {args[0] if args else 'nothing'!r}")
    command, args = args[0], args[1:]
    path = args.pop(0) if args and not args[0].startswith("-") else None
    print_only = "--print-config" in args
    args = expand_aliases([a for a in args if a != "--print-config"])
    job_type = JOBS[command]
    try:
        default = load_job_config(path, job_type)
    except ConfigError as e:
        raise SystemExit(f"{prog} {command}: {e}") from None
    source = f" Config file: {path}." if path else " No config file: the defaults below."
    description = (job_type.__doc__ or "").strip() + source + \
        " --resume auto (--checkpoint.resume auto) continues from the run's newest checkpoint."
    job = parse_overrides(job_type, default, args, prog=f"{prog} {command}{' ' + path if path else ''}",
                          description=description)
    return command, job, print_only


def run(argv: Optional[Sequence[str]] = None) -> dict:
    """Parse, then run the job and return its summary (``{}`` after ``--print-config``)."""
    from cluster.jobs.checks import ConfigErrors
    from cluster.jobs.rl import run_rl
    from cluster.jobs.sft import run_sft

    command, job, print_only = parse(argv)
    if print_only:
        print(dump_config(job), end="")
        return {}
    try:
        return (run_rl if command == "rl" else run_sft)(job)
    except ConfigErrors as e:  # found before any actor started: a usage error, not a traceback
        raise SystemExit(f"rayrl {command}: {e}") from None


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``rayrl`` and ``python -m cluster``: exit status 0 on success (the
    console script passes the return value to ``sys.exit``)."""
    run(argv)


if __name__ == "__main__":
    main()
