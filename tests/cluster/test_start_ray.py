"""Starting or joining Ray: a stale ``ray_current_cluster`` file, left by a
killed ``ray start --head``, must not stop a local run; a given address is joined without
local-only arguments. Each case runs ``start_ray`` in a fresh Python process whose Ray temp
directory (``RAY_TMPDIR``) is private, so the machine's own /tmp/ray is never touched."""
import os
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import RAY_CPUS, ROOT

pytestmark = pytest.mark.ray  # starts Ray processes of its own

PROBE = """
import json, sys
from cluster.ray_wing.config import ClusterConfig
from cluster.ray_wing.placement import RoleSpec
from cluster.ray_wing.roles import start_ray
import ray

address = start_ray(ClusterConfig(ray_address=sys.argv[1] or None), [RoleSpec("generator", 1, 1.0, 0.0)])
print("JOINED", json.dumps({"address": address, "cpus": ray.cluster_resources().get("CPU")}))
ray.shutdown()
"""


def _start_ray(ray_tmpdir: str, address: str = "") -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_TMPDIR=ray_tmpdir)
    proc = subprocess.run([sys.executable, "-c", PROBE, address], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("JOINED"))
    return json.loads(line.split(" ", 1)[1])


@pytest.fixture
def stale_session_file():
    """A private Ray temp directory whose address file points at a Ray that no longer exists
    (without the fix, ``ray.init(num_cpus=...)`` fails on exactly this: checked by hand)."""
    with tempfile.TemporaryDirectory(prefix="rr", dir="/tmp") as tmp:  # short: Ray's socket paths are bounded
        os.makedirs(os.path.join(tmp, "ray"))
        with open(os.path.join(tmp, "ray", "ray_current_cluster"), "w") as f:
            f.write("127.0.0.1:1")  # nothing listens there
        yield tmp


def test_local_run_ignores_a_stale_session(stale_session_file):
    joined = _start_ray(stale_session_file)
    assert joined["address"] != "127.0.0.1:1" and joined["cpus"] >= 1


def test_a_given_address_is_joined_without_local_arguments(ray_local, stale_session_file):
    head = ray_local.get_runtime_context().gcs_address
    joined = _start_ray(stale_session_file, head)
    assert joined["address"] == head
    assert joined["cpus"] == RAY_CPUS  # the head's own logical CPUs (the test run's Ray), not a new local Ray's
