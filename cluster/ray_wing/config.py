"""The Ray wing's settings: how many actors of each role, where they run, what they get (the
``cluster`` section of a job's YAML file; each field's inline comment is its documentation)."""
from __future__ import annotations

from typing import NamedTuple, Optional

from primitives.types import VLLMConfig


class GeneratorScaling(NamedTuple):
    # fixed: cluster.generators throughout; idle: one worker more when the trainers wait on generation, one less
    # when the generators wait (the idle/trainers and idle/generators shares); steps: the counts of at_steps; or
    # module:function policy(history, current) -> count, called before every step
    policy: str = "fixed"
    minimum: int = 1  # idle or module:function: fewest generator workers
    maximum: int = 0  # idle or module:function: most generator workers (0: cluster.generators); a local Ray has
    # room for them
    every: int = 5  # idle: decide every N steps, from the mean idle shares over them
    idle_threshold: float = 0.3  # idle: a role idle more than this share of the steps asks for a change
    at_steps: Optional[dict[str, int]] = None  # steps: {step: count}, from that step on; e.g. {0: 1, 10: 3}


class ClusterConfig(NamedTuple):
    generators: int = 2  # generator workers (scaled independently of the trainers; at start, see scaling)
    trainers: int = 2  # trainer ranks (one DeepSpeed ZeRO data-parallel group)
    reward_workers: int = 1  # reward workers
    reference_workers: int = 1  # reference workers when a step needs reference logprobs (scaled like the generators)
    reference_on_trainers: bool = False  # no reference workers: each trainer rank scores its own shard with its copy
    generate_on_trainers: bool = False  # no generator workers: trainer ranks generate with their module (ZeRO-1/2)
    zero_stage: int = 2  # DeepSpeed ZeRO stage (1, 2 or 3)
    generator_cpus: float = 1.0  # CPUs per generator
    generator_gpus: float = 0.0  # GPUs per generator
    trainer_cpus: float = 1.0  # CPUs per trainer rank
    trainer_gpus: float = 0.0  # GPUs per trainer rank
    reference_cpus: float = 1.0  # CPUs per reference worker
    reference_gpus: float = 0.0  # GPUs per reference worker
    reward_cpus: float = 1.0  # CPUs per reward worker
    placement: str = "PACK"  # placement of each role's actors: PACK or SPREAD across nodes
    generator_backend: str = "auto"  # auto (vLLM if installed and a GPU is visible, else HF), hf or vllm (also on CPU)
    vllm: VLLMConfig = VLLMConfig()  # the vLLM engine's settings (generator workers running vLLM)
    pin_roles: bool = False  # pin generators to generator_node and trainers to trainer_node nodes (k8s/ groups)
    threads_per_actor: int = 1  # torch threads in each actor
    ray_address: Optional[str] = None  # Ray address to join (default: RAY_ADDRESS, else a local Ray)
    local_cpus: Optional[int] = None  # logical CPUs of a local Ray (default: enough for all actors)
    call_timeout_s: float = 600.0  # bound on every wait for actors; one that does not answer in it is taken for stuck:
    # killed and replaced like a dead one (raise it for work that is simply long)
    start_timeout_s: Optional[float] = None  # bound on starting an actor, a replacement too (None: call_timeout_s):
    # its process, imports, model load and DeepSpeed set-up, so a short call bound does not cut a slow load short
    heartbeat_s: float = 45.0  # an actor whose heartbeat (a count every 2 s from a thread of its own) stops for this
    # long is stopped or hung: killed and replaced at once, whatever call_timeout_s (0: only call_timeout_s finds it)
    max_restarts: int = 10  # actor replacements and group rebuilds a run survives in all; one more ends it, named
    # steps between in-memory snapshots of the trainer and critic ranks, kept outside them (in Ray's object store), from
    # which a group is rebuilt when a rank dies (the updates made since are made again); None: as often as costs at
    # most snapshot_overhead of the run's time; 0: none, and a trainer, critic or reference death ends the run
    snapshot_every: Optional[int] = None
    snapshot_overhead: float = 0.05  # snapshot_every None: the share of the run's time snapshots may take
    sync_bucket_mb: float = 64.0  # weight-sync bucket size in MB
    micro_batch_size: int = 64  # rows per forward/backward on a trainer rank (gradients accumulate over them)
    # trainer and critic ranks keep each decoder layer's input, not its activations, and recompute them in the
    # backward: a micro-batch's activation memory / layers' worth, for about a third more train-phase compute (a
    # job's groups: trainer_config; a cluster built by hand runs TrainerConfig's, and refuses a different one here)
    gradient_checkpointing: bool = False
    critics: int = 1  # critic ranks when the algorithm has a critic (PPO): a DeepSpeed group of their own
    critic_cpus: float = 1.0  # CPUs per critic rank
    critic_gpus: Optional[float] = None  # GPUs per critic rank (None: as many as a trainer rank)
    scaling: GeneratorScaling = GeneratorScaling()  # grow or shrink the generator workers while the run goes on


def trainer_config(cfg: ClusterConfig, lr: float):
    """The ``TrainerConfig`` of a job's trainer (or critic) group at learning rate ``lr``."""
    from rl_actors.deepspeed_rank import TrainerConfig

    return TrainerConfig(zero_stage=cfg.zero_stage, lr=lr, micro_batch_size=cfg.micro_batch_size,
                         gradient_checkpointing=cfg.gradient_checkpointing)


# what a group's TrainerConfig and the cluster section both say (a job builds the first from the second)
SHARED_TRAINER_FIELDS = ("zero_stage", "micro_batch_size", "gradient_checkpointing")


def trainer_conflicts(cfg: ClusterConfig, trainer_cfg, group: str = "trainer") -> list:
    """The settings ``cfg`` was given (other than its defaults) that the group's ``TrainerConfig``
    contradicts. The ranks run the ``TrainerConfig``'s: a cluster built by hand would otherwise drop the
    cluster's without a word (a job's agree: ``trainer_config``)."""
    base = ClusterConfig()
    return [f"cluster.{f} is {getattr(cfg, f)!r} but the {group} group's TrainerConfig.{f} is "
            f"{getattr(trainer_cfg, f)!r}, which its ranks would run: build the TrainerConfig with "
            f"trainer_config(cluster, lr), or give both the same {f}"
            for f in SHARED_TRAINER_FIELDS if getattr(cfg, f) not in (getattr(base, f), getattr(trainer_cfg, f))]


def start_s(cfg: ClusterConfig) -> float:
    """The bound on starting an actor: ``start_timeout_s``, or ``call_timeout_s`` when that is None."""
    return cfg.call_timeout_s if cfg.start_timeout_s is None else cfg.start_timeout_s


def with_lora_reference(cfg: ClusterConfig, lora) -> ClusterConfig:
    """``cfg`` as a job with ``lora`` (``model.lora``) runs it: the reference is the trainer ranks' own
    module with its adapters off, or a frozen adapter there, so it lives on the trainers, never in a
    worker of its own (``reference_on_trainers``)."""
    return cfg._replace(reference_on_trainers=True) if lora.enabled else cfg


def peak_generators(cfg: ClusterConfig) -> int:
    """The most generator workers a run may have: a local Ray is started with room for them."""
    sc = cfg.scaling
    if sc.policy == "fixed" or cfg.generate_on_trainers:
        return cfg.generators
    if sc.policy == "steps":
        return max([cfg.generators] + [int(c) for c in (sc.at_steps or {}).values()])
    return max(cfg.generators, sc.maximum)


def busy_actors(cfg: ClusterConfig, with_reference: bool, with_critic: bool, staleness: int) -> tuple:
    """``(count, words)``: the most actors of a job that compute at once, each with
    ``threads_per_actor`` torch threads. Each generator makes one chunk of a step's rollouts, which a
    reference worker scores once it is done, so generating and scoring one step keep at most as many
    actors busy as there are chunks; the update keeps the trainer and critic ranks busy. Generating
    ``staleness`` steps ahead (``algorithm.max_staleness``) runs the next step's generation beside this
    step's update, and from 2 on the scoring of one step beside the generation of the next. Reward
    workers run user code between them and are not counted."""
    generators = 0 if cfg.generate_on_trainers else peak_generators(cfg)
    chunks = generators or cfg.trainers  # generation on the trainer ranks: a chunk per rank
    references = min(cfg.reference_workers, chunks) if with_reference and not cfg.reference_on_trainers else 0
    generate = [(generators, "generator worker")] if generators else []
    score = [(references, "reference worker")] if references else []
    train = [(cfg.trainers, "trainer rank")] + ([(cfg.critics, "critic rank")] if with_critic else [])
    if staleness and generate:
        phases = [generate + (score if staleness > 1 else []) + train]
    else:
        phases = [generate, score, train]
    busiest = max(phases, key=lambda roles: sum(n for n, _ in roles))
    return sum(n for n, _ in busiest), " and ".join(f"{n} {what}{'s' if n > 1 else ''}" for n, what in busiest)


def oversubscribed(cfg: ClusterConfig, with_reference: bool, with_critic: bool, staleness: int,
                   cores: int) -> Optional[str]:
    """A warning when the actors busy at once (``busy_actors``) run more torch threads than ``cores``
    (a local Ray's: every actor shares this machine) and fewer threads each would help, else None.
    Threads beyond the cores wait on each other at every parallel operation: a SmolLM2 job with one
    generator and one trainer rank of 2 threads each, generating a step ahead on 2 cores, took 14.8 s
    a step against 6.0 s with 1 thread each (docs/benchmarks.md, 2026-12-01 session 67)."""
    count, words = busy_actors(cfg, with_reference, with_critic, staleness)
    threads = count * cfg.threads_per_actor
    if threads <= cores or cfg.threads_per_actor == 1:  # one thread each: no thread pool to wait on
        return None
    why = " (algorithm.max_staleness generates beside training)" if staleness and not cfg.generate_on_trainers else ""
    return (f"cluster.threads_per_actor {cfg.threads_per_actor} x {words} busy at once{why} = {threads} torch "
            f"threads on this machine's {cores} cores: threads beyond the cores wait on each other at every "
            f"parallel operation, often costing more than they add; " + (
                f"cluster.threads_per_actor {cores // count} fits" if count <= cores else
                f"cluster.threads_per_actor 1 comes closest ({count} actors for {cores} cores)"))
