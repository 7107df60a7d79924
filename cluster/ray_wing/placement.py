"""One placement group per role; counts, CPUs, GPUs and custom resources independent per role.

``check_fits`` compares what the roles ask for with what the cluster has *before* any actor
starts, and says what is missing and what to change.
"""
from __future__ import annotations

import uuid
from typing import NamedTuple, Optional, Sequence

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class RoleSpec(NamedTuple):
    """How many actors of one role and what each one needs."""

    name: str  # "generator", "trainer", "reward", "reference"
    count: int  # type: ignore[assignment]  # the field shadows tuple.count, which no caller uses
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: Optional[dict] = None  # custom resources per actor, e.g. {"generator_node": 1}
    strategy: str = "PACK"  # how this role's bundles spread over nodes

    def bundle(self) -> dict:
        b = {"CPU": self.num_cpus}
        if self.num_gpus:
            b["GPU"] = self.num_gpus
        b.update(self.resources or {})
        return b


def total_request(roles: Sequence[RoleSpec]) -> dict:
    total: dict = {}
    for role in roles:
        for k, v in role.bundle().items():
            total[k] = total.get(k, 0.0) + v * role.count
    return total


def check_fits(roles: Sequence[RoleSpec], cluster_total: dict, node_totals: Sequence[dict]) -> None:
    """Raise a ``ValueError`` naming each role whose request the cluster cannot hold."""
    problems = []
    for role in roles:
        if role.count < 1:
            problems.append(f"role '{role.name}' has count {role.count}; it needs at least 1")
        if role.strategy not in STRATEGIES:
            problems.append(f"role '{role.name}': unknown placement strategy '{role.strategy}' "
                            f"({', '.join(STRATEGIES)})")
        for key, amount in role.bundle().items():
            if amount and not any(node.get(key, 0.0) >= amount for node in node_totals):
                have = max((node.get(key, 0.0) for node in node_totals), default=0.0)
                hint = (f"; on a CPU-only cluster set cluster.{role.name}_gpus: 0" if key == "GPU" and
                        not cluster_total.get("GPU") else "")
                problems.append(f"role '{role.name}' needs {amount:g} {key} per actor but no node has that much "
                                f"(largest node: {have:g}){hint}")
    for key, amount in total_request(roles).items():
        if cluster_total.get(key, 0.0) < amount:
            problems.append(f"the roles need {amount:g} {key} in all; the cluster has {cluster_total.get(key, 0.0):g}")
    if problems:
        raise ValueError("the cluster cannot place this job:\n  - " + "\n  - ".join(problems))


def cluster_resources():
    """``(total, per-node totals)`` of the connected Ray cluster (alive nodes only)."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    return ray.cluster_resources(), nodes


def create_placement_group(role: RoleSpec, timeout_s: float = 60.0):
    """A ready placement group with one bundle per actor of ``role``."""
    return create_placement_groups([role], timeout_s)[role.name]


def create_placement_groups(roles: Sequence[RoleSpec], timeout_s: float = 60.0) -> dict:
    """``{role name: ready placement group}``, one bundle per actor of each role; all are
    requested at once, then waited for together."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    # named by role for `ray list placement-groups`; unique, as kept groups of the same role wait beside them
    pgs = {r.name: placement_group([r.bundle()] * r.count, strategy=r.strategy,
                                   name=f"rayrl-{r.name}-{uuid.uuid4().hex[:8]}") for r in roles}
    checks = {r.name: pgs[r.name].ready() for r in roles}
    _, pending = ray.wait(list(checks.values()), num_returns=len(checks), timeout=timeout_s)
    if pending:
        late = [r for r in roles if checks[r.name] in pending]
        for pg in pgs.values():
            remove_placement_group(pg)
        raise TimeoutError("; ".join(f"placement group for role '{r.name}' ({r.count} x {r.bundle()}, {r.strategy}) "
                                     f"was not ready after {timeout_s:.0f}s" for r in late) +
                           "; the cluster lacks room for it")
    return pgs
