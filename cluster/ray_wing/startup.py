"""The start of an RL cluster's actors (``roles.build_rl_cluster``): every role created at once,
each starting up beside the others, then waited for; and how the weights will travel between
them. Separate from ``roles`` so that each stage reads on its own."""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

from cluster.ray_wing.config import ClusterConfig, start_s
from cluster.ray_wing.groups import RoleFactory, WorkerGroup, call, fan_out, gather
from cluster.ray_wing.handles import GeneratorsOnTrainers, GeneratorWorkers, ReferenceOnTrainers, ReferenceWorkers
from cluster.ray_wing.pool import Wanted, start_groups
from primitives.types import ModelConfig
from rl_actors.trainer import TrainerConfig
from rl_actors.weight_sync import SyncAddress


class UserFunctions(NamedTuple):
    """The job's functions the actors are built with: the reward workers' and the reference's."""

    reward_fn: Callable
    aggregate_fn: Optional[Callable] = None
    shaping_fn: Optional[Callable] = None
    ref_update_fn: Optional[Callable] = None


class Roles(NamedTuple):
    """Every role's actors, created (their constructors may still run), and how to make more of each."""

    trainers: WorkerGroup
    generators: GeneratorWorkers | GeneratorsOnTrainers
    rewards: WorkerGroup
    reference: Optional[ReferenceWorkers | ReferenceOnTrainers]
    factories: dict  # role -> RoleFactory
    reused: tuple = ()  # the roles whose actors a previous cluster kept (cluster.ray_wing.pool)


def create_roles(model: ModelConfig, cfg: ClusterConfig, trainer_cfg: TrainerConfig, roles: Sequence,
                 with_reference: bool, seed: int, fns: UserFunctions) -> Roles:
    """Every placement group and actor at once, so each role starts up beside the others: the trainers
    build their DeepSpeed engines while the generators, reward workers and reference load. A role
    that an earlier cluster's kept actors can serve (``RAYRL_REUSE_ACTORS``) is rebuilt there first. A
    reference or generation on the trainer ranks is a handle on the trainers (a failure there
    names the trainer: its whole group is rebuilt)."""
    from rl_actors.generator import GeneratorWorker
    from rl_actors.reference import RefLogprobWorker
    from rl_actors.reward import RewardWorker
    from rl_actors.trainer import TrainerWorker

    spec = {r.name: r for r in roles}
    threads, hosted = cfg.threads_per_actor, cfg.generate_on_trainers
    on_trainers = with_reference and cfg.reference_on_trainers
    gen_args = lambda r: dict(model=model, rank=r, backend=cfg.generator_backend, seed=seed,  # noqa: E731
                              num_threads=threads, vllm=cfg.vllm)
    reward_args = lambda r: dict(reward_fn=fns.reward_fn, aggregate_fn=fns.aggregate_fn,  # noqa: E731
                                 shaping_fn=fns.shaping_fn, rank=r, num_threads=threads)
    trainer_args = lambda r: dict(  # noqa: E731
        model=model, rank=r, world_size=cfg.trainers, config=trainer_cfg, seed=seed, num_threads=threads,
        reference=on_trainers, ref_update_fn=fns.ref_update_fn if on_trainers else None, host_generator=hosted)
    ref_args = lambda r: dict(model=model, rank=r, ref_update_fn=fns.ref_update_fn,  # noqa: E731
                              num_threads=threads)
    wanted = {"trainer": Wanted(TrainerWorker, spec["trainer"], trainer_args)}
    if not hosted:
        wanted["generator"] = Wanted(GeneratorWorker, spec["generator"], gen_args, cfg.generator_backend)
    wanted["reward"] = Wanted(RewardWorker, spec["reward"], reward_args)
    if not on_trainers and "reference" in spec:
        wanted["reference"] = Wanted(RefLogprobWorker, spec["reference"], ref_args)
    groups, reused = start_groups(wanted, start_s(cfg))  # critics come later (add_critics)
    trainers = groups["trainer"]
    generators = GeneratorsOnTrainers(trainers) if hosted else GeneratorWorkers(groups["generator"])
    tracks = with_reference and fns.ref_update_fn is not None
    reference: Optional[ReferenceWorkers | ReferenceOnTrainers] = None
    if on_trainers:
        reference = ReferenceOnTrainers(trainers, tracks)
    elif "reference" in groups:
        reference = ReferenceWorkers(groups["reference"], tracks)
    factories = {name: RoleFactory(w.actor_cls, w.spec, w.make_kwargs) for name, w in wanted.items()}
    return Roles(trainers, generators, groups["reward"], reference, factories, tuple(reused))


def start_roles(made: Roles, cfg: ClusterConfig) -> tuple:
    """The trainers' setup started (rank 0 hosts the rendezvous) and every other actor's constructor
    waited for (an error names the actor). Returns ``(the trainers' setup calls, the other actors'
    info)``; the generators' infos come first."""
    master = gather([call(made.trainers, 0, "endpoint")], start_s(cfg))[0]
    setups = fan_out(made.trainers, "setup", *master)  # waited for later, after the other roles
    others = ([made.generators.group] if isinstance(made.generators, GeneratorWorkers) else []) + [made.rewards] + \
        ([made.reference.group] if isinstance(made.reference, ReferenceWorkers) else [])
    return setups, gather([c for g in others for c in fan_out(g, "info")], start_s(cfg))


def weight_sync_address(cfg: ClusterConfig, model: ModelConfig, backends: set) -> SyncAddress:
    """How the weights travel: NCCL between GPU trainers and GPU receivers (not adapters into vLLM,
    which take them in the actor's process over gloo), gloo otherwise; always the trainer's bucketed
    broadcast, into vLLM's processes too (``rl_actors.vllm_transfer``). The rendezvous is set when
    the group is joined (``join_weight_sync``)."""
    if len(backends) > 1:
        raise ValueError(f"generators run mixed backends {sorted(backends)}; set cluster.generator_backend")
    receiver_gpus = cfg.reference_gpus if cfg.generate_on_trainers else cfg.generator_gpus  # who joins
    lora_into_vllm = model.lora.enabled and backends == {"vllm"}
    backend = "nccl" if cfg.trainer_gpus and receiver_gpus and not lora_into_vllm else "gloo"
    return SyncAddress("", 0, 0, backend)
