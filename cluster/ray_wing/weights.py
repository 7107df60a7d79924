"""Operations on a whole cluster's weights: the broadcast from the trainer ranks to the
generators and a tracking reference (``sync_weights``), the reference set to the policy, and the
cluster's checkpoints (trainer shards, optimizer, RNG, an HF copy, the reference, the critic).
The Ray backend and its recovery call them; so do the tests that build a cluster by hand."""
from __future__ import annotations

import os
import shutil
import time
from typing import Optional

from cluster.ray_wing.groups import fan_out, gather
from cluster.ray_wing.roles import RLCluster
from primitives.io.checkpoint import state_from_json, state_to_json
from primitives.types import TrainState


def sync_weights(cluster: RLCluster, version: int, step: int = 0, kl: Optional[float] = None,
                 move_reference: bool = True) -> dict:
    """Broadcast the trainers' weights to every generator (and every tracking reference worker).
    A tracking reference applies its ``ref_update_fn`` once per RL step: a sync that only
    refreshes the generators (a checkpoint load, a replaced generator, the SFT stage's end)
    passes ``move_reference=False``, and a reference worker takes part in the broadcast
    unmoved. A reference on the trainer ranks moves there, after the broadcast. Generators on the
    trainer ranks already hold the weights: they take the version only, and with no one else to
    send to (sync group of 1) nothing is broadcast."""
    t0 = time.perf_counter()
    meta, bucket = list(cluster.weight_meta), cluster.bucket_bytes
    calls = fan_out(cluster.trainers, "send_weights", meta, bucket) if cluster.sync_address.world_size > 1 else []
    calls += cluster.generator_handle.receive_weights(meta, bucket, version)
    if cluster.reference is not None:
        calls += cluster.reference.sync(meta, bucket, step, kl, move_reference)
    moved = gather(calls, cluster.timeout_s)[0]
    dt = time.perf_counter() - t0
    return {"time/sync": dt, "sync/bytes": float(moved), "sync/version": float(version)}


def copy_policy_to_reference(cluster: RLCluster) -> None:
    """Make every reference rank equal to the current policy (after SFT, say). Trainer rank 0's
    weights go to the reference ranks by ref (one object, never through the driver); the other
    trainer ranks join ZeRO-3 gathers. A reference on the trainers copies each rank's policy."""
    if cluster.reference is not None:
        gather(cluster.reference.copy_policy(cluster.trainers), cluster.timeout_s)


def save_cluster_checkpoint(cluster: RLCluster, path: str, state: TrainState) -> str:
    """Trainer shards with optimizer and RNG, an HF copy, the reference weights and the
    ``TrainState`` (data position, versions, metrics), written atomically to ``path``."""
    extra = {}
    if cluster.critics is not None:  # the critic's shards and HF copy, moved in by trainer rank 0
        critic_tmp = path.rstrip("/") + ".critic.tmp"
        shutil.rmtree(critic_tmp, ignore_errors=True)
        gather(fan_out(cluster.critics, "save_checkpoint", critic_tmp), cluster.timeout_s)
        extra["critic"] = critic_tmp
    if cluster.reference is not None:  # every copy is the same: one saves it
        ref_tmp = path.rstrip("/") + ".reference.tmp"
        shutil.rmtree(ref_tmp, ignore_errors=True)
        gather([cluster.reference.save(ref_tmp)], cluster.timeout_s)
        extra["reference"] = ref_tmp
    gather(fan_out(cluster.trainers, "save_checkpoint", path, state_to_json(state), extra), cluster.timeout_s)
    if not os.path.isfile(os.path.join(path, "train_state.json")):  # written on trainer rank 0's node
        import socket

        raise FileNotFoundError(f"checkpoint {path}: trainer rank 0 wrote it, but the driver (on "
                                f"{socket.gethostname()}) does not see it there. The job's output directory "
                                f"(logging.out, RAYRL_OUTPUT_ROOT) must be a volume every node mounts: the driver "
                                f"resumes, prunes and reads checkpoints from it")
    return path


def load_cluster_checkpoint(cluster: RLCluster, path: str) -> TrainState:
    """Restore what ``save_cluster_checkpoint`` wrote and send the weights to the generators;
    training continues exactly where it stopped."""
    saved = gather(fan_out(cluster.trainers, "load_checkpoint", path), cluster.timeout_s)[0]
    state = state_from_json(saved)
    saved_reference = os.path.join(path, "reference")
    if cluster.reference is not None and os.path.isdir(saved_reference):
        gather(cluster.reference.load(saved_reference), cluster.timeout_s)
    if cluster.critics is not None:
        if not os.path.isdir(os.path.join(path, "critic")):
            raise FileNotFoundError(f"{path} holds no critic/ to resume the critic from")
        gather(fan_out(cluster.critics, "load_checkpoint", os.path.join(path, "critic")), cluster.timeout_s)
    if cluster.generators is not None:  # an SFT job has no generators
        sync_weights(cluster, state.policy_version, move_reference=False)
    return state
