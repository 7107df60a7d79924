"""k8s/ manifests validate against the KubeRay CRD schemas (../shared/kuberay-crds), their pod
templates against Kubernetes' own schemas, and the RayJob's entrypoint is a valid command."""
import functools
import os
import shlex

import pytest
import yaml

from tests.conftest import ROOT

CRDS = os.path.join(os.path.dirname(ROOT), "shared", "kuberay-crds")
K8S = os.path.join(ROOT, "k8s")


def _schema(kind_file: str, version: str = "v1") -> dict:
    path = os.path.join(CRDS, kind_file)
    if not os.path.isfile(path):
        pytest.skip(f"KubeRay CRDs not found at {CRDS}")
    return _crd_schema(path, version)


@functools.lru_cache(maxsize=None)
def _crd_schema(path: str, version: str) -> dict:
    """The CRD's schema, read once per run (1-1.4 MB of YAML: 2 s with the pure-Python loader)."""
    with open(path) as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]


def _validate(doc: dict, kind_file: str) -> None:
    """``jsonschema.validate`` without its check of KubeRay's schema against the metaschema on
    every call (1.8 s each: the schema is KubeRay's, not ours)."""
    import jsonschema

    schema = _schema(kind_file)
    error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(doc))
    if error is not None:  # the error jsonschema.validate raises
        raise error


def _manifest(name: str) -> dict:
    with open(os.path.join(K8S, name)) as f:
        return yaml.safe_load(f)


def _pod_templates(cluster_spec: dict) -> list:
    groups = [cluster_spec["headGroupSpec"]] + cluster_spec.get("workerGroupSpecs", [])
    return [g["template"] for g in groups]


@pytest.mark.parametrize("name,crd", [("raycluster.yaml", "ray.io_rayclusters.yaml"),
                                      ("rayjob.yaml", "ray.io_rayjobs.yaml")])
def test_manifest_matches_kuberay_crd(name, crd):
    doc = _manifest(name)
    _validate(doc, crd)
    assert doc["apiVersion"] == "ray.io/v1"


def test_schema_check_catches_a_broken_manifest():
    import jsonschema

    doc = _manifest("raycluster.yaml")
    doc["spec"]["workerGroupSpecs"][0]["replicas"] = "two"  # must be an integer
    with pytest.raises(jsonschema.ValidationError, match="'two' is not of type 'integer'"):
        _validate(doc, "ray.io_rayclusters.yaml")
    del doc["spec"]["headGroupSpec"]
    with pytest.raises(jsonschema.ValidationError, match="headGroupSpec"):
        _validate(doc, "ray.io_rayclusters.yaml")


@pytest.mark.parametrize("name,path", [("raycluster.yaml", ("spec",)), ("rayjob.yaml", ("spec", "rayClusterSpec"))])
def test_pod_templates_are_valid_kubernetes(name, path):
    import kubernetes_validate

    spec = _manifest(name)
    for key in path:
        spec = spec[key]
    for template in _pod_templates(spec):
        doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_worker_groups_advertise_the_pinned_resources():
    from cluster.ray_wing.roles import NODE_GROUP_PINS

    groups = {g["groupName"]: g for g in _manifest("raycluster.yaml")["spec"]["workerGroupSpecs"]}
    assert "generator_node" in groups["generators"]["rayStartParams"]["resources"]
    assert "trainer_node" in groups["trainers"]["rayStartParams"]["resources"]
    assert set(NODE_GROUP_PINS["generator"]) == {"generator_node"}
    assert set(NODE_GROUP_PINS["trainer"]) == {"trainer_node"}


def test_rayjob_runs_the_general_job_with_its_config_from_the_configmap(tmp_path):
    """The entrypoint is `python -m cluster rl <file>`, the file is the ConfigMap's job.yaml
    mounted on the head (where the driver runs), and that config passes the job's own checks."""
    import kubernetes_validate

    from cluster.jobs.checks import rl_errors
    from cluster.jobs.cli import parse

    job_manifest, config_map = _manifest("rayjob.yaml"), _manifest("job-config.yaml")
    kubernetes_validate.validate(config_map, "1.30", strict=True)
    argv = shlex.split(job_manifest["spec"]["entrypoint"])
    assert argv[:4] == ["python", "-m", "cluster", "rl"]
    config_path = argv[4]
    head = job_manifest["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mount = next(m for m in head["containers"][0]["volumeMounts"] if config_path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in head["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    key = os.path.relpath(config_path, mount["mountPath"])
    (tmp_path / key).write_text(config_map["data"][key])
    command, job, _ = parse(["rl", str(tmp_path / key), *argv[5:]])
    assert rl_errors(job) == []
    assert job.cluster.pin_roles and job.cluster.generator_gpus == 1 and job.cluster.trainer_gpus == 1
    # a retried driver (backoffLimit) continues from the newest checkpoint, which is on the shared volume
    assert job_manifest["spec"]["backoffLimit"] > 0 and job.checkpoint.resume == "auto"
    assert not os.path.isabs(job.logging.out)  # under RAYRL_OUTPUT_ROOT, checked below
    # outputs and the converted model go to the volume every pod mounts
    env = yaml.safe_load(job_manifest["spec"]["runtimeEnvYAML"])["env_vars"]
    groups = [head] + [g["template"]["spec"] for g in job_manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"]]
    for spec in groups:
        shared = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]
                  if any(v["name"] == m["name"] and "persistentVolumeClaim" in v for v in spec["volumes"])}
        assert any(env["RAYRL_OUTPUT_ROOT"].startswith(p) and env["RAYRL_MODEL_CACHE"].startswith(p) for p in shared)
