"""Generation throughput of a generator engine (HF or vLLM) with 1 vs 2 generator workers.

Run:  python benchmarks/bench_generation.py [--backend hf|vllm --model tiny|smollm2 --prompts 128 --n 8
                                             --max-new-tokens 16 --threads 1 --repeats 5]
The same prompts are split evenly over the workers; tokens/s counts generated tokens. With
``--model smollm2`` the prompts are its chat-formatted additions. Run one engine at a time
(each run has the machine to itself) and compare the printed figures.
"""
import time

from common import bench_parser, median, model_path, start_local_ray, table


def main():
    p = bench_parser(__doc__)
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--backend", choices=("hf", "vllm"), default="hf")
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--threads", type=int, default=1, help="torch (or vLLM OMP) threads per worker")
    args = p.parse_args()
    ray = start_local_ray()
    from cluster.ray_wing.groups import split_evenly
    from primitives.io.data import PromptItem
    from primitives.types import GenerationConfig, ModelConfig, VLLMConfig
    from rl_actors.generator import GeneratorWorker

    path = model_path(args.model)
    if args.model == "tiny":
        items = [PromptItem(i, f"{i % 50:02d}+{(7 * i) % 50:02d}=") for i in range(args.prompts)]
    else:
        from primitives.fixtures.tasks import ArithmeticTaskSpec, chat_arithmetic_items, make_arithmetic_task

        spec = ArithmeticTaskSpec(num_train=args.prompts, num_heldout=1, seed=0)
        items = chat_arithmetic_items(make_arithmetic_task(spec)[0])
    # eos never ends early at temperature 1 on a random model often enough to matter; count real tokens
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, n=args.n)
    results = {}
    for workers in (1, 2):
        remote = ray.remote(num_cpus=1, num_gpus=args.gpus)(GeneratorWorker)
        actors = [remote.remote(ModelConfig(path), r, args.backend, 0, args.threads, VLLMConfig())
                  for r in range(workers)]
        ray.get([a.info.remote() for a in actors])
        ray.get([a.generate.remote(c, gen) for a, c in zip(actors, split_evenly(items[:8], workers))])  # warm-up
        rates, completions = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = ray.get([a.generate.remote(c, gen) for a, c in zip(actors, split_evenly(items, workers))])
            dt = time.perf_counter() - t0
            rates.append(sum(r.num_tokens for chunk in outs for r in chunk) / dt)
            completions.append(sum(len(chunk) for chunk in outs) / dt)
        results[workers] = (median(rates), median(completions))
        for a in actors:
            ray.kill(a)
    rows = [[w, f"{results[w][1]:.1f}", f"{results[w][0]:.0f}", f"{results[w][0] / results[1][0]:.2f}x"]
            for w in (1, 2)]
    print(table(rows, ["generator workers", "median completions/s", "median tokens/s", "vs 1 worker"]))
    print(f"{args.backend} on {args.model}: {args.prompts} prompts x {args.n} samples, up to {args.max_new_tokens} "
          f"new tokens, median of {args.repeats} runs, {args.threads} thread(s) per worker")


if __name__ == "__main__":
    main()
