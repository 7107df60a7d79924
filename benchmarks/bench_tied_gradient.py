"""The tied embedding's gradient folded or as PyTorch makes it: one trainer rank's update, paired rounds.

Run:  python benchmarks/bench_tied_gradient.py [--model smollm2] [--repeats 8] [--micro-batch 16]

A 1-rank ZeRO-2 trainer (``gpu_check.trainer_rank``, this process's threads) generates a step's
rollouts (``--prompts`` x ``--group``, the arithmetic task) and then makes ``train_step`` on that batch
``--repeats`` times in each mode, the order flipped every round (``primitives.model.tied_gradient``:
``folding(True)`` and ``folding(False)``). The process keeps its freed memory as a trainer actor's does
(``rl_actors.common.reuse_freed_memory``; ``--default-heap``: glibc's defaults). Prints each mode's median
seconds and the median of the rounds' ratios, which a shared machine's drifting speed moves least, and, from
``torch.profiler`` over one more update of each, the time of the ops on (V, H) tensors (the head's product
included): the fold's own share, which the machine's drift moves less than the whole update.
"""
import os
import statistics
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import table  # noqa: E402
from gpu_check import model_dir, step_parser, trainer_rank  # noqa: E402
from gpu_step import update_batch  # noqa: E402

from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task  # noqa: E402
from primitives.model import tied_gradient  # noqa: E402
from primitives.types import GenerationConfig  # noqa: E402


def main(argv=None) -> dict:
    p = step_parser(__doc__)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=8, help="rounds; each makes one update in each mode")
    p.add_argument("--default-heap", action="store_true", help="glibc's malloc settings, not a trainer actor's")
    p.set_defaults(model="smollm2", prompts=4, group=8)
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not args.default_heap:
        from rl_actors.common import reuse_freed_memory

        reuse_freed_memory()
    with tempfile.TemporaryDirectory(prefix="bench_tied_") as scratch:
        path, _ = model_dir(args, scratch)
        if tied_gradient.tied_pair(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)) is None:
            raise SystemExit(f"{args.model}: its embedding and head are not a tied pair this folds; nothing to compare")
        trainer = trainer_rank(path, args.lr, micro_batch_size=args.micro_batch)
        items = make_arithmetic_task(ArithmeticTaskSpec(num_train=args.prompts, num_heldout=1, seed=0))[0]
        rollouts = trainer.generate(items, GenerationConfig(max_new_tokens=args.max_new_tokens, n=args.group))
        rollouts, algo, batch = update_batch(rollouts, trainer.tokenizer.pad_token_id, args.max_new_tokens)
        times: dict = {True: [], False: []}
        for on in (True, False):  # warm-up: the kept buffer, the allocator
            with tied_gradient.folding(on):
                trainer.train_step(batch, algo, 1.0)
        for r in range(args.repeats):
            for on in ((True, False) if r % 2 else (False, True)):
                with tied_gradient.folding(on):
                    t = time.perf_counter()
                    trainer.train_step(batch, algo, 1.0)
                    times[on].append(time.perf_counter() - t)
        shape = list(trainer.ds.module.get_input_embeddings().weight.shape)
        update = lambda: trainer.train_step(batch, algo, 1.0)  # noqa: E731
        vocab_ops = {on: vocabulary_ops(update, on, shape) for on in (False, True)}
    ratio = statistics.median(a / b for a, b in zip(times[True], times[False]))
    rows = [[name, f"{statistics.median(times[on]):.3f}", r, f"{vocab_ops[on][0]:.3f}", vocab_ops[on][1]]
            for name, on, r in (("as PyTorch makes it", False, "1.000"), ("folded", True, f"{ratio:.3f}"))]
    print(f"{args.model}, {len(rollouts)} rollouts, micro-batches of {args.micro_batch}, "
          f"{torch.get_num_threads()} threads, {args.repeats} rounds, "
          f"{'glibc default heap' if args.default_heap else 'heap kept as an actor keeps it'}")
    print(table(rows, ["train_step", "median s", "/ PyTorch's (median of the rounds' ratios)", "(V, H) ops s",
                       "the largest of them"]))
    return {"folded_s": statistics.median(times[True]), "pytorch_s": statistics.median(times[False]), "ratio": ratio,
            "vocab_ops_s": {on: v[0] for on, v in vocab_ops.items()}}


def vocabulary_ops(update, on: bool, shape: list) -> tuple:
    """``(seconds, "name s, ...")`` of the ops on a ``shape`` tensor in one ``update()``, folded or not."""
    from torch.profiler import profile

    with tied_gradient.folding(on), profile(record_shapes=True) as prof:
        update()
    spent: dict = {}
    for e in prof.events():
        if any(list(s) == shape for s in e.input_shapes if s):
            spent[e.name] = spent.get(e.name, 0.0) + e.self_cpu_time_total / 1e6
    top = sorted(spent.items(), key=lambda kv: -kv[1])[:3]
    return sum(spent.values()), ", ".join(f"{name.replace('aten::', '')} {s:.3f}" for name, s in top)


if __name__ == "__main__":
    main()
