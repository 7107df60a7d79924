"""AdamW's step on a model's parameters: torch's CPU default (a loop of ops per tensor), ``foreach``,
and fused (``primitives.model.training.fused_adamw``, what the trainer and critic ranks build).

Run:  python benchmarks/bench_optimizer.py [--model smollm2|tiny --threads 2 --repeats 5]

The same weights and gradients for each; per variant the median seconds of a step (after one
warm-up step) and the largest weight difference from the default after all steps.
"""
import time

import torch
from common import bench_parser, median, model_path, table


def main():
    p = bench_parser(__doc__)
    p.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from primitives.model.training import fused_adamw

    model = AutoModelForCausalLM.from_pretrained(model_path(args.model), dtype=torch.float32)
    start = [p.detach().clone() for p in model.parameters()]
    grads = [torch.randn_like(p) * 1e-3 for p in start]
    variants = {"torch's default (CPU: a loop)": lambda ps: torch.optim.AdamW(ps, lr=1e-5, weight_decay=0.0),
                "foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-5, weight_decay=0.0, foreach=True),
                "fused_adamw": lambda ps: fused_adamw(ps, lr=1e-5, weight_decay=0.0)}
    rows, weights = [], {}
    for name, build in variants.items():
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt, times = build(params), []
        for _ in range(args.repeats + 1):
            for p, g in zip(params, grads):
                p.grad = g
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        weights[name] = params
        first = weights[next(iter(variants))]
        diff = max(float((a - b).abs().max()) for a, b in zip(first, params))
        rows.append([name, f"{1e3 * median(times[1:]):.0f} ms", f"{diff:.1e}"])
    print(f"{len(start)} tensors, {sum(p.numel() for p in start) / 1e6:.1f}M parameters, {args.threads} threads")
    print(table(rows, ["AdamW", "median step", "max |weight - default's|"]))


if __name__ == "__main__":
    main()
