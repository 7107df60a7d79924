"""CPU generation with linear weights packed for oneDNN (``decode: packed``), against the
eager loop, in one process, round by round (``primitives.model.packed_decode``).

Run:  python benchmarks/bench_packed_decode.py [--model smollm2|tiny --repeats 8 --variants 16 0]

The SmolLM2 job's generation: 4 chat-arithmetic prompts x 8 samples, up to 16 new tokens,
temperature 1, in a process set up as a generator worker's (its threads, glibc keeping freed
memory). Each round samples the same prompts and seed in the eager loop and in each packed
variant (``--variants``: ``PACK_MIN_BYTES`` in MiB; 16 packs SmolLM2's head alone, 0 every linear
layer), the order flipped every round. Prints each round, the median seconds of each, the median of
the rounds' ratios to the eager loop, the packing's own time, and in how many rounds all sampled the
same tokens (the products differ in the last bits, so now and then a draw lands on the other side
of a boundary).
"""
import time

import torch
from common import bench_parser, median, model_path, table


def main():
    p = bench_parser(__doc__, repeats=8)
    p.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", nargs="+", type=float, default=[16.0, 0.0],
                   help="packed variants beside the eager loop: PACK_MIN_BYTES in MiB")
    args = p.parse_args()
    from rl_actors.common import setup_process

    setup_process(num_threads=args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primitives.fixtures.tasks import TASKS
    from primitives.model import packed_decode
    from primitives.model.generation import generate_rollouts
    from primitives.types import GenerationConfig

    path = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    task = TASKS["chat_arithmetic"](max_operand=99, num_train=2000, num_heldout=64)
    variants = {"eager": None, **{f"packed, >= {v:g} MiB": int(v * (1 << 20)) for v in args.variants}}
    for name, packing in variants.items():  # a variant that packs nothing is refused before any round
        packed_decode.PACK_MIN_BYTES = packing or 0
        if packing is not None and not packed_decode.can_pack(model):
            raise SystemExit(f"--variants: '{name}' packs no layer of {args.model} (its weights are smaller)")
    times: dict = {name: [] for name in variants}
    tokens, same, pack = [], 0, {name: [] for name in variants}
    for r in range(args.repeats + 1):  # round 0 warms every variant up and is not counted
        items = task.train[4 * r: 4 * r + 4]
        sampled = {}
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            packing = variants[name]
            if packing is not None:
                packed_decode.PACK_MIN_BYTES = packing
            config = GenerationConfig(max_new_tokens=16, temperature=1.0, n=8, decode="eager" if packing is None
                                      else "packed")
            t0 = time.perf_counter()
            out = generate_rollouts(model, tokenizer, items, config, generator=torch.Generator().manual_seed(r))
            elapsed = time.perf_counter() - t0
            sampled[name] = [o.completion_ids.tolist() for o in out]
            if r:
                times[name].append(elapsed)
            if packing is not None:
                t0 = time.perf_counter()
                with packed_decode.packed_linears(model, 32) as layers:
                    pack[name].append((time.perf_counter() - t0, layers))
        if r:
            tokens.append(sum(len(c) for c in sampled["eager"]))
            same += all(s == sampled["eager"] for s in sampled.values())
            print(f"round {r}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()), flush=True)
    rows = [[n, f"{median(t):.3f}", f"{median([a / e for a, e in zip(t, times['eager'])]):.3f}",
             "" if n == "eager" else f"{pack[n][-1][1]} in {1e3 * median([p for p, _ in pack[n]]):.0f} ms"]
            for n, t in times.items()]
    print(table(rows, ["decode", "median s", "/ eager (median of the rounds' ratios)", "layers packed, packing"]))
    print(f"{median(tokens):.0f} tokens a round; every variant sampled the eager loop's tokens in {same} of "
          f"{args.repeats} rounds")


if __name__ == "__main__":
    main()
