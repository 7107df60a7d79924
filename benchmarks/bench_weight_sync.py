"""Weight-sync throughput against one raw gloo broadcast of the same bytes in the same process
group (target: at least 80 % of raw), into HF generator workers or into vLLM.

Run:  python benchmarks/bench_weight_sync.py [--backend hf|vllm --model qwen100m|smollm2
                                              --generators 2 --bucket-mb 64 --repeats 5]
The source is trainer rank 0 of a 1-rank DeepSpeed group (ZeRO-2 configured; one fp32 rank runs
without ZeRO). HF receivers copy every bucket into their model; vLLM receives inside its worker
process (our weight-transfer engine, over gloo here) and loads each bucket through vLLM's
layerwise reload, and its raw broadcast is received there too.
``qwen100m`` is a random ~100M-parameter Qwen2; ``smollm2`` the embedded 135M model.
"""
import tempfile

from common import bench_parser, median, model_path, start_local_ray, table


def main():
    p = bench_parser(__doc__)
    p.add_argument("--generators", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--backend", choices=("hf", "vllm"), default="hf")
    p.add_argument("--model", choices=("qwen100m", "smollm2"), default="qwen100m")
    args = p.parse_args()
    ray = start_local_ray()
    from cluster.ray_wing.groups import WorkerGroup, fan_out, gather
    from cluster.ray_wing.handles import GeneratorWorkers
    from cluster.ray_wing.roles import RLCluster
    from cluster.ray_wing.weights import sync_weights
    from primitives.fixtures.tiny import TinyModelSpec, save_tiny_model
    from primitives.types import ModelConfig
    from rl_actors.generator import GeneratorWorker
    from rl_actors.trainer import TrainerConfig, TrainerWorker
    from rl_actors.weight_sync import SyncAddress

    spec = TinyModelSpec(hidden_size=768, intermediate_size=2048, num_hidden_layers=14, num_attention_heads=12,
                         num_key_value_heads=12, max_position_embeddings=512)
    path = save_tiny_model(tempfile.mkdtemp(prefix="bench-sync-"), spec) if args.model == "qwen100m" \
        else model_path("smollm2")
    model = ModelConfig(path)
    trainer = ray.remote(num_cpus=1, num_gpus=args.gpus)(TrainerWorker).remote(model=model, rank=0, world_size=1,
                                                                               config=TrainerConfig(zero_stage=2))
    ray.get(trainer.setup.remote(*ray.get(trainer.endpoint.remote())))
    remote = ray.remote(num_cpus=1, num_gpus=args.gpus)(GeneratorWorker)
    gens = [remote.remote(model=model, rank=r, backend=args.backend) for r in range(args.generators)]
    meta = ray.get(trainer.weight_meta.remote())
    host, port = ray.get(trainer.endpoint.remote())
    address = SyncAddress(host, port, 1 + args.generators, "nccl" if args.gpus else "gloo")
    ray.get([trainer.init_weight_sync.remote(address)] + [g.init_weight_sync.remote(address, 1 + i)
                                                          for i, g in enumerate(gens)])
    cluster = RLCluster(GeneratorWorkers(WorkerGroup("generator", tuple(gens))), WorkerGroup("trainer", (trainer,)),
                        None, None, address, tuple(meta), 0, int(args.bucket_mb * 2 ** 20), 600.0, "local")
    numel = sum(m.numel for m in meta)
    nbytes = sum(m.nbytes for m in meta)
    sync_weights(cluster, 0)  # warm-up
    raw_weights_s, sync_s = [], []
    for version in range(1, args.repeats + 1):
        raw = gather(fan_out(cluster.trainers, "broadcast_probe", numel) +
                     fan_out(cluster.generators.group, "broadcast_probe", numel), 600)
        raw_weights_s.append(max(raw))
        sync_s.append(sync_weights(cluster, version)["time/sync"])
    sums = gather(fan_out(cluster.trainers, "weight_checksums") +
                  fan_out(cluster.generators.group, "weight_checksums"), 600)
    assert all(s == sums[0] for s in sums), "generators do not hold the trainer's weights"
    raw_t, sync_t = median(raw_weights_s), median(sync_s)
    rows = [["raw gloo broadcast (1 buffer)", f"{raw_t:.3f}", f"{nbytes / raw_t / 1e9:.2f}", "100%"],
            [f"weight sync ({args.bucket_mb:g} MB buckets)", f"{sync_t:.3f}", f"{nbytes / sync_t / 1e9:.2f}",
             f"{100 * raw_t / sync_t:.0f}%"]]
    print(table(rows, ["path", "median s", "GB/s", "of raw"]))
    print(f"{args.model} into {args.backend}: {numel / 1e6:.1f}M parameters ({nbytes / 1e6:.0f} MB fp32), "
          f"{len(meta)} tensors, {args.generators} receivers, median of {args.repeats}; checksums equal on all "
          f"receivers")


if __name__ == "__main__":
    main()
