"""GRPO on the embedded tiny model and arithmetic task, on Ray actors (the default job).

Run:   python examples/grpo_tiny.py                   (local Ray on this machine, CPU, ~3 minutes)
       python examples/grpo_tiny.py --help            (every flag, derived from cluster/config.py)
       ray job submit --address http://127.0.0.1:8265 --working-dir . -- python examples/grpo_tiny.py

What runs: 2 generator workers (HF on CPU; vLLM when installed and a GPU is visible), a 2-rank
DeepSpeed ZeRO-2 trainer group, a reward worker and a reference worker. The trainers first
fine-tune the tiny model on imperfect demonstrations (``train_sft``), their weights are
broadcast to the generators and copied to the reference, then GRPO (``train``) runs with
an exact-match reward and a k3 KL penalty. Held-out greedy accuracy is printed before and
after RL; --out receives summary.json, metrics.jsonl, curves.png, samples/ (each evaluation's
completions as JSONL, and pass@4 samples at the end) and final_model/ (HF).

With RAY_ADDRESS set (``ray job submit`` sets it) the job joins that cluster instead of
starting one. Pass ``--model PATH`` for a real model and ``--reward-fn module:function``
for your reward; ``examples/grpo_single_process.py`` is the same loop in one process.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.config import build_parser, load_function, records_from_args, resolve_output_dir, validate  # noqa: E402
from cluster.driver import (  # noqa: E402
    copy_policy_to_reference,
    evaluate,
    gather,
    load_cluster_checkpoint,
    save_cluster_checkpoint,
    sync_weights,
    train,
    train_sft,
)
from cluster.groups import fan_out  # noqa: E402
from cluster.setup import build_rl_cluster, shutdown_cluster  # noqa: E402
from primitives.algorithms import constant_schedule, get_algorithm, uses_reference  # noqa: E402
from primitives.data import make_prompt_source, prepare_sft_text  # noqa: E402
from primitives.loggers import mean_of, plot_curves, run_logger, write_summary  # noqa: E402
from primitives.tasks import ArithmeticTaskSpec, arithmetic_reward, make_arithmetic_task, sft_demonstrations  # noqa: E402
from primitives.tiny import save_tiny_model  # noqa: E402
from primitives.training import linear_warmup  # noqa: E402
from primitives.types import GenerationConfig, TrainState  # noqa: E402
from rl_actors.trainer import TrainerConfig  # noqa: E402

DEFAULT_JOB_KL = 0.01  # GRPO's k3 KL coefficient in the default job (the grpo preset's own is 0.04)
PASS_K = 4  # the final evaluation's samples per held-out item, for pass@k
PHASES = ("time/generate", "time/reward", "time/ref", "time/train", "time/sync", "time/step")
# the learning signal and the generator/trainer gap, summarised as medians over the RL steps
SIGNALS = ("loss/policy", "loss/kl", "kl/ref_k3", "policy/clip_frac", "policy/entropy", "grad_norm",
           "mismatch/k3", "mismatch/max_abs_logp_diff", "mismatch/is_weight_mean", "mismatch/is_clipped_frac")


def parse(argv=None):
    """``(job, cluster, sft, rl, reward_fn, algo)``: every check that needs no Ray, as a clean usage error."""
    parser = build_parser(__doc__.split("\n\n")[0])
    job, cfg, sft, rl = records_from_args(parser.parse_args(argv))
    try:  # inside `ray job submit`, relative paths resolve to persistent storage, --resume like --out
        job = job._replace(out=resolve_output_dir(job.out),
                           resume=resolve_output_dir(job.resume) if job.resume else job.resume)
    except ValueError as e:
        parser.error(str(e))
    if rl.kl_coef is None and rl.algorithm == "grpo":
        rl = rl._replace(kl_coef=DEFAULT_JOB_KL)  # the default job; other presets keep their own KL
    try:
        validate(job, cfg, sft, rl)
        reward_fn = load_function(job.reward_fn) if job.reward_fn else arithmetic_reward  # resolved once, here
        kl = {} if rl.kl_coef is None else {"kl_coef": rl.kl_coef}
        algo = get_algorithm(rl.algorithm, ppo_epochs=rl.ppo_epochs, mini_batches=rl.mini_batches,
                             is_level=rl.is_level, is_cap=rl.is_cap, **kl)
    except ValueError as e:
        parser.error(str(e))
    return job, cfg, sft, rl, reward_fn, algo


def phase_means(history) -> dict:
    return {k.replace("time/", "time_") + "_mean_s": round(float(np.mean([m[k] for m in history if k in m])), 4)
            for k in PHASES if any(k in m for m in history)}


def main(argv=None) -> dict:
    job, cfg, sft, rl, reward_fn, algo = parse(argv)
    start = time.time()
    print(f"writing outputs to {job.out}", flush=True)
    logger, metrics_path = run_logger(job.out, ["loss/sft", "reward/mean", "eval/accuracy", "kl/ref_k3"])

    from transformers import AutoTokenizer

    model_path = job.model or save_tiny_model(os.path.join(job.out, "base_model"), seed=job.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    spec = ArithmeticTaskSpec(num_heldout=job.heldout, carry_error_rate=job.carry_error_rate, seed=job.seed)
    train_items, heldout = make_arithmetic_task(spec)
    demos, wrong_share = sft_demonstrations(train_items, spec)
    samples = [prepare_sft_text(tokenizer, p, c) for p, c in demos]

    with_reference = uses_reference(algo)
    trainer_cfg = TrainerConfig(zero_stage=cfg.zero_stage, lr=sft.sft_lr)
    cluster = build_rl_cluster(model_path, cfg, trainer_cfg, reward_fn, with_reference, seed=job.seed,
                               bucket_mb=rl.sync_bucket_mb)
    try:
        greedy = GenerationConfig(max_new_tokens=rl.max_new_tokens, temperature=0.0, n=1)

        def heldout_eval(c, s) -> dict:
            """Greedy accuracy and mean reward on the held-out set; its samples in samples/step_N.jsonl."""
            m = evaluate(c, heldout, greedy, k=1, step=s.iteration,
                         samples_path=os.path.join(job.out, "samples", f"step_{s.iteration}.jsonl"))
            return {"eval/accuracy": m["eval/accuracy"], "eval/reward_mean": m["eval/reward_mean"]}

        save = lambda c, s: save_cluster_checkpoint(  # noqa: E731
            c, os.path.join(job.out, "checkpoints", f"step_{s.iteration}"), s)
        if job.resume:  # weights, optimizer, reference, data position and versions from the checkpoint
            start_state = load_cluster_checkpoint(cluster, job.resume)
        else:
            train_sft(cluster, samples, sft.sft_steps, sft.sft_batch, linear_warmup(sft.sft_lr, sft.sft_warmup),
                      seed=job.seed, logger=logger)
            sync_weights(cluster, version=0)
            copy_policy_to_reference(cluster)
            gather(fan_out(cluster.trainers, "reset_optimizer", rl.rl_lr), cluster.timeout_s)
            start_state = TrainState(rng_seed=job.seed)
        acc_before = heldout_eval(cluster, start_state)["eval/accuracy"]
        print(f"held-out accuracy {'at the checkpoint' if job.resume else 'after SFT (before RL)'}: "
              f"{acc_before:.3f}", flush=True)

        gen = GenerationConfig(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, n=rl.group_size)
        state, cluster = train(cluster, make_prompt_source(train_items, seed=job.seed), constant_schedule(algo), gen,
                               rl.rl_steps, rl.prompts_per_step, lambda step: rl.rl_lr, start_state, logger,
                               heldout_eval, rl.eval_every or rl.rl_steps, save, rl.checkpoint_every,
                               max_resample_rounds=rl.max_resample_rounds)
        history = list(state.metrics_history[len(start_state.metrics_history):])
        acc_after = history[-1]["eval/accuracy"] if history else acc_before
        print(f"held-out accuracy after {rl.algorithm}: {acc_after:.3f}", flush=True)
        # pass@k: PASS_K samples per held-out item at the sampling temperature (Chen et al. 2021)
        sampled = evaluate(cluster, heldout, gen, k=PASS_K, step=state.iteration, samples_path=os.path.join(
            job.out, "samples", f"pass_at_{PASS_K}_step_{state.iteration}.jsonl"))
        save_cluster_checkpoint(cluster, os.path.join(job.out, "final_model"), state)
    finally:
        shutdown_cluster(cluster)

    rows = [json.loads(line) for line in open(metrics_path)]
    plot_curves(rows, ["loss/sft", "reward/mean", "eval/accuracy", "kl/ref_k3", "policy/entropy", "time/step"],
                os.path.join(job.out, "curves.png"), title=f"SFT, then {rl.algorithm} on Ray (tiny arithmetic task)")
    summary = {
        "accuracy_before_rl": acc_before, "accuracy_after_rl": acc_after,
        "accuracy_gain_points": round(100 * (acc_after - acc_before), 2),
        "algorithm": rl.algorithm, "sft_steps": sft.sft_steps, "rl_steps": rl.rl_steps,
        "sft_wrong_share": round(wrong_share, 4), "generators": cfg.generators, "trainer_ranks": cfg.trainers,
        "zero_stage": cfg.zero_stage, "reference_worker": with_reference, "ray_address": cluster.ray_address,
        "reward_mean_first5": mean_of(history[:5], "reward/mean"),
        "reward_mean_last5": mean_of(history[-5:], "reward/mean"),
        f"eval/pass@{PASS_K}": sampled[f"eval/pass@{PASS_K}"], "eval/pass@1_sampled": sampled["eval/pass@1"],
        "eval/pass_temperature": rl.temperature,
        **phase_means(history),
        "median_over_rl_steps": {k: float(np.median([m[k] for m in history if k in m]))
                                 for k in SIGNALS if any(k in m for m in history)},
        "seed": job.seed, "wall_s": round(time.time() - start, 1), "out": job.out,
    }
    summary = write_summary(job.out, summary)
    print(f"outputs (summary.json, metrics.jsonl, curves.png, samples/, final_model/) are in {job.out}", flush=True)
    return summary


if __name__ == "__main__":
    main()
