"""The RL job behind ``rayrl rl``: prepare (no Ray), start the roles, the SFT stage, RL with
evaluation, the final pass@k and model, and the summary.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, Optional

from cluster.jobs.config import (
    RLJob,
)
from cluster.jobs.inputs import SFT_MODEL, RLInputs, prepare_rl
from cluster.jobs.outputs import (
    SIGNALS,
    accuracy_figures,
    finish_output,
    medians,
    phase_means,
    process_start_time,
    save_step_checkpoint,
    start_output,
    startup_figures,
)
from cluster.ray_wing.config import oversubscribed, trainer_config
from primitives.io.loggers import mean_of
from primitives.types import ModelConfig


def start_ray_for(job: RLJob, extensions: dict) -> str:
    """Start (or join) the Ray the job's roles need (for every algorithm its schedule may run,
    and its shaping): a local one is sized for them."""
    from cluster.ray_wing.roles import NODE_GROUP_PINS, role_specs, start_ray

    cfg, algos = job.cluster, extensions["algos"]
    with_reference, with_critic = job_needs_reference(algos, extensions["shaping_fn"]), any_needs_values(algos)
    if not (cfg.ray_address or os.environ.get("RAY_ADDRESS")):  # a local Ray: every actor on this machine's cores
        ahead = job.algorithm.max_staleness if any(not a.filters for a in algos) else 0  # filters: one at a time
        warning = oversubscribed(cfg, with_reference, with_critic, ahead, len(os.sched_getaffinity(0)))
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    return start_ray(cfg, role_specs(cfg, with_reference, NODE_GROUP_PINS if cfg.pin_roles else None,
                                     with_critic=with_critic))


def job_needs_reference(algos, shaping_fn=None) -> bool:
    """Whether some step reads reference logprobs: an algorithm's KL or loss, or the shaping."""
    from primitives.maths.algorithms import uses_reference

    return any(uses_reference(a) for a in algos) or bool(getattr(shaping_fn, "needs_reference", False))


def any_needs_values(algos) -> bool:
    from primitives.maths.algorithms import needs_values

    return any(needs_values(a) for a in algos)


def run_rl(job: RLJob) -> dict:
    """The RL job end to end: prepare (no Ray; Ray starts beside the model's loading once
    every value is checked), then actors, SFT stage, RL, evaluation, outputs."""
    run_start = time.time()
    started = []
    try:
        inputs = prepare_rl(job, beside=lambda j, algo: started.append(start_ray_for(j, algo)))
    except BaseException:
        if started:  # a late error (a prompt too long for the model): no Ray left behind
            import ray

            ray.shutdown()
        raise
    job = inputs.job
    start = time.time()
    logger, metrics_path = start_output(job)
    result = train_rl(inputs, logger)
    history, whole = result["history"], result.pop("whole_history")  # this process's steps; the run's
    startup = startup_figures(process_start_time(), run_start + result.pop("sft_stage_s"),
                              result.pop("cluster_started_at"), result.pop("startup"))
    names = [f"reward/{n}" for n in inputs.component_names] if len(inputs.component_names) > 1 else []
    summary = {
        **{k: v for k, v in result.items() if k != "history"},
        "algorithm": job.algorithm.name, "sft_steps": job.sft.steps, "rl_steps": job.algorithm.steps,
        **({"algorithms": list(dict.fromkeys(m["algorithm"] for m in history))} if job.schedule.phases else {}),
        "model": job.model.model_name_or_path, "train_prompts": len(inputs.train_items),
        "eval_prompts": len(inputs.eval_items), **inputs.info,
        "generators": job.cluster.trainers if job.cluster.generate_on_trainers else job.cluster.generators,
        "trainer_ranks": job.cluster.trainers,
        "zero_stage": job.cluster.zero_stage,
        "reward_mean_first5": mean_of(whole[:5], "reward/mean"),  # the run's, a resumed one's from its checkpoint
        "reward_mean_last5": mean_of(whole[-5:], "reward/mean"),
        **phase_means(history), "median_over_rl_steps": medians(history, SIGNALS),
        "seed": job.seed, "wall_s": round(time.time() - start, 1), **startup, "out": job.logging.out,
    }
    keys = ["loss/sft", "reward/mean", "eval/accuracy", *names, "kl/ref_k3", "policy/entropy", "time/step"]
    model_name = os.path.basename(job.model.model_name_or_path.rstrip("/"))
    return finish_output(job, metrics_path, keys, f"{job.algorithm.name} on Ray ({model_name})", summary)


def sampling_config(g, template_kwargs: Optional[dict]):
    """The ``GenerationConfig`` of the ``generation`` section (n = the group size)."""
    from primitives.types import GenerationConfig

    return GenerationConfig(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                            top_k=g.top_k, n=g.group_size, stop=tuple(g.stop), template_kwargs=template_kwargs,
                            decode=g.decode, max_batch_rows=g.max_batch_rows)


def train_sft_stage(backend, inputs: RLInputs, logger) -> None:
    """The SFT stage's updates (``sft`` section) on ``backend``'s trainer group, logged as ``phase: sft``."""
    from cluster.loop.sft import SFTRun, train_sft
    from cluster.loop.train import Hooks
    from primitives.model.training import linear_warmup

    sft = inputs.job.sft
    train_sft(backend, inputs.sft_samples,
              SFTRun(sft.steps, sft.batch, linear_warmup(sft.lr, sft.warmup), seed=inputs.job.seed),
              Hooks(logger=logger, eval_every=sft.eval_every or sft.steps), eval_samples=inputs.sft_eval_samples)


def sft_stage(backend, inputs: RLInputs, logger) -> None:
    """The RL job's SFT stage on the RL cluster's trainers: train, send the weights to the generators,
    make them the reference, and give the trainers a fresh optimizer at the RL learning rate. With
    ``model.lora`` the adapters train, and RL goes on from them. A trainer rank that dies in the SFT
    steps is recovered as in RL (``backend`` keeps the snapshot and the steps since)."""
    from cluster.ray_wing.groups import fan_out, gather
    from cluster.ray_wing.weights import copy_policy_to_reference, sync_weights

    train_sft_stage(backend, inputs, logger)
    cluster = backend.cluster  # the trainer group as it is now (rebuilt, if a rank died)
    sync_weights(cluster, version=0, move_reference=False)
    copy_policy_to_reference(cluster)
    gather(fan_out(cluster.trainers, "reset_optimizer", inputs.job.algorithm.lr), cluster.timeout_s)
    backend.state_changed()  # the reference copy and the new optimizer are no update the log replays


def full_weight_sft_stage(inputs: RLInputs, logger) -> RLInputs:
    """The SFT stage of a job whose RL trains adapters, training every weight (``sft.full_weights``): a
    trainer group of its own, without adapters, trains as the SFT job does and saves ``<out>/sft_model``,
    and is gone before RL's cluster starts. Returns ``inputs`` with that model (its ``hf/``) as the job's
    model, so RL's adapters start on it (``B`` zero: the SFT'd policy) and RL's reference, the adapters
    off, is the SFT'd policy."""
    from cluster.ray_wing.backend import job_backend
    from cluster.ray_wing.roles import build_sft_cluster, shutdown_cluster
    from primitives.types import LoraConfig, TrainState

    job = inputs.job
    trainer_cfg = trainer_config(job.cluster, job.sft.lr)
    backend = job_backend(build_sft_cluster(job.model._replace(lora=LoraConfig()), job.cluster, trainer_cfg,
                                            seed=job.seed), job.cluster)
    path = os.path.join(job.logging.out, SFT_MODEL)
    try:
        train_sft_stage(backend, inputs, logger)
        backend.save(path, TrainState())
    finally:  # the group as it ended (rebuilt, if a rank died)
        shutdown_cluster(backend.cluster, keep=sys.exc_info()[0] is None)  # a failed run's actors are not kept
    print(f"SFT stage trained every weight ({path}); RL trains adapters on it", flush=True)
    model = job.model._replace(model_name_or_path=os.path.join(path, "hf"))
    return inputs._replace(job=job._replace(model=model))


def with_critic(backend, inputs: RLInputs, with_sft: bool):
    """Add the critic group for an algorithm whose advantage reads values (PPO), initialised
    from the policy as it stands (after an SFT stage: its saved HF copy) or a reward model."""
    from cluster.ray_wing.roles import add_critics
    from primitives.types import TrainState

    job, cfg, algo = inputs.job, inputs.job.cluster, inputs.job.algorithm
    model = job.model
    if with_sft and algo.critic_init == "policy":
        sft_copy = os.path.join(job.logging.out, SFT_MODEL)
        if not job.sft.save:  # else the SFT stage's model is saved there already
            backend.save(sft_copy, TrainState())
        model = ModelConfig(os.path.join(sft_copy, "hf"), job.model.dtype, job.model.device,
                            job.model.trust_remote_code, job.model.attn_implementation)
    critic_cfg = trainer_config(cfg, algo.critic_lr or algo.lr)
    backend.cluster = add_critics(backend.cluster, model, cfg, critic_cfg, algo.critic_init, job.seed)
    backend.state_changed()  # a snapshot taken before holds no critic


def trainer_memory(cluster) -> dict:
    """The largest peak memory of any trainer rank (MiB) and what the ranks train: every weight, or
    the adapters (``model.lora``), with the frozen parameters beside them."""
    from cluster.ray_wing.groups import fan_out, gather

    ranks = gather(fan_out(cluster.trainers, "memory"), cluster.timeout_s)
    out = {"trainer_peak_rss_mb": round(max(r["peak_rss_mb"] for r in ranks), 1),
           "trained_params": ranks[0]["trained_params"], "frozen_params": ranks[0]["frozen_params"]}
    if "peak_cuda_mb" in ranks[0]:
        out["trainer_peak_cuda_mb"] = round(max(r["peak_cuda_mb"] for r in ranks), 1)
    return out


def start_rl_backend(inputs: RLInputs, with_sft: bool):
    """The RL cluster of the job, its trainers at the SFT stage's learning rate when one runs first, behind
    a ``RayBackend`` with the job's recovery settings."""
    from cluster.ray_wing.backend import job_backend
    from cluster.ray_wing.roles import build_rl_cluster

    job, cfg = inputs.job, inputs.job.cluster
    algos = inputs.algos or (inputs.algo,)
    trainer_cfg = trainer_config(cfg, job.sft.lr if with_sft else job.algorithm.lr)
    cluster = build_rl_cluster(job.model, cfg, trainer_cfg, inputs.reward_fn,
                               job_needs_reference(algos, inputs.shaping_fn), ref_update_fn=inputs.ref_update_fn,
                               aggregate_fn=inputs.aggregate_fn, shaping_fn=inputs.shaping_fn, seed=job.seed,
                               bucket_mb=cfg.sync_bucket_mb, reserve_critics=any_needs_values(algos))
    return job_backend(cluster, cfg)


def rl_evaluator(inputs: RLInputs, gen) -> Callable:
    """``run_eval(backend, state, gen=the eval sampling, k=eval.k, name="step") -> metrics``: held-out
    accuracy (and pass@k), its samples written to ``<out>/samples/<name>_<step>.jsonl``."""
    from cluster.loop.evaluate import evaluate

    job, ev = inputs.job, inputs.job.eval
    names = component_names(inputs)
    tools = inputs.tools.config if inputs.tools is not None else None
    eval_gen = gen._replace(temperature=ev.temperature, n=ev.k, top_p=1.0, top_k=0)

    def run_eval(backend, state, run_gen=eval_gen, k=ev.k, name="step") -> dict:
        return evaluate(backend, inputs.eval_items, run_gen, k=k, correct=ev.threshold, step=state.iteration,
                        component_names=names, tools=tools,
                        samples_path=os.path.join(job.logging.out, "samples", f"{name}_{state.iteration}.jsonl"))

    return run_eval


def component_names(inputs: RLInputs):
    """The reward's labels, logged as ``reward/<label>``, when it has more than one component."""
    return inputs.component_names if len(inputs.component_names) > 1 else None


def before_rl(backend, inputs: RLInputs, logger, with_sft: bool) -> tuple:
    """What comes before the first RL step on the RL cluster: the SFT stage (its model kept with
    ``sft.save``), the critic group, the checkpoint to resume from, the first snapshot. Returns the
    state RL starts from and the seconds spent training (SFT), which are not start-up."""
    from primitives.types import TrainState

    job, t0, trained = inputs.job, time.time(), 0.0
    if with_sft:
        sft_stage(backend, inputs, logger)
        if job.sft.save:
            backend.save(os.path.join(job.logging.out, SFT_MODEL), TrainState())
        trained = time.time() - t0
    if any_needs_values(inputs.algos or (inputs.algo,)):
        with_critic(backend, inputs, with_sft)
    # resume: weights, optimizer, reference, critic, data position and versions
    start = backend.load(job.checkpoint.resume) if job.checkpoint.resume else TrainState(rng_seed=job.seed)
    backend.prepare_recovery()  # from here on (the first evaluation included) a dead rank is recovered
    return start, trained


def run_rl_loop(backend, inputs: RLInputs, gen, start_state, logger, run_eval):
    """``cluster.loop.train.train`` with the job's prompts, schedule, settings and hooks (evaluation,
    step checkpoints, the ledger of trained groups in ``<out>/trained_groups.jsonl``)."""
    from cluster.loop.train import Hooks, RLRun, train
    from primitives.io.data import make_prompt_source
    from primitives.maths.algorithms import constant_schedule
    from primitives.model.training import linear_warmup

    job, algo, out = inputs.job, inputs.job.algorithm, inputs.job.logging.out

    def save(b, s):
        save_step_checkpoint(b, out, s, job.checkpoint.keep)

    def ledger(step, groups):  # which prompts each step trained (a resumed run appends: the last line of a step holds)
        with open(os.path.join(out, "trained_groups.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "groups": groups}) + "\n")

    run = RLRun(gen, num_steps=algo.steps, prompts_per_step=algo.prompts_per_step,
                lr_schedule=linear_warmup(algo.lr, algo.warmup), max_resample_rounds=algo.max_resample_rounds,
                max_staleness=algo.max_staleness, component_names=component_names(inputs),
                generator_policy=inputs.generator_policy)
    hooks = Hooks(logger=logger, eval_fn=run_eval if inputs.eval_items else None,
                  eval_every=job.eval.every or algo.steps, checkpoint_fn=save, checkpoint_every=job.checkpoint.every,
                  checkpoint_minutes=job.checkpoint.minutes, ledger=ledger)
    return train(backend, make_prompt_source(inputs.train_items, seed=job.seed, shuffle=job.data.shuffle),
                 inputs.schedule or constant_schedule(inputs.algo), run, state=start_state, hooks=hooks,
                 tools=inputs.tools.config if inputs.tools is not None else None)


def final_pass_at_k(backend, inputs: RLInputs, state, gen, run_eval) -> dict:
    """pass@k at the sampling temperature on the held-out items (Chen et al. 2021), when asked for."""
    k = inputs.job.eval.final_pass_k
    if not (k and inputs.eval_items):
        return {}
    sampled = run_eval(backend, state, gen, k, f"pass_at_{k}_step")
    return {f"eval/pass@{k}": sampled[f"eval/pass@{k}"], "eval/pass@1_sampled": sampled["eval/pass@1"],
            "eval/pass_temperature": gen.temperature}


def print_recoveries(faults: dict) -> None:
    for f in faults["recoveries"]:
        print(f"survived: {f['role']} {f['rank']} {'stopped answering' if f['stuck'] else 'died'} after "
              f"{f['version']} updates; recovered in {f['seconds']:.1f} s"
              f"{', ' + str(f['replayed']) + ' update(s) made again' if f['replayed'] else ''}", flush=True)


def train_rl(inputs: RLInputs, logger) -> dict:
    """Build the cluster, run the SFT stage (or resume), RL with evaluation, the final pass@k,
    and save the final model. Returns the figures of the run and its metrics history."""
    from cluster.ray_wing.roles import shutdown_cluster

    with_sft = inputs.job.sft.steps > 0 and not inputs.job.checkpoint.resume
    sft_stage_s = 0.0  # a full-weight SFT stage runs before RL's cluster starts: not start-up
    if with_sft and inputs.job.sft.full_weights and inputs.job.model.lora.enabled:
        t0 = time.time()
        inputs, with_sft = full_weight_sft_stage(inputs, logger), False  # RL's cluster starts on the SFT'd model
        sft_stage_s = time.time() - t0
    job, out = inputs.job, inputs.job.logging.out
    gen = sampling_config(job.generation, inputs.template_kwargs)
    run_eval = rl_evaluator(inputs, gen)
    cluster_start = time.time()
    backend = start_rl_backend(inputs, with_sft)
    built = time.time()
    try:
        start_state, skipped = before_rl(backend, inputs, logger, with_sft)
        t_eval = time.time()
        before = run_eval(backend, start_state) if inputs.eval_items else {}
        skipped += time.time() - t_eval  # SFT and evaluation seconds: training rather than start-up
        if before:  # the curves' first point: the step before the first RL step
            logger({**before, "step": start_state.iteration - 1})
            print(f"eval accuracy {'at the checkpoint' if job.checkpoint.resume else 'before RL'}: "
                  f"{before['eval/accuracy']:.3f}", flush=True)
        startup = {**backend.cluster.startup, "before_rl": round(time.time() - built - skipped, 3)}
        state = run_rl_loop(backend, inputs, gen, start_state, logger, run_eval)
        history = list(state.metrics_history[len(start_state.metrics_history):])
        startup["first_step"] = round(history[0]["time/step"], 3) if history else None
        after = next((m for m in reversed(history) if "eval/accuracy" in m), before)
        if after:
            ran = " -> ".join(dict.fromkeys(m["algorithm"] for m in history)) or job.algorithm.name  # a schedule's
            print(f"eval accuracy after {ran}: {after['eval/accuracy']:.3f}", flush=True)
        final = final_pass_at_k(backend, inputs, state, gen, run_eval)
        backend.save(os.path.join(out, "final_model"), state)
        faults = backend.fault_summary()
        print_recoveries(faults)
        c = backend.cluster
        memory, where = trainer_memory(c), {"reference": c.reference.where if c.reference is not None else None,
                                             "generation": c.generators.where, "generator_engine": c.generator_engine,
                                             "ray_address": c.ray_address, "reused_roles": list(c.reused)}
    finally:
        shutdown_cluster(backend.cluster, keep=sys.exc_info()[0] is None)  # a failed run's actors are not kept
    return {**where, **accuracy_figures(before, after), **final, **memory, "faults": faults,
            "cluster_started_at": cluster_start, "sft_stage_s": sft_stage_s, "startup": startup, "history": history,
            "whole_history": list(state.metrics_history), "resumed_at_step": start_state.iteration,
            **({"sft_model": os.path.join(out, SFT_MODEL)} if sft_stage_s or (with_sft and job.sft.save) else {})}
