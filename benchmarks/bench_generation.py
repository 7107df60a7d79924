"""Generation throughput of the HF generator backend with 1 vs 2 generator workers.

Run:  python benchmarks/bench_generation.py [--prompts 128 --n 8 --max-new-tokens 16 --repeats 5]
The same prompts are split evenly over the workers; tokens/s counts generated tokens.
"""
import time

from common import bench_parser, median, start_local_ray, table


def main():
    p = bench_parser(__doc__)
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args()
    ray = start_local_ray()
    import tempfile

    from cluster.groups import split_evenly
    from primitives.data import PromptItem
    from primitives.tiny import save_tiny_model
    from primitives.types import GenerationConfig, ModelConfig
    from rl_actors.generator import GeneratorWorker

    path = save_tiny_model(tempfile.mkdtemp(prefix="bench-gen-"))
    items = [PromptItem(i, f"{i % 50:02d}+{(7 * i) % 50:02d}=") for i in range(args.prompts)]
    # eos never ends early at temperature 1 on a random model often enough to matter; count real tokens
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, n=args.n)
    results = {}
    for workers in (1, 2):
        remote = ray.remote(num_cpus=1, num_gpus=args.gpus)(GeneratorWorker)
        actors = [remote.remote(ModelConfig(path), r, "hf") for r in range(workers)]
        ray.get([a.info.remote() for a in actors])
        ray.get([a.generate.remote(c, gen) for a, c in zip(actors, split_evenly(items[:8], workers))])  # warm-up
        rates = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = ray.get([a.generate.remote(c, gen) for a, c in zip(actors, split_evenly(items, workers))])
            dt = time.perf_counter() - t0
            rates.append(sum(r.num_tokens for chunk in outs for r in chunk) / dt)
        results[workers] = median(rates)
        for a in actors:
            ray.kill(a)
    rows = [[w, f"{results[w]:.0f}", f"{results[w] / results[1]:.2f}x"] for w in (1, 2)]
    print(table(rows, ["generator workers", "median tokens/s", "vs 1 worker"]))
    print(f"{args.prompts} prompts x {args.n} samples, up to {args.max_new_tokens} new tokens, "
          f"median of {args.repeats} runs, 1 torch thread per worker")


if __name__ == "__main__":
    main()
