"""Padded vs packed scoring of completions (sequence packing, primitives/model/packing.py), in one process.

Run:  flock /tmp/heavy.lock .venv/bin/python benchmarks/bench_padding.py [--repeats 5] [--threads 1]
      [--regime tiny|smollm2|both] [--completions sampled|uniform|both] [--device cpu|cuda]
      [--dtype float32|bfloat16] [--random-smollm2]

Two regimes, each with the lengths of its job:

* tiny: the default job (examples/configs/default.yaml): the embedded tiny Qwen2 (random init,
  default size), 32 prompts "23+48=" (6 tokens) x 8 completions of 1-5 tokens (uniform: the
  SFT'd model answers in 2-4, RL sees all), micro-batches of 64 rows.
* smollm2: examples/configs/smollm2_arithmetic.yaml: SmolLM2-135M-Instruct (embedded, converted
  once into $RAYRL_MODEL_CACHE or ~/.cache/rayrl; with --random-smollm2 a random Llama of its
  config, for timings only), 4 chat-templated questions x 8 completions, micro-batches of 16
  rows. Completions "sampled": from the model at T = 1 with max_new_tokens = 16, as at the
  start of the run (it mostly restates the sum: long); "uniform": 1-16 tokens, as later when
  some answers shrink to the number alone.

For each, four ways to score the same batch: "padded, full logits" (as before packing: the
lm head on every position), "padded" (logits only where they predict a completion token),
"packed, prompts apart" (every row's prompt in the forward) and "packed" (a group's prompt
once, under a tree mask). It prints the tokens each forward runs (real = every prompt and completion token),
forward_backward (the trainer's step, GRPO loss with entropy) and rollout_logprobs (the
reference's scoring) in ms, the median of --repeats runs after one warm-up, and the ratio to
"padded". torch uses --threads threads (default 1).
"""
import argparse
import os
import sys
import time

import numpy as np
from common import ROOT, median, table  # noqa: F401  (ROOT puts the checkout on sys.path)


def tiny_regime(rows: int, seed: int = 0):
    """(model, tokenizer, rollouts, micro_batch_size) with the default job's shapes."""
    from primitives.fixtures.tasks import make_arithmetic_task
    from primitives.fixtures.tiny import build_char_tokenizer, build_tiny_model
    from primitives.model.prompts import encode_prompts

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=seed)
    prompts = encode_prompts(tok, [it.prompt for it in make_arithmetic_task()[0][: rows // 8]])
    rng = np.random.default_rng(seed)
    completions = [rng.integers(0, 20, rng.integers(1, 6)) for _ in range(rows)]
    return model, tok, _rollouts([prompts[i // 8] for i in range(rows)], completions, rng), 64


def smollm2_regime(rows: int, random_weights: bool, completions: str, seed: int = 0):
    """(model, tokenizer, rollouts, micro_batch_size) of smollm2_arithmetic.yaml."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primitives.fixtures.pretrained import save_smollm2
    from primitives.fixtures.tasks import ArithmeticTaskSpec, chat_arithmetic_items, make_arithmetic_task
    from primitives.model.generation import generate_tokens
    from primitives.model.prompts import encode_prompts
    from primitives.types import GenerationConfig

    path = save_smollm2(os.path.expanduser(os.path.join(os.environ.get("RAYRL_MODEL_CACHE") or "~/.cache/rayrl",
                                                        "smollm2-135m-instruct")))
    tok = AutoTokenizer.from_pretrained(path)
    if random_weights:
        from transformers import AutoConfig

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    items = chat_arithmetic_items(make_arithmetic_task(ArithmeticTaskSpec(max_operand=99, num_train=rows // 8,
                                                                          num_heldout=1, seed=seed))[0])
    prompts = [p for p in encode_prompts(tok, [it.prompt for it in items]) for _ in range(8)]
    rng = np.random.default_rng(seed)
    if completions == "uniform":
        return model, tok, _rollouts(prompts, [rng.integers(10, 1000, rng.integers(1, 17)) for _ in prompts], rng), 16
    gen = GenerationConfig(max_new_tokens=16, temperature=1.0,
                           stop_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),))
    with torch.no_grad():
        outs = generate_tokens(model, tok, prompts, gen, generator=torch.Generator().manual_seed(seed))
    return model, tok, _rollouts(prompts, [o.completion_ids for o in outs], rng), 16


def _rollouts(prompts, completions, rng):
    from primitives.types import Rollout

    return [Rollout(uid=f"e0/i{i // 8}/s{i % 8}", group=f"e0/i{i // 8}", prompt="", prompt_ids=np.asarray(p),
                    completion_ids=np.asarray(c, np.int64), loss_mask=np.ones(len(c), np.float32),
                    logprobs=np.full(len(c), -1.0, np.float32), reward=float(rng.integers(0, 2)))
            for i, (p, c) in enumerate(zip(prompts, completions))]


VARIANTS = ("padded, full logits", "padded", "packed, prompts apart", "packed")


def _set_variant(name: str):
    """Route ``completion_logprobs`` to one way of scoring (the library chooses by itself)."""
    import primitives.model.logprobs as lp

    lp.PACK_MIN_SHARE = 0.0 if name.startswith("packed") else float("inf")
    lp.takes_logits_to_keep = (lambda model: False) if name == "padded, full logits" else _TAKES
    share = name != "packed, prompts apart"
    lp.plan_for = lambda model, ids, mask, prompt_len, *_: _PLAN_FOR(model, ids, mask, prompt_len, share)


def forward_tokens(model, batch, micro: int, variant: str) -> int:
    """Tokens the forward passes over ``batch`` run, in micro-batches of ``micro`` rows."""
    from primitives.model.packing import plan_for

    total = 0
    for s in range(0, batch.size, micro):
        ids, mask = batch.input_ids[s: s + micro], batch.attention_mask[s: s + micro]
        share = variant == "packed"
        total += plan_for(model, ids, mask, batch.prompt_len, share).num_tokens if variant.startswith("packed") \
            else ids.size
    return total


def _ms(fn, repeats: int, sync) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1000)
    return median(times)


def run_regime(name, model, tok, rollouts, micro, repeats, device, dtype):
    import torch

    from primitives.maths import algorithms as algos
    from primitives.maths.batching import make_batch
    from primitives.model.logprobs import rollout_logprobs
    from primitives.model.training import forward_backward, step_counts

    model.to(device=device, dtype=getattr(torch, dtype))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    algo = algos.grpo(kl_coef=0.0)._replace(entropy_coef=0.001)
    batch = make_batch(rollouts, algo, tok.pad_token_id, budget=max(len(r.completion_ids) for r in rollouts))
    counts = step_counts(batch)
    real = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    lengths = [len(r.completion_ids) for r in rollouts]
    print(f"\n{name}: {batch.size} rows, micro-batches of {micro}; prompts {min(len(r.prompt_ids) for r in rollouts)}-"
          f"{max(len(r.prompt_ids) for r in rollouts)} tokens, completions {min(lengths)}-{max(lengths)} "
          f"(mean {np.mean(lengths):.1f}); padded width {batch.input_ids.shape[1]} (P = {batch.prompt_len})")

    def train():
        forward_backward(model, batch, algo, counts, micro_batch_size=micro, temperature=1.0)
        model.zero_grad(set_to_none=True)

    def reference():
        rollout_logprobs(model, rollouts, tok.pad_token_id, 1.0, micro)

    results = {}
    for variant in VARIANTS:
        _set_variant(variant)
        model.train()
        fb = _ms(train, repeats, sync)
        model.eval()
        ref = _ms(reference, repeats, sync)
        results[variant] = (forward_tokens(model, batch, micro, variant), fb, ref)
    base = results["padded"]
    print(table([[v, f"{real} / {t}", f"{fb:.1f}", f"{base[1] / fb:.2f}x", f"{ref:.1f}", f"{base[2] / ref:.2f}x"]
                 for v, (t, fb, ref) in results.items()],
                ["variant", "tokens real / in forward", "fwd+bwd ms", "speed-up", "ref fwd ms", "speed-up"]))
    from primitives.model.packing import padding_share

    for share in (False, True):
        shares = [padding_share(batch.input_ids[s: s + micro], batch.attention_mask[s: s + micro], batch.prompt_len,
                                share) for s in range(0, batch.size, micro)]
        print(f"share of padded tokens packing leaves out ({'shared prompts' if share else 'prompts apart'}), per "
              f"micro-batch: {', '.join(f'{x:.2f}' for x in shares)}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="timed runs; the median is reported")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--regime", choices=["tiny", "smollm2", "both"], default="both")
    p.add_argument("--rows", type=int, default=0, help="rows (default: the job's: 256 tiny, 32 smollm2)")
    p.add_argument("--completions", choices=["sampled", "uniform", "both"], default="both",
                   help="smollm2 completion lengths: sampled from the model, or uniform 1-16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--random-smollm2", action="store_true", help="a random Llama of SmolLM2's config")
    args = p.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), device {args.device}, {args.dtype}, "
          f"median of {args.repeats} after a warm-up")
    if args.regime in ("tiny", "both"):
        run_regime("tiny (default job)", *tiny_regime(args.rows or 256), args.repeats, args.device, args.dtype)
    if args.regime in ("smollm2", "both"):
        for completions in (["sampled", "uniform"] if args.completions == "both" else [args.completions]):
            regime = smollm2_regime(args.rows or 32, args.random_smollm2, completions)
            weights = "random weights" if args.random_smollm2 else "pretrained"
            run_regime(f"SmolLM2-135M (smollm2_arithmetic.yaml, {weights}), completions {completions}", *regime,
                       args.repeats, args.device, args.dtype)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    import primitives.model.logprobs as _lp

    _TAKES = _lp.takes_logits_to_keep
    _PLAN_FOR = _lp.plan_for
    main()
