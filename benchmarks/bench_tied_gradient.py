"""The tied embedding's gradient folded or as PyTorch makes it: one trainer rank's update, paired rounds.

Run:  python benchmarks/bench_tied_gradient.py [--model smollm2] [--repeats 8] [--micro-batch 16]

A 1-rank ZeRO-2 trainer (``gpu_check.trainer_rank``, this process's threads) generates a step's
rollouts (``--prompts`` x ``--group``, the arithmetic task) and then makes ``train_step`` on that batch
``--repeats`` times in each mode, the order flipped every round (``primitives.model.tied_gradient``:
``folding(True)`` and ``folding(False)``). Prints each mode's median seconds and the median of the
rounds' ratios, which a shared machine's drifting speed moves least.
"""
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import table  # noqa: E402
from gpu_check import model_dir, step_parser, trainer_rank  # noqa: E402

from primitives.env.rewards import score_rollouts  # noqa: E402
from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task  # noqa: E402
from primitives.maths.algorithms import grpo  # noqa: E402
from primitives.maths.batching import make_batch  # noqa: E402
from primitives.model import tied_gradient  # noqa: E402
from primitives.types import GenerationConfig  # noqa: E402


def main(argv=None) -> dict:
    p = step_parser(__doc__)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=8, help="rounds; each makes one update in each mode")
    p.set_defaults(model="smollm2", prompts=4, group=8)
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory(prefix="bench_tied_") as scratch:
        path, _ = model_dir(args, scratch)
        trainer = trainer_rank(path, args.lr, micro_batch_size=args.micro_batch)
        if tied_gradient.tied_pair(trainer.ds.engine) is None:
            raise SystemExit(f"{args.model}: its embedding and head are not a tied pair this folds; nothing to compare")
        items = make_arithmetic_task(ArithmeticTaskSpec(num_train=args.prompts, num_heldout=1, seed=0))[0]
        rollouts = trainer.generate(items, GenerationConfig(max_new_tokens=args.max_new_tokens, n=args.group))
        rollouts = score_rollouts(rollouts, lambda r: float(int(r.completion_ids.sum()) % 3))  # every group spread
        algo = grpo(kl_coef=0.0, is_level="off")
        batch = make_batch(rollouts, algo, trainer.tokenizer.pad_token_id, budget=args.max_new_tokens)
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
    ratio = statistics.median(a / b for a, b in zip(times[True], times[False]))
    rows = [["as PyTorch makes it", f"{statistics.median(times[False]):.3f}", "1.000"],
            ["folded", f"{statistics.median(times[True]):.3f}", f"{ratio:.3f}"]]
    print(f"{args.model}, {len(rollouts)} rollouts, micro-batches of {args.micro_batch}, "
          f"{torch.get_num_threads()} threads, {args.repeats} rounds")
    print(table(rows, ["train_step", "median s", "/ PyTorch's (median of the rounds' ratios)"]))
    return {"folded_s": statistics.median(times[True]), "pytorch_s": statistics.median(times[False]), "ratio": ratio}


if __name__ == "__main__":
    main()
