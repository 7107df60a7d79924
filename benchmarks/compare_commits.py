"""Compare commits on this machine, back to back: RL completions per second, start-up seconds,
idle shares and held-out accuracy gain of the default job and the real-model job, per variant.

Run (every run starts its own Ray, so hold the machine's lock around the whole comparison):

    flock /tmp/heavy.lock .venv/bin/python benchmarks/compare_commits.py \\
        [--variant NAME=REV[:EXTRA ARGS] ...] [--base REV] [--jobs default,smollm2] [--seeds 0,1,2] \\
        [--steps N] [--out FILE.json] [--workdir DIR] [--keep] [-- OVERRIDE ...]

    e.g. --variant base=93027ca --variant sync=. --variant "async=.:--algorithm.max-staleness 1"

REV is a commit, run from ``git worktree add --detach /tmp/rayrl-bench-<sha>``, or ``.`` (also
``WORKTREE``): a copy of the working tree taken at start - uncommitted and untracked files
included, edits made while the comparison runs excluded. The variants default to base (the
commit ``--base``, 93027ca: the last commit before the issue-9 work), sync (the working tree)
and async (the working tree with ``--algorithm.max-staleness 1``); the first variant is the one
the ratios compare with. Each run is

    <python> -m cluster rl <config> --logging.out <dir> --seed N <job overrides> [--algorithm.steps
        <--steps>] <overrides after --> <variant's extra args>

with the variant's directory as working directory, so the driver imports that checkout's code
and the actors get it too (cluster/ray_wing/roles.py puts its own checkout on their PYTHONPATH); this is
checked before any run. To let drift hit every variant alike, for each seed and each job the
variants' start-up runs go back to back, then their full runs.

From a full run's metrics.jsonl (the RL steps after the first, which includes warm-up) and
summary.json: completions per second (prompts drawn x group size, summed, over the summed
``time/step``), the median step and phase times, idle shares (the logged ``idle/generators``
and ``idle/trainers``, time-weighted; for a synchronous run that logs none, derived as
1 - time/generate / time/step and 1 - time/train / time/step), and ``accuracy_gain_points``.
Start-up: a short run (``--sft.steps 0 --algorithm.steps 2 --eval.enabled False``) whose
metrics.jsonl is polled for its first RL row; start-up = (when the row appeared - spawn) - the
row's ``time/step``. The run's own ``startup_s`` from summary.json is reported when it writes one.

Prints one markdown table per job and writes every figure of every run to ``--out`` (default
``<workdir>/compare.json``). Each run's output is ``<workdir>/<job>-<variant>-s<seed>-<kind>/``
and its stdout and stderr ``<that>.log``; a failed run prints its log's tail and the rest go on.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple, Optional

from common import ROOT, table

JOBS = {  # name: (config, overrides that keep one run near 5 minutes on 2 cores)
    "default": ("examples/configs/default.yaml", ()),
    # 30 steps at ~15 s/step plus evaluations take ~9 min; 15 steps with evaluation only before
    # and after RL take about 5
    "smollm2": ("examples/configs/smollm2_arithmetic.yaml", ("--algorithm.steps", "15", "--eval.every", "0")),
}
STARTUP_OVERRIDES = ("--sft.steps", "0", "--algorithm.steps", "2", "--eval.enabled", "False")
WORKTREE_REVS = (".", "WORKTREE")
PHASES = ("time/generate", "time/reward", "time/ref", "time/train", "time/sync")
PACKAGES = ("cluster", "primitives", "rl_actors")
POLL_S = 0.05
USAGE = ("%(prog)s [--variant NAME=REV[:EXTRA ARGS] ...] [--base REV] [--jobs default,smollm2] [--seeds 0,1,2] "
         "[--steps N] [--python PY] [--workdir DIR] [--out FILE.json] [--keep] [-- OVERRIDE ...]")


class Variant(NamedTuple):
    name: str
    rev: str  # as given: a commit-ish, or "." / WORKTREE
    extra: tuple  # command-line overrides of this variant only


class Checkout(NamedTuple):
    path: str  # the directory the variant's runs start in
    label: str  # the commit, or "worktree <HEAD>+<content hash>"
    remove: list  # the command that removes it ([] for none)


class RunResult(NamedTuple):
    rc: int
    wall_s: float  # spawn to exit
    first_rl_row_s: Optional[float]  # spawn to the first RL row appearing in metrics.jsonl
    first_rl_step_s: Optional[float]  # that row's time/step


# ----------------------------------------------------------------------------- variants and checkouts

def parse_variant(text: str) -> Variant:
    """``NAME=REV[:EXTRA ARGS]`` -> Variant (the extra args split as a shell would)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME=REV[:EXTRA ARGS], e.g. "
                                         "'async=.:--algorithm.max-staleness 1'")
    rev, _, extra = rest.partition(":")
    return Variant(name, rev, tuple(shlex.split(extra)))


def git(*args: str, cwd: str = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def commit_checkout(rev: str) -> Checkout:
    """A detached worktree of ``rev`` under /tmp (reused when one is there already)."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = f"/tmp/rayrl-bench-{sha[:12]}"
    if os.path.isdir(path):
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True).stdout.strip()
        if head != sha:
            raise SystemExit(f"{path} is there but is not a worktree at {sha}; remove it")
    else:
        git("worktree", "prune")  # a worktree registered earlier whose directory is gone blocks the add
        git("worktree", "add", "--detach", path, sha)
    return Checkout(path, sha, ["git", "worktree", "remove", "--force", path])


def worktree_checkout() -> Checkout:
    """A copy of the working tree's tracked and untracked (not ignored) files, as they are now."""
    names = [n for n in git("ls-files", "-z", "-co", "--exclude-standard").split("\0") if n]
    names = sorted(n for n in set(names) if os.path.lexists(os.path.join(ROOT, n)))  # deleted files are listed
    digest = hashlib.sha256()
    for n in names:
        digest.update(n.encode() + b"\0")
        if os.path.isfile(os.path.join(ROOT, n)):
            with open(os.path.join(ROOT, n), "rb") as f:
                digest.update(f.read())
    path = f"/tmp/rayrl-bench-worktree-{digest.hexdigest()[:12]}"
    for n in names:
        os.makedirs(os.path.dirname(os.path.join(path, n)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, n), os.path.join(path, n), follow_symlinks=False)
    return Checkout(path, f"worktree {git('rev-parse', 'HEAD')[:12]}+{digest.hexdigest()[:12]}",
                    ["rm", "-rf", path])


def check_imports(python: str, path: str) -> dict:
    """Where a driver started in ``path`` imports the packages from, and the repo root its
    actors get; exits naming the checkout when any of them is outside ``path``."""
    probe = ("import json, importlib; mods = {m: importlib.import_module(m).__file__ for m in %r}; "
             "import os; "  # where REPO_ROOT lives: cluster/ray_wing/roles.py, cluster/setup.py before it (told by
             # the checkout's files: an editable install would supply the new module to an old checkout)
             "s = importlib.import_module('cluster.ray_wing.roles' if os.path.isdir('cluster/ray_wing') else "
             "'cluster.setup'); mods['actors PYTHONPATH (REPO_ROOT)'] = getattr(s, 'REPO_ROOT', '?'); "
             "print(json.dumps(mods))" % (PACKAGES,))
    proc = subprocess.run([python, "-c", probe], cwd=path, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"a driver started in {path} cannot import {', '.join(PACKAGES)}:\n{proc.stderr[-2000:]}")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    outside = {k: v for k, v in found.items() if not os.path.realpath(v).startswith(os.path.realpath(path))}
    if outside:
        raise SystemExit(f"a driver started in {path} imports from elsewhere: {outside}")
    return found


# ----------------------------------------------------------------------------- one run

def run_command(python: str, job: str, variant: Variant, seed: int, out: str, overrides: tuple,
                startup: bool) -> list:
    config, job_overrides = JOBS[job]
    return [python, "-m", "cluster", "rl", config, "--logging.out", out, "--seed", str(seed), *job_overrides,
            *overrides, *variant.extra, *(STARTUP_OVERRIDES if startup else ())]


def first_rl_row(path: str, offset: int) -> tuple:
    """``(row or None, new offset)``: the first complete metrics line from ``offset`` on that
    is an RL step (has ``time/step``)."""
    if not os.path.exists(path) or os.path.getsize(path) <= offset:
        return None, offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # being written; read again next poll
        offset += len(line)
        row = json.loads(line)
        if "time/step" in row and row.get("phase") != "sft":
            return row, offset
    return None, offset


def run_watched(cmd: list, cwd: str, out: str, log_path: str) -> RunResult:
    """Run ``cmd`` (output to ``log_path``), polling ``<out>/metrics.jsonl`` for the first RL row."""
    metrics_path, offset, row, seen_s = os.path.join(out, "metrics.jsonl"), 0, None, None
    env = {**os.environ, "TQDM_DISABLE": "1"}
    with open(log_path, "w") as log:
        log.write("$ (cd " + shlex.quote(cwd) + " && " + shlex.join(cmd) + ")\n")
        log.flush()
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            if row is None:
                row, offset = first_rl_row(metrics_path, offset)
                seen_s = time.monotonic() - start if row is not None else None
            time.sleep(POLL_S)
        wall = time.monotonic() - start
    if row is None:  # written during the last poll interval
        row, offset = first_rl_row(metrics_path, offset)
        seen_s = wall if row is not None else None
    return RunResult(proc.returncode, wall, seen_s, row["time/step"] if row else None)


def log_tail(path: str, lines: int = 25) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


# ----------------------------------------------------------------------------- figures of a run

def load_run(out: str) -> tuple:
    """``(RL step rows after the first, summary, resolved config)`` of a finished run."""
    import yaml

    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in rows if "time/step" in r and r.get("phase") != "sft"][1:]
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "config.yaml")) as f:
        config = yaml.safe_load(f)
    return steps, summary, config


def completions(row: dict, config: dict) -> float:
    """Completions a step generated: prompts drawn (resampling included) x group size; the
    trained rows, or prompts per step x group size, when the step logs no prompt count."""
    group = config["generation"]["group_size"]
    if "data/prompts_drawn" in row:
        return row["data/prompts_drawn"] * group
    return row.get("batch/rows", config["algorithm"]["prompts_per_step"] * group)


def idle_shares(steps: list, config: dict) -> dict:
    """Time-weighted idle share of generators and trainers: logged, or derived for a synchronous
    run (None for an asynchronous run that logs none)."""
    total = sum(r["time/step"] for r in steps)
    shares = {}
    for role, phase in (("generators", "time/generate"), ("trainers", "time/train")):
        key = f"idle/{role}"
        if all(key in r for r in steps):
            shares[key], shares[f"{key}_derived"] = sum(r[key] * r["time/step"] for r in steps) / total, False
        elif not config["algorithm"].get("max_staleness") and all(phase in r for r in steps):
            shares[key], shares[f"{key}_derived"] = 1 - sum(r[phase] for r in steps) / total, True
        else:
            shares[key], shares[f"{key}_derived"] = None, False
    return shares


def full_run_figures(out: str) -> dict:
    steps, summary, config = load_run(out)
    if not steps:
        raise ValueError(f"{out}: no RL step after the first in metrics.jsonl")
    phase_medians = {f"median {k}": statistics.median([r[k] for r in steps]) if all(k in r for r in steps) else None
                     for k in PHASES}
    return {"completions_per_s": sum(completions(r, config) for r in steps) / sum(r["time/step"] for r in steps),
            "median time/step": statistics.median(r["time/step"] for r in steps), **phase_medians,
            **idle_shares(steps, config), "accuracy_gain_points": summary.get("accuracy_gain_points"),
            "accuracy_before_rl": summary.get("accuracy_before_rl"),
            "accuracy_after_rl": summary.get("accuracy_after_rl"), "rl_steps_measured": len(steps),
            "summary_startup_s": summary.get("startup_s"), "summary_wall_s": summary.get("wall_s")}


def startup_figures(out: str, result: RunResult) -> dict:
    summary_path = os.path.join(out, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    polled = None if result.first_rl_row_s is None else result.first_rl_row_s - result.first_rl_step_s
    return {"startup_s": polled, "first_rl_row_s": result.first_rl_row_s,
            "first_rl_step_s": result.first_rl_step_s, "summary_startup_s": summary.get("startup_s")}


def drop_models(out: str) -> None:
    """Free the disk the run's weights take (a SmolLM2 run writes about 1 GB)."""
    for name in ("final_model", "checkpoints", "sft_model"):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)


# ----------------------------------------------------------------------------- tables

def spread(xs: list, fmt: str) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)} to {format(max(xs), fmt)})"


FIGURES = [  # (label, kind of run, key, format)
    ("RL completions/s", "full", "completions_per_s", ".1f"),
    ("start-up s (polled)", "startup", "startup_s", ".1f"),
    ("start-up s (summary startup_s)", "startup", "summary_startup_s", ".1f"),
    ("median step s", "full", "median time/step", ".3f"),
    *[(f"median {k[5:]} s", "full", f"median {k}", ".3f") for k in PHASES],
    ("idle share generators", "full", "idle/generators", ".2f"),
    ("idle share trainers", "full", "idle/trainers", ".2f"),
    ("held-out accuracy gain, points", "full", "accuracy_gain_points", "+.1f"),
]


def values(records: list, job: str, variant: str, kind: str, key: str) -> dict:
    """``{seed: value}`` of one figure over the seeds' runs that succeeded."""
    return {r["seed"]: r["figures"].get(key) for r in records
            if (r["job"], r["variant"], r["kind"]) == (job, variant, kind) and r["figures"]}


def derived_note(records: list, job: str, variant: str, key: str) -> str:
    flags = [r["figures"].get(f"{key}_derived") for r in records
             if (r["job"], r["variant"], r["kind"]) == (job, variant, "full") and r["figures"]]
    return " (derived)" if any(flags) else ""


def job_table(records: list, job: str, variants: list) -> str:
    names = [v.name for v in variants]
    rows = []
    for label, kind, key, fmt in FIGURES:
        cells = [spread(list(values(records, job, n, kind, key).values()), fmt) for n in names]
        if key.startswith("idle/"):
            cells = [c + (derived_note(records, job, n, key) if c != "n/a" else "") for c, n in zip(cells, names)]
        rows.append([label, *cells])
    gains = [values(records, job, n, "full", "accuracy_gain_points") for n in names]
    rows.append(["accuracy gain per seed", *[", ".join(f"s{s} {g:+.1f}" for s, g in sorted(v.items())
                                                       if g is not None) or "n/a" for v in gains]])
    return table(rows, ["median (min to max) over seeds", *names])


def paired(records: list, job: str, variant: str, base: str, kind: str, key: str, combine) -> list:
    """``combine(variant's value, base's value)`` per seed that both ran."""
    ours, theirs = values(records, job, variant, kind, key), values(records, job, base, kind, key)
    return [combine(ours[s], theirs[s]) for s in sorted(ours) if s in theirs
            and ours[s] is not None and theirs[s] is not None]


def ratio_table(records: list, job: str, variants: list) -> str:
    base, others = variants[0].name, [v.name for v in variants[1:]]

    def of_medians(n, kind, key, combine, fmt):
        ours, theirs = [[x for x in values(records, job, name, kind, key).values() if x is not None]
                        for name in (n, base)]
        if not ours or not theirs:
            return "n/a"
        overall = combine(statistics.median(ours), statistics.median(theirs))
        per_seed = paired(records, job, n, base, kind, key, combine)
        rng = f" (per seed {format(min(per_seed), fmt)} to {format(max(per_seed), fmt)})" if len(per_seed) > 1 else ""
        return format(overall, fmt) + rng

    ratio, speedup, diff = (lambda a, b: a / b), (lambda a, b: b / a), (lambda a, b: a - b)
    rows = [["RL completions/s ratio", *[of_medians(n, "full", "completions_per_s", ratio, ".2f") for n in others]],
            ["start-up ratio (base / variant)", *[of_medians(n, "startup", "startup_s", speedup, ".2f")
                                                  for n in others]],
            ["idle share generators difference", *[of_medians(n, "full", "idle/generators", diff, "+.2f")
                                                   for n in others]],
            ["idle share trainers difference", *[of_medians(n, "full", "idle/trainers", diff, "+.2f")
                                                 for n in others]],
            ["accuracy gain difference, points", *[of_medians(n, "full", "accuracy_gain_points", diff, "+.1f")
                                                   for n in others]]]
    return table(rows, [f"vs {base}", *others])


# ----------------------------------------------------------------------------- main

def parse_args(argv: list) -> tuple:
    """``(args, overrides)``: the overrides are what follows ``--``."""
    ours, overrides = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Overrides after -- go to every run.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, usage=USAGE)
    p.add_argument("--variant", action="append", type=parse_variant, metavar="NAME=REV[:EXTRA ARGS]",
                   help="a variant to run (repeat; the first is the base of the ratios); REV '.' or WORKTREE: "
                        "the working tree")
    p.add_argument("--base", default="93027ca", help="the base commit of the default variants")
    p.add_argument("--jobs", default="default,smollm2", help=f"comma-separated, of {', '.join(JOBS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated; passed as --seed N")
    p.add_argument("--steps", type=int, help="RL steps of every full run (--algorithm.steps N)")
    p.add_argument("--python", default=next((x for x in [os.path.join(ROOT, ".venv", "bin", "python")]
                                              if os.path.exists(x)), sys.executable),
                   help="the interpreter of every run (default: this checkout's .venv)")
    p.add_argument("--workdir", help="where the runs write (default: a new /tmp/rayrl-compare-* directory)")
    p.add_argument("--out", help="the JSON of every figure (default: <workdir>/compare.json)")
    p.add_argument("--keep", action="store_true", help="keep the worktrees and the runs' model weights")
    args = p.parse_args(ours)
    args.variant = args.variant or [Variant("base", args.base, ()), Variant("sync", ".", ()),
                                    Variant("async", ".", ("--algorithm.max-staleness", "1"))]
    args.jobs = args.jobs.split(",")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    unknown = [j for j in args.jobs if j not in JOBS]
    if unknown or len({v.name for v in args.variant}) < len(args.variant):
        p.error(f"unknown jobs {unknown} (known: {', '.join(JOBS)})" if unknown else "variant names repeat")
    steps = ("--algorithm.steps", str(args.steps)) if args.steps else ()
    return args, (*steps, *overrides)


def checkouts_of(variants: list) -> dict:
    """``{rev: Checkout}``, one per distinct commit and one copy of the working tree."""
    found: dict = {}
    for v in variants:
        if v.rev in found:
            continue
        if v.rev in WORKTREE_REVS:
            found[v.rev] = next((c for r, c in found.items() if r in WORKTREE_REVS), None) or worktree_checkout()
        else:
            sha = git("rev-parse", "--verify", f"{v.rev}^{{commit}}")
            found[v.rev] = next((c for c in found.values() if c.label == sha), None) or commit_checkout(sha)
    return found


def run_one(args, job: str, variant: Variant, checkout: Checkout, seed: int, kind: str, overrides: tuple,
            bar) -> dict:
    """One run, its figures, and a record of it (a failed run: its log's tail, no figures)."""
    out = os.path.join(args.workdir, f"{job}-{variant.name}-s{seed}-{kind}")
    shutil.rmtree(out, ignore_errors=True)
    cmd = run_command(args.python, job, variant, seed, out, overrides, startup=kind == "startup")
    bar.set_description(f"{job} {variant.name} s{seed} {kind}")
    result = run_watched(cmd, checkout.path, out, out + ".log")
    record = {"job": job, "variant": variant.name, "rev": variant.rev, "commit": checkout.label, "seed": seed,
              "kind": kind, "out": out, "log": out + ".log", "command": cmd, "cwd": checkout.path, "rc": result.rc,
              "wall_s": result.wall_s, "first_rl_row_s": result.first_rl_row_s, "figures": {}}
    try:
        if result.rc != 0:
            raise RuntimeError(f"exit status {result.rc}")
        record["figures"] = startup_figures(out, result) if kind == "startup" else full_run_figures(out)
    except (RuntimeError, ValueError, OSError, KeyError) as e:
        record["error"] = str(e)
        bar.write(f"FAILED {job} {variant.name} seed {seed} {kind} ({e}); tail of {out}.log:\n{log_tail(out + '.log')}")
    if not args.keep:
        drop_models(out)
    return record


def main(argv: Optional[list] = None) -> None:
    from tqdm import tqdm

    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="rayrl-compare-")
    os.makedirs(args.workdir, exist_ok=True)
    args.out = args.out or os.path.join(args.workdir, "compare.json")
    checkouts = checkouts_of(args.variant)
    for v in args.variant:
        c = checkouts[v.rev]
        print(f"{v.name}: {c.label} in {c.path}; extra args: {shlex.join(v.extra) or 'none'}")
        print(f"  imports: {check_imports(args.python, c.path)}")
    for job in args.jobs:
        print(f"{job}: {JOBS[job][0]} {shlex.join(JOBS[job][1])} {shlex.join(overrides)}".rstrip())
    print(f"start-up runs add: {shlex.join(STARTUP_OVERRIDES)}; runs write to {args.workdir}", flush=True)

    plan = [(seed, job, kind, v) for seed in args.seeds for job in args.jobs for kind in ("startup", "full")
            for v in args.variant]
    records = []
    try:
        with tqdm(plan, unit="run") as bar:
            for seed, job, kind, v in bar:
                records.append(run_one(args, job, v, checkouts[v.rev], seed, kind, overrides, bar))
                with open(args.out, "w") as f:  # after every run: an interrupted comparison keeps what it has
                    json.dump({"variants": [v._asdict() for v in args.variant], "overrides": list(overrides),
                               "jobs": {j: JOBS[j] for j in args.jobs}, "runs": records}, f, indent=1)
    finally:
        if not args.keep:
            for c in {c.path: c for c in checkouts.values()}.values():
                subprocess.run(c.remove, cwd=ROOT, check=False, capture_output=True)
    for job in args.jobs:
        print(f"\n### {job} ({JOBS[job][0]}; seeds {','.join(map(str, args.seeds))})\n")
        print(job_table(records, job, args.variant))
        if len(args.variant) > 1:
            print()
            print(ratio_table(records, job, args.variant))
    failed = [r for r in records if "error" in r]
    print(f"\n{len(records) - len(failed)} of {len(records)} runs succeeded; every figure is in {args.out}")


if __name__ == "__main__":
    main()
