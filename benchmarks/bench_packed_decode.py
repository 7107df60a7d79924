"""CPU generation with the large linear weights packed for oneDNN (``decode: packed``), against the
eager loop, in one process, round by round (``primitives.model.packed_decode``).

Run:  python benchmarks/bench_packed_decode.py [--model smollm2|tiny --repeats 8 --min-mib 16]

The SmolLM2 job's generation: 4 chat-arithmetic prompts x 8 samples, up to 16 new tokens,
temperature 1, in a process set up as a generator worker's (its threads, glibc keeping freed
memory). Each round samples the same prompts and seed in both modes, the order flipped every
round. Prints each round, the median seconds of each mode, the median of the rounds' ratios,
the packing's own time, and in how many rounds the two sampled the same tokens (the products
differ in the last bits, so now and then a draw lands on the other side of a boundary).
``--min-mib`` sets ``PACK_MIN_BYTES`` (0 packs every linear layer).
"""
import time

import torch
from common import bench_parser, median, model_path, table


def main():
    p = bench_parser(__doc__, repeats=8)
    p.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-mib", type=float, default=None, help="PACK_MIN_BYTES in MiB (default: the module's)")
    args = p.parse_args()
    from rl_actors.common import setup_process

    setup_process(num_threads=args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primitives.fixtures.tasks import TASKS
    from primitives.model import packed_decode
    from primitives.model.generation import generate_rollouts
    from primitives.types import GenerationConfig

    if args.min_mib is not None:
        packed_decode.PACK_MIN_BYTES = int(args.min_mib * (1 << 20))
    path = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    task = TASKS["chat_arithmetic"](max_operand=99, num_train=2000, num_heldout=64)
    times, tokens, same = {"eager": [], "packed": []}, [], 0
    pack = []
    for r in range(args.repeats + 1):  # round 0 warms both up and is not counted
        items = task.train[4 * r: 4 * r + 4]
        sampled = {}
        for mode in (["eager", "packed"] if r % 2 == 0 else ["packed", "eager"]):
            config = GenerationConfig(max_new_tokens=16, temperature=1.0, n=8, decode=mode)
            t0 = time.perf_counter()
            out = generate_rollouts(model, tokenizer, items, config, generator=torch.Generator().manual_seed(r))
            elapsed = time.perf_counter() - t0
            sampled[mode] = [o.completion_ids.tolist() for o in out]
            if r:
                times[mode].append(elapsed)
        if r:
            tokens.append(sum(len(c) for c in sampled["eager"]))
            same += sampled["eager"] == sampled["packed"]
            print(f"round {r}: eager {times['eager'][-1]:.3f} s, packed {times['packed'][-1]:.3f} s", flush=True)
        t0 = time.perf_counter()
        with packed_decode.packed_linears(model, 32) as layers:
            pack.append(time.perf_counter() - t0)
    ratio = median([p / e for p, e in zip(times["packed"], times["eager"])])
    print(table([[m, f"{median(t):.3f}"] for m, t in times.items()], ["decode", "median s"]))
    print(f"packed / eager {ratio:.3f} (median of {args.repeats} rounds); layers of "
          f">= {packed_decode.PACK_MIN_BYTES / (1 << 20):g} MiB packed: {layers}, in {1e3 * median(pack):.0f} ms; "
          f"{median(tokens):.0f} tokens a round; the same tokens in {same} of {args.repeats} rounds")


if __name__ == "__main__":
    main()
