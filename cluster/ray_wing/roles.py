"""Start or join Ray, check the cluster can hold the job, place and create every role.

``build_rl_cluster`` returns an ``RLCluster`` record that the driver functions take.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import uuid
from typing import Callable, NamedTuple, Optional, Sequence

from cluster.ray_wing.config import ClusterConfig, peak_generators, start_s, trainer_conflicts, with_lora_reference
from cluster.ray_wing.groups import (
    Call,
    RoleFactory,
    WorkerGroup,
    call,
    fan_out,
    gather,
    kill_actor,
    watch_heartbeats,
)
from cluster.ray_wing.handles import GeneratorsOnTrainers, GeneratorWorkers, ReferenceOnTrainers, ReferenceWorkers
from cluster.ray_wing.placement import (
    RoleSpec,
    check_fits,
    cluster_resources,
)
from cluster.ray_wing.pool import RELEASE_S, Wanted, free_groups, make_room, start_groups
from cluster.ray_wing.startup import UserFunctions, create_roles, start_roles, weight_sync_address
from primitives.types import ModelConfig
from rl_actors.common import environ
from rl_actors.trainer import TrainerConfig
from rl_actors.weight_sync import SyncAddress, abandon_sync_group, forget_abandoned

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# custom resources that k8s/ worker groups advertise; cluster.pin_roles places each role there
NODE_GROUP_PINS = {"generator": {"generator_node": 0.01}, "reward": {"generator_node": 0.01},
                   "trainer": {"trainer_node": 0.01}, "reference": {"trainer_node": 0.01},
                   "critic": {"trainer_node": 0.01}}


class RLCluster(NamedTuple):
    """The roles of a job, each a handle (``cluster.ray_wing.handles``) or a worker group."""

    generators: Optional[GeneratorWorkers | GeneratorsOnTrainers]  # None in an SFT job (the trainers alone)
    trainers: WorkerGroup
    rewards: Optional[WorkerGroup]
    reference: Optional[ReferenceWorkers | ReferenceOnTrainers]  # None when no step needs reference logprobs
    sync_address: SyncAddress
    weight_meta: tuple  # TensorMeta of the policy, as the trainers hold it
    pad_token_id: int
    bucket_bytes: int
    timeout_s: float
    ray_address: str
    factories: Optional[dict] = None  # role -> RoleFactory: a replacement in a dead actor's bundle, or one more
    reward_needs_reference: bool = False  # the shaping function reads ref_logprobs (KL in the reward)
    critics: Optional[WorkerGroup] = None  # the critic ranks (PPO), a DeepSpeed group of their own
    startup: Optional[dict] = None  # seconds of each start-up stage of build_rl_cluster (stage_seconds)
    generator_engine: str = "hf"  # the engine the generators run: hf or vllm
    reused: tuple = ()  # roles whose actors an earlier cluster kept (RAYRL_REUSE_ACTORS, cluster.ray_wing.pool)
    start_timeout_s: Optional[float] = None  # bound on a new actor's start (cluster.start_timeout_s; None: timeout_s)

    @property
    def start_s(self) -> float:
        """The bound on starting an actor (a replacement, a rebuilt group, an added worker)."""
        return self.timeout_s if self.start_timeout_s is None else self.start_timeout_s

    # the roles an RL step needs, which an SFT cluster (the trainers alone) or a job without a
    # reference lacks: asking for one that is not there is an error that names it
    @property
    def generator_handle(self) -> GeneratorWorkers | GeneratorsOnTrainers:
        return _present(self.generators, "generators")

    @property
    def reward_group(self) -> WorkerGroup:
        return _present(self.rewards, "reward workers")

    @property
    def reference_handle(self) -> ReferenceWorkers | ReferenceOnTrainers:
        return _present(self.reference, "reference")

    @property
    def generator_workers(self) -> GeneratorWorkers:
        """The generator workers (not generation on the trainer ranks)."""
        return _own_workers(self.generator_handle, GeneratorWorkers, "generator")

    @property
    def reference_workers(self) -> ReferenceWorkers:
        """The reference workers (not a reference on the trainer ranks)."""
        return _own_workers(self.reference_handle, ReferenceWorkers, "reference")

    @property
    def critic_group(self) -> WorkerGroup:
        return _present(self.critics, "critics")

    @property
    def role_factories(self) -> dict:
        return _present(self.factories, "role factories")


def _own_workers(handle, kind: type, role: str):
    if not isinstance(handle, kind):
        raise RuntimeError(f"this cluster's {role} role lives on its trainer ranks: it has no {role} workers")
    return handle


def _present(value, what: str):
    if value is None:
        raise RuntimeError(f"this cluster has no {what} (an SFT job's cluster is the trainers alone; a job "
                           f"whose steps read no reference logprobs has no reference)")
    return value


def stage_seconds(marks: Sequence[tuple]) -> dict:
    """``{stage: seconds}`` from ``[(first mark, t0), (stage, t1), ...]`` (``time.time()``
    values in order): each stage lasts from the mark before it to its own."""
    return {name: round(t - before, 3) for (_, before), (name, t) in zip(marks, marks[1:])}


def role_specs(cfg: ClusterConfig, with_reference: bool, node_resources: Optional[dict] = None,
               with_critic: bool = False) -> list:
    """The RoleSpec of each role; ``node_resources`` maps a role to custom resources that pin
    it to matching nodes (e.g. {"generator": {"generator_node": 0.01}})."""
    extra = node_resources or {}
    strategy = cfg.placement
    roles = []
    if not cfg.generate_on_trainers:
        roles.append(RoleSpec("generator", cfg.generators, cfg.generator_cpus, cfg.generator_gpus,
                              extra.get("generator"), strategy))
    roles += [RoleSpec("trainer", cfg.trainers, cfg.trainer_cpus, cfg.trainer_gpus, extra.get("trainer"), strategy),
              RoleSpec("reward", cfg.reward_workers, cfg.reward_cpus, 0.0, extra.get("reward"), strategy)]
    if with_reference and not cfg.reference_on_trainers:
        roles.append(RoleSpec("reference", cfg.reference_workers, cfg.reference_cpus, cfg.reference_gpus,
                              extra.get("reference"), strategy))
    if with_critic:
        roles.append(critic_spec(cfg, extra))
    return roles


def critic_spec(cfg: ClusterConfig, node_resources: Optional[dict] = None) -> RoleSpec:
    gpus = cfg.trainer_gpus if cfg.critic_gpus is None else cfg.critic_gpus
    return RoleSpec("critic", cfg.critics, cfg.critic_cpus, gpus, (node_resources or {}).get("critic"), cfg.placement)


def start_ray(cfg: ClusterConfig, roles) -> str:
    """Join ``cluster.ray_address`` / ``RAY_ADDRESS`` if given, else start a local Ray on loopback."""
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    if not address and "ray" not in sys.modules:
        # read by Ray at import time: a local Ray then binds 127.0.0.1, not the machine's address
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    env_vars = {"TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        # inside `ray job submit`: the job's runtime env (its --working-dir) already reaches every actor
        ray.init(address=address or "auto", log_to_driver=True)
    elif address:
        # a script joining a cluster: ship this checkout to the actors on other nodes
        ray.init(address=address, log_to_driver=True, runtime_env={
            "working_dir": REPO_ROOT, "excludes": [".venv/", ".git/", "runs/", "*.pt", "*.safetensors"],
            "env_vars": env_vars})
    else:
        spare = (peak_generators(cfg) - cfg.generators) * cfg.generator_cpus  # room to grow the generators
        needed = sum(r.num_cpus * r.count for r in roles) + spare
        num_cpus = cfg.local_cpus or max(int(needed + 0.999), os.cpu_count() or 1)
        env_vars["PYTHONPATH"] = REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
        # "local": always a new Ray of our own. With no address, Ray would otherwise join the cluster
        # named in /tmp/ray/ray_current_cluster, which a killed `ray start` leaves behind, and then
        # refuse num_cpus ("When connecting to an existing cluster, num_cpus ... must not be provided").
        # The actors' variables reach them as the environment of the Ray processes started here, not
        # as a runtime_env: actors then take the worker processes Ray starts ahead (one per CPU)
        # instead of starting their own through the runtime-env agent (seconds on a small machine)
        with environ(env_vars):
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    return ray.get_runtime_context().gcs_address


@contextlib.contextmanager
def ray_left_as_found():
    """A script's Ray session: a Ray this block started (``start_ray``, through ``build_rl_cluster``)
    is shut down when it ends, however it ends; a Ray the caller had started or joined before it
    (a notebook's, the test run's) stays up, with whatever else runs there."""
    import ray

    was_running = ray.is_initialized()
    try:
        yield
    finally:
        if not was_running:
            ray.shutdown()


def check_cluster_hooks(reward_fn: Callable, aggregate_fn: Optional[Callable], shaping_fn: Optional[Callable],
                        ref_update_fn: Optional[Callable]) -> None:
    """The functions the actors are built with take their documented arguments and can be
    pickled (they travel to the reward and reference workers by value): named errors before
    Ray starts."""
    from primitives.hooks import check_arity, check_picklable

    hooks: list = [(reward_fn, "reward_fn", (None,)), (aggregate_fn, "aggregate_fn", ([0.0],)),
             (shaping_fn, "shaping_fn", (None, 0.0)), (ref_update_fn, "ref_update_fn", (None, {}, 0, None))]
    for fn, what, args in hooks:
        if fn is not None:
            check_arity(fn, what, *args)
            check_picklable(fn, what)


def refuse_conflicts(cfg: ClusterConfig, trainer_cfg: TrainerConfig, group: str = "trainer") -> None:
    """Before anything starts: ``trainer_conflicts`` as one error."""
    conflicts = trainer_conflicts(cfg, trainer_cfg, group)
    if conflicts:
        raise ValueError("; ".join(conflicts))


def build_rl_cluster(model: ModelConfig | str, cfg: ClusterConfig, trainer_cfg: TrainerConfig, reward_fn: Callable,
                     with_reference: bool, ref_update_fn: Optional[Callable] = None, aggregate_fn=None,
                     shaping_fn=None, seed: int = 0, bucket_mb: float = 64.0,
                     node_resources: Optional[dict] = None, reserve_critics: bool = False) -> RLCluster:
    """Check resources, place each role, create and set up every actor, wire weight sync.

    ``model`` (a ``ModelConfig``, or a bare path for the defaults) reaches every actor as given:
    dtype, device, ``trust_remote_code`` and attention implementation. The trainers keep fp32
    master weights whatever the dtype (DeepSpeed casts to bf16 on GPU). ``reserve_critics``
    counts a critic group (``add_critics``, later) in the resources a local Ray starts with
    and checks up front."""
    watch_heartbeats(cfg.heartbeat_s)
    marks = [("start", time.time())]
    check_cluster_hooks(reward_fn, aggregate_fn, shaping_fn, ref_update_fn)
    refuse_conflicts(cfg, trainer_cfg)
    if node_resources is None and cfg.pin_roles:
        node_resources = NODE_GROUP_PINS
    reward_needs_reference = bool(getattr(shaping_fn, "needs_reference", False))
    with_reference = with_reference or reward_needs_reference
    model = model if isinstance(model, ModelConfig) else ModelConfig(model)
    cfg = with_lora_reference(cfg, model.lora)
    roles = role_specs(cfg, with_reference, node_resources, with_critic=reserve_critics)
    address = start_ray(cfg, roles)
    check_fits(roles, *cluster_resources())
    marks.append(("ray_init", time.time()))
    made = create_roles(model, cfg, trainer_cfg, roles, with_reference, seed,
                        UserFunctions(reward_fn, aggregate_fn, shaping_fn, ref_update_fn))
    marks.append(("actors_created", time.time()))
    setups, infos = start_roles(made, cfg)
    marks.append(("actors_loaded", time.time()))
    backends = {"hf"} if cfg.generate_on_trainers else {info["backend"] for info in infos[: made.generators.size]}
    sync_address = weight_sync_address(cfg, model, backends)
    wait = lambda calls: gather(calls, cfg.call_timeout_s)  # noqa: E731
    gather(setups, start_s(cfg))  # first: a hosted generator exists once its trainer is set up
    pad_id = wait(made.generators.ping()[:1])[0]
    meta = tuple(wait([call(made.trainers, 0, "weight_meta")])[0])
    marks.append(("trainer_setup", time.time()))
    cluster = RLCluster(made.generators, made.trainers, made.rewards, made.reference, sync_address, meta, pad_id,
                        int(bucket_mb * 2 ** 20), cfg.call_timeout_s, address, made.factories,
                        reward_needs_reference, generator_engine=next(iter(backends)), reused=made.reused,
                        start_timeout_s=cfg.start_timeout_s)
    cluster = join_weight_sync(cluster)
    marks.append(("weight_sync", time.time()))
    return cluster._replace(startup=stage_seconds(marks))


def build_sft_cluster(model: ModelConfig, cfg: ClusterConfig, trainer_cfg: TrainerConfig, seed: int = 0) -> RLCluster:
    """The trainer group alone (an SFT job): no generators, reward workers or reference. A dead or
    stuck rank's group is rebuilt as an RL job's is (its factory)."""
    from rl_actors.trainer import TrainerWorker

    refuse_conflicts(cfg, trainer_cfg)
    watch_heartbeats(cfg.heartbeat_s)
    pins = NODE_GROUP_PINS if cfg.pin_roles else None
    roles = [r for r in role_specs(cfg, with_reference=False, node_resources=pins) if r.name == "trainer"]
    address = start_ray(cfg, roles)
    check_fits(roles, *cluster_resources())
    trainer_args = lambda r: dict(model=model, rank=r, world_size=cfg.trainers, config=trainer_cfg,  # noqa: E731
                                  seed=seed, num_threads=cfg.threads_per_actor)
    groups, reused = start_groups({"trainer": Wanted(TrainerWorker, roles[0], trainer_args)}, start_s(cfg))
    trainers = groups["trainer"]
    master = gather([call(trainers, 0, "endpoint")], start_s(cfg))[0]
    gather(fan_out(trainers, "setup", *master), start_s(cfg))
    pad_id = gather([call(trainers, 0, "pad_token_id")], cfg.call_timeout_s)[0]
    return RLCluster(None, trainers, None, None, SyncAddress("", 0, 0, "gloo"), (), pad_id, 0,
                     cfg.call_timeout_s, address, {"trainer": RoleFactory(TrainerWorker, roles[0], trainer_args)},
                     reused=tuple(reused), start_timeout_s=cfg.start_timeout_s)


def join_weight_sync(cluster: RLCluster) -> RLCluster:
    """(Re)build the weight-sync group on a fresh port: trainer rank 0 (sync rank 0), every
    generator (1 .. G), and every policy-tracking reference worker (G + 1 ...; a reference or a
    generator on the trainers reads the policy where it is). Called at start-up and after a
    generator is replaced. A member that fails while the group forms makes the driver give the group
    up: the others leave the rendezvous at once instead of waiting out its timeout, free for the next try.
    With nobody to send to, there is no group (world size 1)."""
    gens = cluster.generators.sync_ranks() if cluster.generators is not None else 0  # none: an SFT job
    refs = cluster.reference.sync_ranks() if cluster.reference is not None else 0
    if gens + refs == 0:
        return cluster._replace(sync_address=cluster.sync_address._replace(world_size=1))
    host, port = gather([call(cluster.trainers, 0, "endpoint")], cluster.timeout_s)[0]
    sync = cluster.sync_address._replace(host=host, port=port, world_size=1 + gens + refs, token=uuid.uuid4().hex)
    joins = fan_out(cluster.trainers, "init_weight_sync", sync)
    joins += cluster.generators.join_sync(sync, 1, cluster.bucket_bytes) if cluster.generators is not None else []
    joins += cluster.reference.join_sync(sync, 1 + gens) if cluster.reference is not None else []
    try:
        gather(joins, cluster.timeout_s)
    except BaseException:  # the members waiting in the rendezvous for the one that failed leave it at once
        abandon_sync_group(sync)
        raise
    forget_abandoned()  # every member left the given-up joins before this one: their marks are read no more
    return cluster._replace(sync_address=sync)


DEEPSPEED_ROLES = ("trainer", "critic")


def scale_generator_group(cluster: RLCluster, n: int) -> RLCluster:
    """The cluster with ``n`` generator workers. New ones first fill the bundles of the role's
    own placement group that earlier shrinks emptied; beyond its size each gets a placement
    group of its own (on an autoscaling cluster, a pending group is what asks for a node).
    They are waited for until loaded; if one fails, every new actor and group is removed
    again. Surplus workers (the highest ranks) are killed and their own placement groups
    removed (the role's group keeps its bundles for the run). The caller must have let the surplus
    finish their work; it then forms the weight-sync group again (``join_weight_sync``, with the
    resized group already the cluster's: a member that fails as it forms is recovered among them)
    and sends the current weights to the new ones."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group, factory = cluster.generator_workers.group, cluster.role_factories["generator"]
    actors = list(group.actors)
    slots = [group.slots[r] if r < len(group.slots) else None for r in range(group.size)]
    if n > group.size:
        own = group.placement_group.bundle_count if group.placement_group is not None else 0
        first = max(group.size, own)  # the first rank past the role's own bundles
        make_room([factory.spec._replace(count=max(0, n - first))])
        added = {r: placement_group([factory.spec.bundle()], strategy="PACK") for r in range(first, n)}
        new, new_slots = [], []
        try:
            _, pending = ray.wait([pg.ready() for pg in added.values()], num_returns=len(added),
                                  timeout=cluster.start_s)
            if pending:
                raise ValueError(f"cannot place {len(pending)} more generator worker(s) ({factory.spec.bundle()} "
                                 f"each) within {cluster.start_s:.0f}s: the cluster lacks room (an autoscaler adds "
                                 "nodes for pending placement groups; without one, free resources or scale less)")
            for r in range(group.size, n):
                slot = (added[r], 0) if r in added else None
                new.append(factory.create(r, *(slot or (group.placement_group, r))))
                new_slots.append(slot)
            gather([Call(a.info.remote(), "generator", r, "info") for r, a in zip(range(group.size, n), new)],
                   cluster.start_s)
        except BaseException:
            for actor in new:
                kill_actor(actor)
            for pg in added.values():
                remove_placement_group(pg)
            raise
        actors += new
        slots += new_slots
    else:
        for r in range(n, group.size):
            kill_actor(actors[r])
            slot = slots[r]
            if slot is not None:
                remove_placement_group(slot[0])
        actors, slots = actors[:n], slots[:n]
    group = group._replace(actors=tuple(actors), slots=tuple(slots) if any(s is not None for s in slots) else ())
    return cluster._replace(generators=cluster.generator_workers._replace(group=group))


def add_critics(cluster: RLCluster, model: ModelConfig, cfg: ClusterConfig, critic_cfg: TrainerConfig,
                init: str = "policy", seed: int = 0) -> RLCluster:
    """A critic group (``cfg.critics`` DeepSpeed ranks) for an algorithm with a value model:
    initialised from ``model`` (the policy as it stands: after an SFT stage, its saved copy)
    or from a reward model directory (``init``). Its ranks rendezvous among themselves."""
    from rl_actors.critic import CriticWorker

    if cluster.critics is not None:
        raise ValueError("the cluster already has critics")
    refuse_conflicts(cfg, critic_cfg, "critic")
    import ray

    def fits_now(specs):  # in what the other roles left (build_rl_cluster(reserve_critics=True))
        free = ray.available_resources()
        check_fits(specs, free, [free])

    spec = critic_spec(cfg, NODE_GROUP_PINS if cfg.pin_roles else None)
    critic_args = lambda r: dict(model=model, rank=r, world_size=cfg.critics, config=critic_cfg,  # noqa: E731
                                 seed=seed, num_threads=cfg.threads_per_actor, init=init)
    groups, reused = start_groups({"critic": Wanted(CriticWorker, spec, critic_args)}, cluster.start_s, fits_now)
    critics = groups["critic"]  # a kept critic group of its shape (RAYRL_REUSE_ACTORS), or new ranks
    master = gather([call(critics, 0, "endpoint")], cluster.start_s)[0]
    gather(fan_out(critics, "setup", *master), cluster.start_s)
    factories = {**(cluster.factories or {}), "critic": RoleFactory(CriticWorker, spec, critic_args)}
    return cluster._replace(critics=critics, factories=factories, reused=(*cluster.reused, *reused))


def shutdown_cluster(cluster: RLCluster, keep: bool = True) -> None:
    """Kill every actor and free its bundles (or, with ``RAYRL_REUSE_ACTORS``, keep the trainers,
    generators, reward workers, reference and critics for the next cluster of their shape:
    ``cluster.ray_wing.pool``; not with ``keep`` false, as after a failed run); then remove the scratch
    directories that actors killed mid-snapshot left on this machine (``rl_actors.scratch``; other
    nodes sweep at their next snapshot)."""
    from rl_actors.scratch import sweep

    own = [getattr(cluster.generators, "group", None), cluster.trainers, cluster.rewards,
           getattr(cluster.reference, "group", None), cluster.critics]  # hosted roles go with the trainers
    free_groups([g for g in own if g is not None], min(RELEASE_S, cluster.timeout_s), keep)
    sweep()
