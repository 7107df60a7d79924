"""Starting or joining Ray (issue 6, item 11): a stale ``/tmp/ray/ray_current_cluster``, left
by a killed ``ray start --head``, must not stop a local run; a given address is joined
without local-only arguments. Each case runs ``start_ray`` in a fresh Python process."""
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

STALE = "/tmp/ray/ray_current_cluster"
PROBE = """
import json, sys
from cluster.config import ClusterConfig
from cluster.placement import RoleSpec
from cluster.setup import start_ray
import ray
address = start_ray(ClusterConfig(ray_address=sys.argv[1] or None), [RoleSpec("generator", 1, 1.0, 0.0)])
print("JOINED", json.dumps({"address": address, "cpus": ray.cluster_resources().get("CPU")}))
ray.shutdown()
"""


def _start_ray(address: str = "") -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    proc = subprocess.run([sys.executable, "-c", PROBE, address], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("JOINED"))
    return json.loads(line.split(" ", 1)[1])


@pytest.fixture
def stale_session_file():
    """A leftover address file pointing at a Ray that no longer exists; restored afterwards."""
    old = open(STALE).read() if os.path.isfile(STALE) else None
    os.makedirs(os.path.dirname(STALE), exist_ok=True)
    with open(STALE, "w") as f:
        f.write("127.0.0.1:1")  # nothing listens there
    yield
    if old is None:
        if os.path.exists(STALE):
            os.remove(STALE)
    else:
        with open(STALE, "w") as f:
            f.write(old)


def test_local_run_ignores_a_stale_session(stale_session_file):
    joined = _start_ray()
    assert joined["address"] != "127.0.0.1:1" and joined["cpus"] >= 1


def test_a_given_address_is_joined_without_local_arguments(ray_local, stale_session_file):
    head = ray_local.get_runtime_context().gcs_address
    joined = _start_ray(head)
    assert joined["address"] == head
    assert joined["cpus"] == 8  # the head's own logical CPUs (ray_local), not a new local Ray's
