"""vLLM's KV-cache block size on CPU: one generate call of a GRPO-shaped batch, per block size.

Run:  python benchmarks/bench_vllm_blocks.py [--blocks 128,32 --repeats 4 --threads 2 --write FILE]

vLLM shares a prompt's cached KV between requests only in whole blocks (also within one call), so
with blocks longer than the prompt every sample prefills it again. Each block size runs in a process
of its own (one vLLM engine per process), building the generator worker's engine
(``rl_actors.vllm_engine.VLLMEngine``) on SmolLM2 with ``cluster.vllm.block_size`` set, and times one
call of 32 seeded requests per shape, the prefix cache emptied before each: 4 chat prompts x 8
samples (16 and 64 new tokens) and 32 distinct chat prompts. Prints the median seconds and the share
of prompt tokens the prefix cache served (``VLLMEngine.prompt_tokens``).
"""
import json
import os
import subprocess
import sys
import time

from common import ROOT, bench_parser, median, model_path, publish, table

SHAPES = (("4 chat prompts x 8, 16 new tokens", 4, 16), ("32 distinct chat prompts, 16 new tokens", 32, 16),
          ("4 chat prompts x 8, 64 new tokens", 4, 64))


def one_block_size(block: int, repeats: int, threads: int) -> dict:
    """``{shape: (median seconds, share of prompt tokens from the cache)}`` for one block size."""
    from primitives.fixtures.tasks import TASKS
    from primitives.model.prompts import encode_prompts
    from primitives.types import GenerationConfig, ModelConfig, VLLMConfig
    from rl_actors.vllm_engine import VLLMEngine

    engine = VLLMEngine(ModelConfig(model_path("smollm2")), "bench", VLLMConfig(block_size=block), threads)
    items = TASKS["chat_arithmetic"](max_operand=99).train[:32]
    ids = encode_prompts(engine.tokenizer, [it.prompt for it in items])
    out = {}
    for name, distinct, tokens in SHAPES:
        rows = [p for p in ids[:distinct] for _ in range(32 // distinct)]
        gen = GenerationConfig(temperature=1.0, max_new_tokens=tokens)
        times, before = [], list(engine.prompt_tokens)
        for r in range(repeats):
            engine.llm.reset_prefix_cache()
            t0 = time.perf_counter()
            engine._outputs(rows, gen, base_seed=100 * r)
            times.append(time.perf_counter() - t0)
        total, cached = (a - b for a, b in zip(engine.prompt_tokens, before))
        out[name] = (median(times[1:] if repeats > 1 else times), cached / max(total, 1))  # the first warms up
    return out


def main():
    p = bench_parser(__doc__, repeats=4)
    p.add_argument("--blocks", default="128,32", help="block sizes in tokens (multiples of 32 on CPU)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write", default=None, help="append the table to this markdown file")
    p.add_argument("--one", type=int, default=None, help="(internal) time one block size in this process")
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(one_block_size(args.one, args.repeats, args.threads)))
        return
    results = {}
    for block in (int(b) for b in args.blocks.split(",")):
        cmd = [sys.executable, __file__, "--one", str(block), "--repeats", str(args.repeats),
               "--threads", str(args.threads)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
        if proc.returncode != 0:
            raise SystemExit(f"block size {block} failed:\n{proc.stderr[-3000:]}")
        results[block] = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [[name] + [f"{results[b][name][0]:.2f} s ({results[b][name][1]:.0%} cached)" for b in results]
            for name, _, _ in SHAPES]
    publish(table(rows, ["one call of 32 requests"] + [f"{b}-token blocks" for b in results]), args.write)


if __name__ == "__main__":
    main()
