"""Config validation, hooks, placement checks and helpers - all before any Ray work."""
import os

import pytest

from cluster.config import (
    ClusterConfig,
    JobConfig,
    RLConfig,
    SFTConfig,
    build_parser,
    load_function,
    records_from_args,
    validate,
)
from cluster.groups import split_evenly
from cluster.placement import RoleSpec, check_fits, total_request
from cluster.weight_sync import TensorMeta, bucket_plan


def test_command_line_is_derived_from_records():
    ns = build_parser("x").parse_args(["--generators", "3", "--zero-stage", "3", "--rl-lr", "1e-4"])
    job, cluster, sft, rl = records_from_args(ns)
    assert (cluster.generators, cluster.trainers, cluster.zero_stage, rl.rl_lr) == (3, 2, 3, 1e-4)
    assert job == JobConfig() and sft == SFTConfig()
    help_text = build_parser("x").format_help()
    assert "--generators GENERATORS" in help_text and "generator workers" in help_text


def test_bad_config_fails_before_ray():
    with pytest.raises(ValueError) as e:
        validate(JobConfig(model="/nonexistent/model"), ClusterConfig(zero_stage=4, generators=0),
                 SFTConfig(), RLConfig(algorithm="ppo2", group_size=1))
    msg = str(e.value)
    for part in ("--zero-stage must be 1, 2 or 3", "--generators must be at least 1", "--algorithm 'ppo2' is unknown",
                 "--group-size must be at least 2", "--model /nonexistent/model: not a local Hugging Face model"):
        assert part in msg


def test_load_function_resolves_and_names_failures(tmp_path):
    assert load_function("primitives.tasks:arithmetic_reward").__name__ == "arithmetic_reward"
    hook = tmp_path / "my_reward.py"
    hook.write_text("def reward(rollout):\n    return 1.0\n")
    assert load_function(f"{hook}:reward")(None) == 1.0
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        load_function("no_such_module:f")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        load_function("primitives.tasks:nope")
    with pytest.raises(ValueError, match="module:function"):
        load_function("primitives.tasks")


def test_gpus_on_cpu_cluster_fail_fast_with_advice():
    roles = [RoleSpec("generator", 2, 1, 1.0), RoleSpec("trainer", 2, 1)]
    with pytest.raises(ValueError) as e:
        check_fits(roles, {"CPU": 8.0}, [{"CPU": 8.0}])
    assert "role 'generator' needs 1 GPU per actor" in str(e.value)
    assert "set --generator-gpus 0" in str(e.value)
    with pytest.raises(ValueError, match="the roles need 4 CPU in all; the cluster has 2"):
        check_fits([RoleSpec("trainer", 4, 1)], {"CPU": 2.0}, [{"CPU": 1.0}, {"CPU": 1.0}])
    with pytest.raises(ValueError, match="needs 1 gen_node per actor"):
        check_fits([RoleSpec("generator", 1, 1, 0, {"gen_node": 1})], {"CPU": 4.0}, [{"CPU": 4.0}])
    check_fits(roles[1:], {"CPU": 8.0}, [{"CPU": 8.0}])  # fits: no error
    assert total_request(roles) == {"CPU": 4.0, "GPU": 2.0}


def test_split_evenly_and_bucket_plan():
    assert split_evenly(list(range(5)), 2) == [[0, 1], [2, 3, 4]]
    assert split_evenly([1], 3) == [[], [], [1]]
    meta = [TensorMeta("a", (10,), "float32"), TensorMeta("b", (20,), "float32"), TensorMeta("c", (5,), "bfloat16"),
            TensorMeta("d", (100,), "float32"), TensorMeta("e", (1,), "float32")]
    # 40 + 80 bytes fit 128; dtype change splits; 400 bytes alone; then e
    assert bucket_plan(meta, 128) == [[0, 1], [2], [3], [4]]
    assert bucket_plan(meta, 10 ** 6) == [[0, 1], [2], [3, 4]]
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        bucket_plan(meta, 0)


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--temperature", "-1"], "--temperature must be > 0"),
    (["--rl-lr", "-1"], "--rl-lr must be positive"),
    (["--sft-lr", "0"], "--sft-lr must be positive"),
    (["--algorithm", "ppo"], "--algorithm ppo needs a critic"),
    (["--mini-batches", "200", "--prompts-per-step", "4"], "every rank needs rows"),
    (["--is-level", "tokens"], "--is-level must be one of off, token, sequence"),
    (["--reward-fn", "no_such_module:reward"], "cannot import 'no_such_module'"),
    (["--algorithm", "gspo", "--ppo-epochs", "0"], "--ppo-epochs must be at least 1"),
])
def test_bad_flags_are_usage_errors_before_ray(argv, message, capsys, monkeypatch):
    """Each is a clean usage error (exit 2, no traceback) from parse(), which runs before Ray
    starts and before the SFT warm-up."""
    import sys

    from examples.grpo_tiny import parse

    monkeypatch.delitem(sys.modules, "ray", raising=False)
    with pytest.raises(SystemExit) as e:
        parse(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err
    assert "ray" not in sys.modules  # nothing imported Ray, let alone started it


def test_resume_names_the_checkpoint_format(tmp_path):
    from cluster.config import resume_errors
    from primitives.checkpoint import save_checkpoint
    from primitives.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    single = save_checkpoint(str(tmp_path / "single"), build_tiny_model(tok), tok)
    (errors,) = resume_errors(single)
    assert "single-process checkpoint" in errors and "--checkpoint-every" in errors
    assert "no train_state.json" in resume_errors(str(tmp_path))[0]
    cluster_ckpt = tmp_path / "cluster"
    (cluster_ckpt / "deepspeed").mkdir(parents=True)
    (cluster_ckpt / "train_state.json").write_text("{}")
    assert resume_errors(str(cluster_ckpt)) == []


def test_each_preset_keeps_its_own_kl_unless_given():
    """--algorithm dapo used to inherit the default job's KL 0.01 without a reference worker and
    failed at its first RL step; now the preset's KL stands and a given KL adds the reference."""
    from examples.grpo_tiny import parse
    from primitives.algorithms import uses_reference

    algo = parse([])[-1]
    assert (algo.name, algo.kl_coef, uses_reference(algo)) == ("grpo", 0.01, True)
    for name in ("dapo", "dr_grpo", "rloo", "gspo"):
        algo = parse(["--algorithm", name])[-1]
        assert algo.kl_coef == 0.0 and not uses_reference(algo), name
    algo = parse(["--algorithm", "dapo", "--kl-coef", "0.02"])[-1]
    assert algo.kl_coef == 0.02 and uses_reference(algo)


def test_output_dir_of_a_submitted_job_is_persistent(tmp_path):
    from cluster.config import inside_submitted_job, resolve_output_dir

    copy = "/tmp/ray/session_x/runtime_resources/working_dir_files/_ray_pkg_abc"
    job_env = {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}
    assert inside_submitted_job(job_env, cwd="/home/u/rayrl") and inside_submitted_job({}, cwd=copy)
    assert not inside_submitted_job({}, cwd="/home/u/rayrl")
    # outside a job: relative to the current directory; absolute paths as given
    assert resolve_output_dir("runs/x", {}, cwd="/home/u/rayrl") == "/home/u/rayrl/runs/x"
    assert resolve_output_dir("/data/run1/", job_env, cwd=copy) == "/data/run1"
    # inside a job: never into Ray's temporary copy
    assert resolve_output_dir("runs/x", {**job_env, "RAYRL_OUTPUT_ROOT": str(tmp_path)}, cwd=copy) == \
        str(tmp_path / "runs" / "x")
    assert resolve_output_dir("runs/x", {}, cwd=copy) == os.path.join(os.path.expanduser("~/rayrl"), "runs", "x")
    # ~ is expanded; a relative root or a path leaving the root is refused
    assert resolve_output_dir("~/r", job_env, cwd=copy) == os.path.join(os.path.expanduser("~"), "r")
    assert resolve_output_dir("x", {**job_env, "RAYRL_OUTPUT_ROOT": "~/shared"}, cwd=copy) == \
        os.path.join(os.path.expanduser("~"), "shared", "x")
    with pytest.raises(ValueError, match="must be an absolute path"):
        resolve_output_dir("x", {**job_env, "RAYRL_OUTPUT_ROOT": "out"}, cwd=copy)
    with pytest.raises(ValueError, match="leaves"):
        resolve_output_dir("../../x", {**job_env, "RAYRL_OUTPUT_ROOT": str(tmp_path)}, cwd=copy)
