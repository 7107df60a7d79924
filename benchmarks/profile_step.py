"""Where one RL step of the default job goes: each actor's work timed in one process, no Ray.

Run:  python benchmarks/profile_step.py [--repeats 20] [--micro 128]

The default job's shapes (the tiny model, 32 prompts x 8 samples, 5 new tokens, ZeRO-2,
micro-batches of --micro rows, the job's 128) with its actor classes driven directly: a generator's half of the
prompts, the reference scoring all 256 rollouts, the reward worker, ``make_batch``, and one
trainer rank's ``train_step`` on its half of the batch, split into forward (with the loss),
backward, and the engine step (optimizer; with world > 1 also ZeRO's gradient reduction
and parameter all-gather). It also times pickling the records the object store moves.
Compare the medians with ``bench_default_job.py``'s per-phase times on Ray: the rest is
orchestration (Ray calls, transfers, waiting between serial phases).
"""
import argparse
import os
import pickle
import socket
import tempfile
import time

import numpy as np
from common import table


def timed(fn, sink: list):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        sink.append(time.perf_counter() - t)
        return out

    return wrapper


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--micro", type=int, default=128, help="rows per forward/backward on a trainer rank")
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    torch.set_num_threads(1)
    from primitives.fixtures.tasks import arithmetic_reward, arithmetic_task
    from primitives.fixtures.tiny import save_tiny_model
    from primitives.maths.algorithms import grpo
    from primitives.maths.batching import make_batch
    from primitives.types import GenerationConfig, ModelConfig
    from rl_actors.generator import GeneratorWorker
    from rl_actors.reference import RefLogprobWorker
    from rl_actors.reward import RewardWorker
    from rl_actors.trainer import TrainerConfig, TrainerWorker

    model = ModelConfig(save_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"), seed=0))
    task = arithmetic_task(seed=0)
    items = list(task.train[: args.prompts])
    gen_cfg = GenerationConfig(max_new_tokens=5, temperature=1.0, n=args.group)
    algo = grpo()._replace(kl_coef=0.01)
    generator = GeneratorWorker(model=model, rank=0, backend="hf", seed=0, num_threads=1)
    reference = RefLogprobWorker(model=model, rank=0, num_threads=1)
    reward = RewardWorker(reward_fn=arithmetic_reward, rank=0, num_threads=1)
    trainer = TrainerWorker(model=model, rank=0, world_size=1, seed=0, num_threads=1,
                            config=TrainerConfig(zero_stage=2, lr=3e-4, micro_batch_size=args.micro))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trainer.setup("127.0.0.1", port)
    engine = trainer.ds.engine
    backward_s, step_s = [], []
    engine.backward = timed(engine.backward, backward_s)
    engine.step = timed(engine.step, step_s)

    rows = {k: [] for k in ("generate (1 of 2 generators)", "reference (256 rollouts)", "reward (256 rollouts)",
                            "make_batch", "train_step, 1 rank of 2 (128 rows)", "  forward + loss", "  backward",
                            "  engine.step (optimizer)", "pickle+unpickle rollouts", "pickle+unpickle batch")}
    sizes = {}
    half = len(items) // 2
    for it in range(args.repeats + 1):
        t0 = time.perf_counter()
        mine = generator.generate(items[:half], gen_cfg)
        t1 = time.perf_counter()
        rollouts = mine + generator.generate(items[half:], gen_cfg)
        t2 = time.perf_counter()
        rollouts = reference.logprobs(rollouts, 1.0)
        t3 = time.perf_counter()
        rollouts = reward.score(rollouts)
        t4 = time.perf_counter()
        batch = make_batch(rollouts, algo, trainer.pad_token_id(), seed=it, budget=5)
        t5 = time.perf_counter()
        shard = batch.shard(0, 2, 1)
        backward_s.clear(), step_s.clear()
        t6 = time.perf_counter()
        trainer.train_step(shard, algo, 1.0, 3e-4)
        t7 = time.perf_counter()
        blob = pickle.dumps(rollouts, protocol=5)
        pickle.loads(blob)
        t8 = time.perf_counter()
        bblob = pickle.dumps(batch, protocol=5)
        pickle.loads(bblob)
        t9 = time.perf_counter()
        sizes = {"rollouts": len(blob), "batch": len(bblob)}
        if it == 0:
            continue  # warm-up
        train, bwd, stp = t7 - t6, sum(backward_s), sum(step_s)
        for key, value in zip(rows, (t1 - t0, t3 - t2, t4 - t3, t5 - t4, train, train - bwd - stp, bwd, stp,
                                     t8 - t7, t9 - t8)):
            rows[key].append(value)
        del t2  # (the second generator's call is not counted: on Ray the two run side by side)
    out = [[k, f"{1000 * np.median(v):.1f}", f"{1000 * np.percentile(v, 90):.1f}"] for k, v in rows.items()]
    print(table(out, ["work (one process, 1 thread)", "median ms", "p90 ms"]))
    print(f"repeats: {args.repeats}; pickled sizes: rollouts {sizes['rollouts'] / 1024:.0f} KiB, "
          f"batch {sizes['batch'] / 1024:.0f} KiB; {len(rollouts)} rollouts, batch width "
          f"{batch.input_ids.shape[1]}")


if __name__ == "__main__":
    main()
