"""Multi-turn tool use on a local Ray cluster: a calculator and a sandboxed Python tool.

Run:   python examples/tool_use.py                 (SFT warm-up, then RL: about 4 minutes on 2 cores)
       python examples/tool_use.py --help          (all flags)

What it shows (the seeds' "tool call tracking with multi-turn rollouts"):

1. A short supervised warm-up, in this process, teaches the untrained tiny model the call
   format. In the demonstrations the user asks ``What is 37*46?``, the assistant writes
   ``<tool_call name="calc">{"expression": "37*46"}</tool_call>``, the tool answers ``1702``
   and the assistant says ``1702``; for ``Run 37*46 in Python.`` it calls the python tool
   with ``{"code": "print(37*46)"}``.
2. GRPO on Ray with ``tools=ToolConfig(executor, parse_xml_tool_calls, max_turns=3)``: the
   generators run each conversation turn by turn and execute the calls. The calculator
   walks the expression's syntax tree (never ``eval``); Python runs in a bubblewrap sandbox
   (``primitives.env.sandbox``). Tool output tokens are part of the rollout but not of the loss
   (loss mask 0, logprob 0): ``mismatch/max_abs_logp_diff`` ~ 0 shows that the trainers
   scored exactly the generator's policy tokens. Logged every step: ``tools/calls_per_rollout``,
   ``tools/success_rate``, ``tools/rollouts_with_calls``.
3. Each ``Rollout`` keeps the conversation with its roles (user, assistant, tool) in
   ``metadata["conversation"]``, after the prompt item's own metadata (here ``source_id``).
   After training a few held-out prompts are answered greedily and written to samples.jsonl: token
   ids, loss mask, logprobs and metadata.

The reward is 1 when the last assistant message is the right number. A hundred or two SFT
steps teach the call format; copying the operands into the call and the tool's answer into
the reply comes later (here after about 600 steps, when the SFT loss drops from about 0.3
to 0.02), so with the default 1000 steps RL starts from a reward near 0.5 (measured: SFT
3.2 minutes, then 10 RL steps at about 1 s each). If bubblewrap cannot run on this
machine, the python tool is left out (the reason is printed and written to summary.json).
Writes to --out: metrics.jsonl, summary.json, samples.jsonl, curves.png, sft_model/.
"""
from __future__ import annotations

import argparse
import operator
import os
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.loop.train import Hooks, RLRun, collect, train  # noqa: E402
from cluster.ray_wing.backend import RayBackend  # noqa: E402
from cluster.ray_wing.config import ClusterConfig  # noqa: E402
from cluster.ray_wing.roles import build_rl_cluster, ray_left_as_found, shutdown_cluster  # noqa: E402
from primitives.env.tools import (  # noqa: E402
    SandboxUnavailable,
    ToolConfig,
    calculator_tool,
    create_tool_executor,
    parse_xml_tool_calls,
    python_tool,
    run_python_sandboxed,
)
from primitives.fixtures.tasks import tool_answer_reward, tool_demonstration, tool_items  # noqa: E402
from primitives.fixtures.tiny import IM_END, save_tiny_model  # noqa: E402
from primitives.io.checkpoint import save_checkpoint  # noqa: E402
from primitives.io.data import collate_sft, make_prompt_source, prepare_sft_chat  # noqa: E402
from primitives.io.evaluation import write_jsonl_atomic  # noqa: E402
from primitives.io.loggers import mean_of, plot_curves, run_logger, write_summary  # noqa: E402
from primitives.io.outputs import output_dir  # noqa: E402
from primitives.maths.algorithms import constant_schedule, grpo  # noqa: E402
from primitives.model.training import linear_warmup, optim_step, sft_forward_backward  # noqa: E402
from primitives.types import GenerationConfig, TrainState  # noqa: E402
from rl_actors.trainer import TrainerConfig  # noqa: E402

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
QUESTIONS = {"calc": "What is {}?", "python": "Run {} in Python."}
CLUSTER = ClusterConfig(generators=1, trainers=2, reward_workers=1, threads_per_actor=1)
PROMPTS_PER_STEP, GROUP_SIZE, LR = 4, 4, 1e-4
SAMPLES = 4  # held-out prompts answered greedily after training, into samples.jsonl


# ----------------------------------------------------------------------------- task, demonstrations, reward
# the task (primitives.fixtures.tasks.tool_arithmetic_task, also data.task: tool_arithmetic in a job file):
# make_items alternates the tools, demonstration is user -> call -> tool result -> answer, and the reward
# is 1 when the last assistant message is the right number
make_items, demonstration, final_answer_reward = tool_items, tool_demonstration, tool_answer_reward


def stop_unless_call_completed(conversation) -> bool:
    """The stop condition: go on to the tools only when the assistant's turn ended with a
    complete call (generation stops at ``</tool_call>``); a turn that ended any other way -
    its own end of message, eos, the token budget - is the final answer."""
    return not conversation.last("assistant").content.endswith("</tool_call>")


def python_tool_status() -> str:
    """"on" when the sandbox runs here, else why not."""
    try:
        run_python_sandboxed("pass")
        return "on"
    except SandboxUnavailable as e:
        return f"skipped: {e}"


# ----------------------------------------------------------------------------- the two stages
def sft_warmup(model, tokenizer, items, args, logger) -> dict:
    """Supervised steps on the demonstrations, loss on the assistant turns only."""
    samples = [prepare_sft_chat(tokenizer, demonstration(it)) for it in items]
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0)
    lr, rng, t0, m = linear_warmup(args.sft_lr, 30), np.random.default_rng(args.seed), time.time(), {}
    for step in tqdm(range(args.sft_steps), desc="sft", unit="step"):
        picked = rng.choice(len(samples), args.sft_batch, replace=False)
        ids, attn, loss_mask = collate_sft([samples[i] for i in picked], tokenizer.pad_token_id)
        for group in opt.param_groups:
            group["lr"] = lr(step)
        m = sft_forward_backward(model, ids, attn, loss_mask, num_tokens=int(loss_mask[:, 1:].sum()))
        m["sft/grad_norm"] = optim_step(model, opt, 1.0)
        if step % 50 == 0 or step == args.sft_steps - 1:
            logger({"step": step, "phase": "sft", **m})
    return {"sft_steps": args.sft_steps, "sft_seconds": round(time.time() - t0, 1),
            "sft_loss_last": round(m.get("loss/sft", float("nan")), 4)}


def sample_record(rollout) -> dict:
    """What the trainer sees of one rollout, JSON-friendly."""
    return {"uid": rollout.uid, "reward": rollout.reward, "completion_ids": rollout.completion_ids.tolist(),
            "loss_mask": rollout.loss_mask.tolist(), "logprobs": rollout.logprobs.tolist(),
            "metadata": rollout.metadata}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/tool_use", help="output directory")
    p.add_argument("--steps", type=int, default=10, help="GRPO steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the task and sampling")
    p.add_argument("--base", default=None,
                   help="start from this HF model directory (the tiny chat tokenizer, e.g. a model already SFT'd on "
                        "the tool task) instead of building the random tiny model")
    p.add_argument("--sft-steps", type=int, default=1000, help="SFT warm-up steps (in this process)")
    p.add_argument("--sft-batch", type=int, default=32, help="demonstrations per SFT step")
    p.add_argument("--sft-lr", type=float, default=3e-3, help="SFT learning rate")
    p.add_argument("--no-python", action="store_true", help="leave the sandboxed python tool out")
    args = p.parse_args(argv)
    if args.base is not None and not os.path.isfile(os.path.join(args.base, "config.json")):
        p.error(f"--base {args.base}: not an HF model directory (no config.json)")
    return args


def main(argv=None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args, start = parse_args(argv), time.time()
    args.out = output_dir(args.out)  # under ray job submit: $RAYRL_OUTPUT_ROOT, not Ray's temporary copy
    torch.manual_seed(args.seed)
    logger, _ = run_logger(args.out, ["loss/sft", "reward/mean", "tools/calls_per_rollout", "tools/success_rate"])
    python = "skipped: --no-python" if args.no_python else python_tool_status()
    tools = {"calc": calculator_tool, **({"python": python_tool} if python == "on" else {})}
    print(f"tools: {sorted(tools)}; python tool: {python}")
    train_items, heldout = make_items(2000, list(tools), args.seed), make_items(64, list(tools), args.seed + 1)

    base = args.base or save_tiny_model(os.path.join(args.out, "base_model"), seed=args.seed)
    tokenizer, model = AutoTokenizer.from_pretrained(base), AutoModelForCausalLM.from_pretrained(base)
    sft = sft_warmup(model, tokenizer, train_items, args, logger)
    sft_path = save_checkpoint(os.path.join(args.out, "sft_model"), model, tokenizer)

    config = ToolConfig(create_tool_executor(tools), parse_xml_tool_calls, stop_unless_call_completed, max_turns=3)
    # a turn ends after a complete call (the tools answer next) or with the end of the assistant's message
    gen = GenerationConfig(max_new_tokens=64, n=GROUP_SIZE, stop=("</tool_call>",),
                           stop_token_ids=(tokenizer.convert_tokens_to_ids(IM_END),))
    with ray_left_as_found():  # a Ray of its own is shut down after; the caller's stays up
        cluster = build_rl_cluster(sft_path, CLUSTER, TrainerConfig(lr=LR), final_answer_reward,
                                   with_reference=False, seed=args.seed)
        backend = RayBackend(cluster)
        try:
            state = train(backend, make_prompt_source(train_items, seed=args.seed),
                          constant_schedule(grpo(kl_coef=0.0)),
                          RLRun(gen, num_steps=args.steps, prompts_per_step=PROMPTS_PER_STEP,
                                lr_schedule=lambda step: LR),
                          state=TrainState(rng_seed=args.seed), hooks=Hooks(logger=logger), tools=config)
            samples, _ = collect(backend, heldout[:SAMPLES], gen._replace(n=1, temperature=0.0), with_ref=False,
                                 tools=config)
        finally:
            shutdown_cluster(backend.cluster)
    write_jsonl_atomic(os.path.join(args.out, "samples.jsonl"), [sample_record(r) for r in samples])
    history = list(state.metrics_history)
    plot_curves(history, ["reward/mean", "tools/calls_per_rollout", "tools/success_rate", "response/len_mean"],
                os.path.join(args.out, "curves.png"), title="GRPO with tools after an SFT warm-up")
    called = [m.get("name") for r in samples for m in r.metadata["conversation"] if m["role"] == "tool"]
    summary = {**sft, "python_tool": python, "rl_steps": args.steps,
               "calls_per_rollout": mean_of(history, "tools/calls_per_rollout"),
               "success_rate": mean_of(history, "tools/success_rate"),
               "reward_mean": mean_of(history, "reward/mean"),
               "sample_tool_calls": {name: called.count(name) for name in tools},
               "seed": args.seed, "wall_s": round(time.time() - start, 1)}
    return write_summary(args.out, summary)


if __name__ == "__main__":
    main()
