"""One RL step, ours against a plain PyTorch/HF loop on the same model and the same tokens, phase by
phase, with the machine's floor beside each. Needs neither Ray nor vLLM (it runs on a lent GPU
machine as it is; on the CPU it is CI's smoke test).

Run:  python benchmarks/gpu_step.py [--model tiny|smollm2|DIR] [--hidden 1536 --layers 28] [--write FILE]

In one process, on this machine's device (CUDA when there is one; bf16 there, fp32 on the CPU):

* **generate**: our trainer rank hosting its generator (``rl_actors.trainer.TrainerWorker.generate``:
  the project's sampler, logprobs included) against HF ``model.generate`` of the same prompts, as
  many samples, the same budget and temperature (no logprobs: the least a plain loop needs). Seconds
  per generated token, since the two samplers stop at different tokens.
* **train**: our 1-rank ``train_step`` (ZeRO-2 configured unless ``--zero-stage``: on a GPU bf16
  ZeRO-1, in fp32 stage 0, ``rl_actors.deepspeed_rank.engine_stage``) against a plain loop on a copy of the
  model: micro-batches of the same rows, logprobs of the completion tokens, the PPO-clip GRPO loss
  (seq-mean-token-mean), backward, the gradient clipped, AdamW. Both train on the same ``Batch``
  (the rollouts generated above), so their losses and gradient norms must agree (printed: a
  check that the comparison is of the same work).
* **floor**: the step's FLOPs (``6 N`` per trained token, ``2 N`` per generated or prompt token,
  N the parameters of the matmuls) over the matmul rate measured here, and for decoding also the
  weights read once per decode step (as many steps as the longest completion of that run) over the
  measured memory bandwidth, whichever is more.

The plain loop keeps fp32 weights and Adam state, as DeepSpeed does (on a GPU its passes run under
bf16 autocast; HF ``generate`` runs on a bf16 copy).

Ours and the plain loop run in turn, ``--repeats`` rounds of each phase, so a drift of the
machine's speed slows both alike. Printed: seconds (median of the rounds), ours/plain (train: the
median of each round's ratio) and ours/floor. ``--write`` appends the dated
table to a markdown file (docs/benchmarks.md).
"""
from __future__ import annotations

import copy
import datetime
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import publish  # noqa: E402
from gpu_check import model_dir, step_parser, trainer_rank  # noqa: E402

from primitives.env.rewards import score_rollouts  # noqa: E402
from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task  # noqa: E402
from primitives.maths.algorithms import grpo  # noqa: E402
from primitives.maths.batching import make_batch  # noqa: E402
from primitives.model import static_decode  # noqa: E402
from primitives.model.prompts import encode_prompts  # noqa: E402
from primitives.model.static_decode import decode_mode  # noqa: E402
from primitives.padding import position_ids_from_mask  # noqa: E402
from primitives.types import GenerationConfig  # noqa: E402


def parse(argv=None):
    p = step_parser(__doc__)
    p.add_argument("--micro-batch", type=int, default=16, help="rows per forward/backward pass, both loops")
    p.add_argument("--zero-stage", type=int, default=2, help="our trainer's ZeRO stage (1 rank: fp32 runs 1 and 2 "
                   "without ZeRO, bf16 runs them as ZeRO-1; rl_actors.deepspeed_rank.engine_stage)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per phase; the median is reported")
    p.add_argument("--decode", default="auto", help="our decode loop (GenerationConfig.decode); where it resolves "
                   "to a static cache, HF generate gets one too (compiled on CUDA)")
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _runs(fn, device: torch.device, repeats: int) -> list:
    """``(seconds, result)`` of each of ``repeats`` calls of ``fn``."""
    out = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        result = fn()
        _sync(device)
        out.append((time.perf_counter() - t0, result))
    return out


def _alternate(ours, plain, device: torch.device, repeats: int) -> tuple:
    """``(ours' runs, plain's runs)`` as ``_runs`` gives them, the two called in turn: a machine
    whose speed drifts during the benchmark (this 2-core one moved 8.2 -> 11.2 s for one train
    step within a minute) slows both alike, where timing one after the other would blame one."""
    pairs = [(_runs(ours, device, 1)[0], _runs(plain, device, 1)[0]) for _ in range(repeats)]
    return [a for a, _ in pairs], [b for _, b in pairs]


def _timed(fn, device: torch.device, repeats: int) -> tuple:
    """``(median seconds, last result)`` of ``repeats`` calls of ``fn``."""
    runs = _runs(fn, device, repeats)
    return statistics.median(t for t, _ in runs), runs[-1][1]


def machine_rates(device: torch.device, dtype: torch.dtype) -> tuple:
    """``(matmul FLOP/s, memory bytes/s)`` measured here: the best of a few square matmuls, and a
    256 MB tensor copied (read + write) into one already written, larger than this machine's
    32 MB L3 cache and a data-centre GPU's L2 (tens of MB). Until 2026-11-29 the copy went into
    a new tensor each time, and on the CPU that timed the kernel handing out new pages, not the
    memory: 4.6-8 GB/s where a copy between written tensors moves 24-30 GB/s here."""
    n = 4096 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = min(_timed(lambda: a @ b, device, 1)[0] for _ in range(5))
    big = torch.ones(256 * 2 ** 20 // 4, device=device, dtype=torch.float32)
    into = torch.zeros_like(big)
    into.copy_(big)  # its pages mapped before the clock starts
    copy = min(_timed(lambda: into.copy_(big), device, 1)[0] for _ in range(5))
    return 2 * n ** 3 / best, 2 * big.numel() * 4 / copy


def matmul_params(model) -> int:
    """Parameters that take part in a matmul per token: every Linear weight, and the output
    embedding (the input embedding is a lookup)."""
    return sum(out_f * in_f for out_f, in_f in matmul_shapes(model))


def matmul_shapes(model) -> list:
    """``(out, in)`` of each weight a token is multiplied by (``matmul_params``' weights)."""
    shapes = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    counted = head is not None and any(m is head for m in model.modules() if isinstance(m, torch.nn.Linear))
    return shapes + ([] if counted or head is None else [tuple(head.weight.shape)])


def median_time(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` CPU calls of ``fn`` after one untimed call."""
    fn()
    return _timed(fn, torch.device("cpu"), repeats)[0]


def plain_generate(model, tokenizer, items, gen: GenerationConfig, device: torch.device, static: bool = False) -> int:
    """HF ``generate`` of every prompt ``gen.n`` times (left-padded together), with its static
    cache where ``static`` (which it compiles on CUDA); returns the tokens generated (each row up
    to and with its first end-of-sequence token)."""
    ids = encode_prompts(tokenizer, [it.prompt for it in items])
    width, pad = max(len(x) for x in ids), tokenizer.pad_token_id
    rows = [x for x in ids for _ in range(gen.n)]
    input_ids = torch.tensor(np.stack([np.concatenate([np.full(width - len(x), pad, np.int64), x]) for x in rows]),
                             device=device)
    mask = torch.tensor(np.stack([np.r_[np.zeros(width - len(x), np.int64), np.ones(len(x), np.int64)] for x in rows]),
                        device=device)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=gen.temperature,
                             top_k=0, top_p=1.0, max_new_tokens=gen.max_new_tokens, pad_token_id=pad,
                             **({"cache_implementation": "static"} if static else {}))
    new = out[:, width:]
    ended = new == tokenizer.eos_token_id if tokenizer.eos_token_id is not None else torch.zeros_like(new, dtype=bool)
    lengths = torch.where(ended.any(-1), ended.int().argmax(-1) + 1, torch.full_like(ended[:, 0], new.shape[1],
                                                                                      dtype=torch.long))
    return int(lengths.sum())


def plain_train_step(model, opt, batch, algo, temperature: float, micro_batch: int, max_grad_norm: float,
                     bf16: bool = False) -> dict:
    """One update as a plain loop writes it: per micro-batch, logprobs of the completion tokens at
    the sampling temperature, the clipped surrogate with the step's advantages, each row's token mean
    summed over rows / B, backward; then the gradient clipped and AdamW. The weights and Adam state
    stay fp32; with ``bf16`` the passes run under autocast (as DeepSpeed's bf16 does in spirit)."""
    device = next(model.parameters()).device
    P, B = batch.prompt_len, len(batch)
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for s in range(0, B, micro_batch):
        ids = torch.from_numpy(batch.input_ids[s:s + micro_batch]).to(device)
        am = torch.from_numpy(batch.attention_mask[s:s + micro_batch]).to(device)
        mask = torch.from_numpy(batch.loss_mask[s:s + micro_batch]).to(device)
        adv = torch.from_numpy(batch.advantages[s:s + micro_batch]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am), use_cache=False)
        logits = out.logits[:, P - 1:-1].float() / temperature
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, P:].unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        surrogate = torch.min(ratio * adv, ratio.clamp(1 - algo.clip_eps_low, 1 + algo.clip_eps_high) * adv)
        per_row = -(surrogate * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        loss = per_row.sum() / B
        loss.backward()
        total += float(loss.detach())
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    opt.step()
    return {"loss/policy": total, "grad_norm": norm}


def update_batch(rollouts, pad: int, budget: int) -> tuple:
    """``(scored rollouts, algo, batch)`` of one GRPO update without KL or importance weight, the rollouts
    scored by a reward that varies with the sampled tokens, so that every group has spread and the update a
    gradient."""
    rollouts = score_rollouts(rollouts, lambda r: float(int(r.completion_ids.sum()) % 3))
    algo = grpo(kl_coef=0.0, is_level="off")
    return rollouts, algo, make_batch(rollouts, algo, pad, budget=budget)


def step(args) -> dict:
    """The comparison, its model saved in a temporary directory removed after."""
    with tempfile.TemporaryDirectory(prefix="gpu_step_") as scratch:
        return _step(args, scratch)


def _step(args, scratch: str) -> dict:
    from transformers import AutoModelForCausalLM

    path, _ = model_dir(args, scratch)
    trainer = trainer_rank(path, args.lr, micro_batch_size=args.micro_batch, zero_stage=args.zero_stage)
    device, bf16 = trainer.ds.device, trainer.info()["bf16"]
    dtype = torch.bfloat16 if bf16 else torch.float32
    tokenizer, pad = trainer.tokenizer, trainer.tokenizer.pad_token_id
    # fp32 weights and Adam state as DeepSpeed keeps them; on a GPU the passes run under bf16 autocast
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    loaded = plain.load_state_dict({k: torch.from_numpy(v) for k, v in trainer.full_state().items()}, strict=False)
    if loaded.unexpected_keys or set(loaded.missing_keys) - {"lm_head.weight"}:  # only a tied head may be missing
        raise RuntimeError(f"the plain copy did not take the trainer's weights: {loaded}")
    n_matmul = matmul_params(plain)
    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=args.prompts, num_heldout=1, seed=0))[0]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, n=args.group, decode=args.decode)
    decode = decode_mode(trainer.ds.module, args.decode, device, args.prompts * args.group, args.max_new_tokens)
    flops, bandwidth = machine_rates(device, dtype)

    def decode_floor(rollouts) -> float:  # compute, or the weights read once per decode step, whichever is more
        tokens = sum(len(r.prompt_ids) + r.num_tokens for r in rollouts)
        steps = max(r.num_tokens for r in rollouts)
        return max(2 * n_matmul * tokens / flops, steps * n_matmul * (2 if bf16 else 4) / bandwidth)

    # HF generate on the weights in the run's dtype (a bf16 copy on a GPU)
    gen_model = (plain if dtype == torch.float32 else copy.deepcopy(plain).to(dtype)).eval()
    ours, plain_runs = _alternate(lambda: trainer.generate(items, gen),
                                  lambda: plain_generate(gen_model, tokenizer, items, gen, device,
                                                                 decode in ("static", "captured")),
                                  device, args.repeats)
    rollouts = ours[-1][1]
    kept = trainer.ds.module.__dict__.get(static_decode.STATE, {}).get("cache")  # the static path really ran
    static_shape = "x".join(map(str, kept[0])) if kept else "none"
    ours_per_token = statistics.median(t / max(sum(r.num_tokens for r in out), 1) for t, out in ours)
    plain_per_token = statistics.median(t / max(n, 1) for t, n in plain_runs)

    rollouts, algo, batch = update_batch(rollouts, pad, args.max_new_tokens)
    trained_tokens = int(batch.attention_mask.sum())
    plain.train()
    opt = torch.optim.AdamW(plain.parameters(), lr=args.lr, weight_decay=0.0)
    # the first update of each, from the same weights: their loss and gradient norm must agree
    ours_first = trainer.train_step(batch, algo, 1.0)[0]
    plain_step = lambda: plain_train_step(plain, opt, batch, algo, 1.0, args.micro_batch,  # noqa: E731
                                          trainer.config.max_grad_norm, bf16)
    plain_first = plain_step()
    ours_train, plain_train = _alternate(lambda: trainer.train_step(batch, algo, 1.0), plain_step, device, args.repeats)
    ours_train_s, plain_train_s = (statistics.median(t for t, _ in runs) for runs in (ours_train, plain_train))
    train_ratio = statistics.median(a / b for (a, _), (b, _) in zip(ours_train, plain_train))  # each round's
    train_floor = 6 * n_matmul * trained_tokens / flops
    return {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
        "model": f"{args.model} ({n_matmul / 1e6:.1f}M matmul parameters)",
        "rollouts": len(rollouts), "micro_batch": args.micro_batch, "repeats": args.repeats,
        "zero stage (configured, run)": f"{args.zero_stage}, {trainer.ds.engine.zero_optimization_stage()}",
        "matmul_tflops": flops / 1e12, "memory_gb_s": bandwidth / 1e9,
        "decode": decode, "static cache rows x positions": static_shape,
        "generate ours s": statistics.median(t for t, _ in ours),
        "generate ours tokens": sum(r.num_tokens for r in rollouts),
        "generate plain s": statistics.median(t for t, _ in plain_runs), "generate plain tokens": plain_runs[-1][1],
        "generate ours/plain (s per token)": ours_per_token / plain_per_token,
        "generate floor s": decode_floor(rollouts),
        "generate ours/floor": statistics.median(t / decode_floor(out) for t, out in ours),
        "train ours s": ours_train_s, "train plain s": plain_train_s, "train ours/plain": train_ratio,
        "train floor s": train_floor, "train ours/floor": ours_train_s / train_floor,
        "trained tokens": trained_tokens,
        "first update loss ours": ours_first["loss/policy"],
        "first update loss plain": plain_first["loss/policy"],
        "first update grad_norm ours": ours_first["grad_norm"],
        "first update grad_norm plain": plain_first["grad_norm"],
    }


def report(fig: dict) -> str:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    head = (f"### One step, ours against a plain loop ({fig['date']}, {fig['device']}, torch {fig['torch']}, "
            f"{fig['dtype']})\n\n`python benchmarks/gpu_step.py`: {fig['model']}, {fig['rollouts']} rollouts, "
            f"micro-batch {fig['micro_batch']}, medians of {fig['repeats']}; the matmul rate and memory bandwidth "
            f"measured in the same run.\n\n")
    skip = {"date", "device", "torch", "dtype", "model", "rollouts", "micro_batch", "repeats"}
    rows = [f"| {k} | {fmt(v)} |" for k, v in fig.items() if k not in skip]
    return head + "| figure | value |\n|---|---|\n" + "\n".join(rows) + "\n"


def main(argv=None) -> dict:
    args = parse(argv)
    fig = step(args)
    publish(report(fig), args.write)
    return fig


if __name__ == "__main__":
    main()
