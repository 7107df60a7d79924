"""GPU check: what only a GPU runs, measured against fp32 on the CPU. Needs neither Ray nor vLLM.

Run:  python benchmarks/gpu_check.py [--model tiny|smollm2|DIR] [--write docs/benchmarks.md]

It drives the actor classes directly, as one process, on this machine's device (CUDA when
there is one, else the CPU, where it is CI's smoke test and every gap is ~0):

1. a trainer rank (``rl_actors.trainer.TrainerWorker``, a 1-rank DeepSpeed group configured ZeRO-2;
   bf16 and run as ZeRO-1 on a GPU) that hosts its generator (``cluster.generate_on_trainers``): the prompts are
   sampled on the device, with the sampler on the model's device;
2. the same tokens scored in fp32 on the CPU: the gap between the behaviour logprobs the
   generator returned and fp32, and between the trainer's own (bf16) logprobs and fp32;
3. one GRPO step on the trainer (its logged ``mismatch/*`` figures: the generator against the
   trainer, and the truncated importance weight's clip fraction at ``--is-cap``) against the
   same step in fp32 on the CPU (``train_on_batch``): loss, grad norm, and the cosine between
   the two weight updates;
4. the in-memory snapshot a rebuilt trainer group is restored from (``TrainerWorker.snapshot`` /
   ``restore``, issue 22): its seconds and size, the weights after a restore against the
   snapshot's (exact), and a second step made again after the restore against the first time
   it was made (0 where the device's kernels are deterministic).

With ``--lora RANK`` the trainer rank trains LoRA adapters (``model.lora``, every linear layer) and
holds the reference as its own module with the adapters off: the step is compared with the same
adapters trained in fp32 on the CPU, and the reference's logprobs with the fp32 base model's.

``--write FILE`` appends the table, dated and naming the device, to FILE (docs/benchmarks.md).
On a lent GPU machine (no Ray, vLLM or SmolLM2 there: the GGUF is larger than what travels),
``--model tiny --hidden 576 --layers 12`` builds a random model of SmolLM2's width and depth.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import publish  # noqa: E402

from primitives.env.rewards import score_rollouts  # noqa: E402
from primitives.fixtures.tasks import (  # noqa: E402
    ArithmeticTaskSpec,
    arithmetic_reward,
    chat_arithmetic_items,
    chat_arithmetic_reward,
    make_arithmetic_task,
)
from primitives.maths.algorithms import grpo  # noqa: E402
from primitives.maths.batching import make_batch  # noqa: E402
from primitives.model.logprobs import rollout_logprobs  # noqa: E402
from primitives.model.lora import with_lora  # noqa: E402
from primitives.model.training import train_on_batch  # noqa: E402
from primitives.types import GenerationConfig, LoraConfig, ModelConfig  # noqa: E402


def step_parser(doc: str) -> argparse.ArgumentParser:
    """The flags both GPU benchmarks take: the model and its shape, and the step's rollouts."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (built here), smollm2 (the embedded one) or an HF directory")
    p.add_argument("--hidden", type=int, default=128, help="hidden size of a tiny model")
    p.add_argument("--layers", type=int, default=3, help="layers of a tiny model")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--write", default="", help="append the dated table to this markdown file")
    return p


def parse(argv=None):
    p = step_parser(__doc__)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--is-cap", type=float, default=2.0, help="the truncated importance weight's cap")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    return p.parse_args(argv)


def model_dir(args, scratch: str) -> tuple:
    """``(directory, chat?)`` of the model to check."""
    if args.model == "tiny":
        from primitives.fixtures.tiny import TinyModelSpec, save_tiny_model

        heads = max(2, args.hidden // 64)
        spec = TinyModelSpec(hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                             num_attention_heads=heads, num_key_value_heads=max(1, heads // 3))
        return save_tiny_model(os.path.join(scratch, "tiny"), spec, seed=0), False
    if args.model == "smollm2":
        from primitives.fixtures.pretrained import save_smollm2

        return save_smollm2(os.path.join(os.path.expanduser("~/.cache/rayrl"), "smollm2-135m-instruct")), True
    return os.path.abspath(args.model), True


def trainer_rank(path: str, lr: float, lora: LoraConfig = LoraConfig(), micro_batch_size: int = 16,
                 zero_stage: int = 2):
    """A 1-rank trainer group (ZeRO-2 unless told) on this process's device, hosting its generator;
    with LoRA it also holds the reference (its module with the adapters off)."""
    from rl_actors.trainer import TrainerConfig, TrainerWorker
    from rl_actors.weight_sync import free_port

    cfg = TrainerConfig(zero_stage=zero_stage, lr=lr, micro_batch_size=micro_batch_size, max_grad_norm=1.0)
    trainer = TrainerWorker(ModelConfig(path, lora=lora), 0, 1, cfg, seed=0, num_threads=torch.get_num_threads(),
                            host_generator=True, reference=lora.enabled)
    trainer.setup("127.0.0.1", free_port("127.0.0.1"))
    return trainer


def gap(a_list, b_list) -> tuple:
    """``(mean |a - b|, max |a - b|)`` over every token of per-rollout arrays."""
    d = np.abs(np.concatenate(a_list) - np.concatenate(b_list))
    return float(d.mean()), float(d.max())


def update_cosine(before: dict, after: dict, ref_before: dict, ref_after: dict) -> float:
    """Cosine between the two weight updates (all parameters as one vector)."""
    u = np.concatenate([(after[n] - before[n]).ravel() for n in before])
    v = np.concatenate([(ref_after[n] - ref_before[n]).ravel() for n in before])
    return float(u @ v / max(np.linalg.norm(u) * np.linalg.norm(v), 1e-30))


def check(args) -> dict:
    """The check, its model saved in a temporary directory removed after."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        return _check(args, scratch)


def _check(args, scratch: str) -> dict:
    from transformers import AutoModelForCausalLM

    path, chat = model_dir(args, scratch)
    lora = LoraConfig(rank=args.lora)
    trainer = trainer_rank(path, args.lr, lora)
    info = trainer.info()
    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=args.prompts, num_heldout=1, seed=0))[0]
    task_reward = arithmetic_reward
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, n=args.group)
    if chat:
        items, task_reward = chat_arithmetic_items(items), chat_arithmetic_reward
        im_end = trainer.tokenizer.convert_tokens_to_ids("<|im_end|>")
        gen = gen._replace(stop_token_ids=(im_end,) if isinstance(im_end, int) and im_end >= 0 else ())
    device = str(trainer.ds.device)

    t0 = time.perf_counter()
    rollouts = trainer.generate(items, gen)
    generate_s = time.perf_counter() - t0
    # the task's reward plus a little that varies with the sampled tokens, so that groups have
    # spread (a random model never gets a sum right) and the step has a gradient
    rollouts = score_rollouts(rollouts, lambda r: task_reward(r) + 0.1 * (int(r.completion_ids.sum()) % 3))
    tokens = sum(r.num_tokens for r in rollouts)

    cpu = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = trainer.tokenizer.pad_token_id
    fp32 = rollout_logprobs(cpu, rollouts, pad, args.temperature)
    trainer_logp = trainer.logprobs(rollouts, args.temperature)
    behaviour_gap = gap([r.logprobs for r in rollouts], fp32)
    trainer_gap = gap(trainer_logp, fp32)
    lora_figures = {}
    if lora.enabled:  # the reference is the base (adapters off); the CPU model takes the rank's starting adapters
        lora_figures["reference_vs_fp32_base_max"] = gap(trainer.reference_logprobs(rollouts, args.temperature),
                                                         fp32)[1]
        cpu = with_lora(cpu, lora)
        cpu.load_state_dict({k: torch.from_numpy(v) for k, v in trainer.full_state().items() if ".reference." not in k},
                            strict=False)

    algo = grpo(kl_coef=0.0, is_cap=args.is_cap)
    batch = make_batch(rollouts, algo, pad, budget=args.max_new_tokens)
    ref_before = {n: p.detach().numpy().copy() for n, p in cpu.named_parameters()}
    before = {n: v for n, v in trainer.full_state().items() if n in ref_before}
    t0 = time.perf_counter()
    step = trainer.train_step(batch, algo, args.temperature)[0]
    train_s = time.perf_counter() - t0
    after = trainer.full_state()
    opt = torch.optim.AdamW([p for p in cpu.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    ref = train_on_batch(cpu, opt, batch, algo, args.temperature, max_grad_norm=1.0, micro_batch_size=16)[0]
    ref_after = {n: p.detach().numpy().copy() for n, p in cpu.named_parameters()}

    snap = snapshot_round_trip(trainer, batch, algo, args.temperature)
    return {
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name() if "cuda" in device
        else f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__, "bf16": info["bf16"],
        "model": f"{args.model} ({sum(v.size for v in before.values()) / 1e6:.2f}M parameters"
                 f"{f', LoRA rank {lora.rank}' if lora.enabled else ''})",
        "rollouts": len(rollouts), "tokens": tokens, "sampler_device": device,
        "generate_tokens_per_s": tokens / generate_s, "train_step_s": train_s,
        "behaviour_vs_fp32_mean": behaviour_gap[0], "behaviour_vs_fp32_max": behaviour_gap[1],
        "trainer_vs_fp32_mean": trainer_gap[0], "trainer_vs_fp32_max": trainer_gap[1],
        "mismatch/k3": step["mismatch/k3"], "mismatch/max_abs_logp_diff": step["mismatch/max_abs_logp_diff"],
        "mismatch/is_weight_mean": step["mismatch/is_weight_mean"],
        "mismatch/is_clipped_frac": step["mismatch/is_clipped_frac"],
        "loss/policy": step["loss/policy"], "loss/policy fp32 cpu": ref["loss/policy"],
        "grad_norm": step["grad_norm"], "grad_norm fp32 cpu": ref["grad_norm"],
        "update_cosine_vs_fp32_cpu": update_cosine(before, after, ref_before, ref_after), **lora_figures, **snap,
    }


def _max_diff(a: dict, b: dict) -> float:
    return max(float(np.abs(a[n].astype(np.float64) - b[n]).max()) for n in a)


def snapshot_round_trip(trainer, batch, algo, temperature: float) -> dict:
    """Snapshot the trained rank, make a second step, restore the snapshot (the weights must be
    the snapshot's exactly) and make the second step again (the same weights where the kernels
    are deterministic)."""
    t0 = time.perf_counter()
    nbytes, part = trainer.snapshot()
    snapshot_s = time.perf_counter() - t0
    at_snapshot = trainer.full_state()
    trainer.train_step(batch, algo, temperature)
    second = trainer.full_state()
    t0 = time.perf_counter()
    trainer.restore(part)
    restore_s = time.perf_counter() - t0
    restored = trainer.full_state()
    trainer.train_step(batch, algo, temperature)
    return {"snapshot_s": snapshot_s, "snapshot_mb": nbytes / 2 ** 20, "restore_s": restore_s,
            "restored_vs_snapshot_max": _max_diff(at_snapshot, restored),
            "step_again_vs_first_max": _max_diff(second, trainer.full_state())}


def report(fig: dict) -> str:
    """The figures as a dated markdown section."""
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    head = (f"### GPU check ({fig['date']}, {fig['device']}, torch {fig['torch']}, bf16 {fig['bf16']})\n\n"
            f"`python benchmarks/gpu_check.py`: {fig['model']}, {fig['rollouts']} rollouts, {fig['tokens']} tokens, "
            f"generated on the trainer rank (sampler on {fig['sampler_device']}).\n\n")
    skip = {"date", "device", "torch", "bf16", "model", "rollouts", "tokens", "sampler_device"}
    rows = [f"| {k} | {fmt(v)} |" for k, v in fig.items() if k not in skip]
    return head + "| figure | value |\n|---|---|\n" + "\n".join(rows) + "\n"


def main(argv=None) -> dict:
    args = parse(argv)
    fig = check(args)
    text = report(fig)
    publish(text, args.write)
    return fig


if __name__ == "__main__":
    main()
