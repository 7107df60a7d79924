"""Config validation, hooks, placement checks and helpers - all before any Ray work."""
import os

import pytest

from cluster.jobs.config import load_function
from cluster.ray_wing.groups import split_evenly
from cluster.ray_wing.placement import RoleSpec, check_fits, total_request
from rl_actors.sync_buckets import bucket_plan
from rl_actors.weight_sync import TensorMeta


def test_load_function_resolves_and_names_failures(tmp_path):
    assert load_function("primitives.fixtures.tasks:arithmetic_reward").__name__ == "arithmetic_reward"
    hook = tmp_path / "my_reward.py"
    hook.write_text("def reward(rollout):\n    return 1.0\n")
    assert load_function(f"{hook}:reward")(None) == 1.0
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        load_function("no_such_module:f")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        load_function("primitives.fixtures.tasks:nope")
    with pytest.raises(ValueError, match="module:function"):
        load_function("primitives.fixtures.tasks")


def test_gpus_on_cpu_cluster_fail_fast_with_advice():
    roles = [RoleSpec("generator", 2, 1, 1.0), RoleSpec("trainer", 2, 1)]
    with pytest.raises(ValueError) as e:
        check_fits(roles, {"CPU": 8.0}, [{"CPU": 8.0}])
    assert "role 'generator' needs 1 GPU per actor" in str(e.value)
    assert "set cluster.generator_gpus: 0" in str(e.value)
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
    (["--generation.temperature", "0"], "generation.temperature must be > 0"),
    (["--generation.temperature", "-1"], "generation.temperature must be > 0"),
    (["--algorithm.lr", "-1"], "algorithm.lr must be positive"),
    (["--sft.lr", "0"], "sft.lr must be positive"),
    (["--algorithm.mini-batches", "200", "--algorithm.prompts-per-step", "4"], "every rank needs rows"),
    (["--algorithm.is-level", "tokens"], "algorithm.is_level must be one of off, token, sequence"),
    (["--rewards.0.name", "no_such_module:reward"], "cannot import 'no_such_module'"),
    (["--algorithm.name", "gspo", "--algorithm.ppo-epochs", "0"], "algorithm.ppo_epochs must be at least 1"),
    (["--algorithm.name", "no_such_module:my_algorithm"], "cannot import 'no_such_module'"),
    (["--algorithm.overrides", "kl_fn", "k4"], "kl_fn: unknown name 'k4'"),
    (["--algorithm.overrides", "kl_fn", "primitives.maths.kl:kl_k2", "advantage_fn", "primitives.maths.kl:kl_k2"],
     "advantage_fn primitives.maths.kl.kl_k2 fails on a small sample"),
    (["--algorithm.name", "online_dpo", "--algorithm.overrides", "pair_selector", "none"],
     "pair_selector: unknown name 'none'"),
    (["--algorithm.name", "ppo", "--cluster.critics", "0"], "cluster.critics must be at least 1"),
])
def test_bad_values_are_usage_errors_before_ray(argv, message, monkeypatch, tmp_path):
    """Each is a clean exit naming the field (no traceback), before Ray is imported, before
    the model is built and before the SFT stage."""
    import sys

    from cluster.jobs.cli import run

    monkeypatch.delitem(sys.modules, "ray", raising=False)
    with pytest.raises(SystemExit) as e:
        run(["rl", "examples/configs/default.yaml", "--logging.out", str(tmp_path / "out"), *argv])
    assert message in str(e.value) and str(e.value).startswith("rayrl rl: ")
    assert "ray" not in sys.modules  # nothing imported Ray, let alone started it


def test_resume_names_the_checkpoint_format(tmp_path):
    from cluster.jobs.resume import resume_errors
    from primitives.fixtures.tiny import build_char_tokenizer, build_tiny_model
    from primitives.io.checkpoint import save_checkpoint

    tok = build_char_tokenizer()
    single = save_checkpoint(str(tmp_path / "single"), build_tiny_model(tok), tok)
    (errors,) = resume_errors(single)
    assert "single-process checkpoint" in errors and "checkpoint.every" in errors
    assert "no train_state.json" in resume_errors(str(tmp_path))[0]
    cluster_ckpt = tmp_path / "cluster"
    (cluster_ckpt / "deepspeed").mkdir(parents=True)
    (cluster_ckpt / "train_state.json").write_text("{}")
    assert resume_errors(str(cluster_ckpt)) == []


def test_each_preset_keeps_its_own_kl_unless_given():
    """algorithm.name dapo used to inherit the default job's KL 0.01 without a reference worker
    and failed at its first RL step; now the preset's KL stands and a given KL adds the reference."""
    from cluster.jobs.checks import algorithm_of as make_algorithm
    from cluster.jobs.config import RLConfig
    from primitives.maths.algorithms import uses_reference

    algo = make_algorithm(RLConfig(kl_coef=0.01))
    assert (algo.name, algo.kl_coef, uses_reference(algo)) == ("grpo", 0.01, True)
    assert make_algorithm(RLConfig()).kl_coef == 0.04  # the grpo preset's own
    for name in ("dapo", "dr_grpo", "rloo", "gspo"):
        algo = make_algorithm(RLConfig(name=name))
        assert algo.kl_coef == 0.0 and not uses_reference(algo), name
    algo = make_algorithm(RLConfig(name="dapo", kl_coef=0.02, ppo_epochs=2, is_level="sequence"))
    assert algo.kl_coef == 0.02 and uses_reference(algo) and (algo.ppo_epochs, algo.is_level) == (2, "sequence")
    # any other field through overrides, checked by name
    algo = make_algorithm(RLConfig(name="dapo", overrides={"clip_eps_high": 0.3, "entropy_coef": 0.001}))
    assert (algo.clip_eps_low, algo.clip_eps_high, algo.entropy_coef, len(algo.filters)) == (0.2, 0.3, 0.001, 1)
    with pytest.raises(ValueError, match="algorithm.overrides.clip_eps_hi: not an AlgorithmConfig field; did you "
                                         "mean 'clip_eps_high'"):
        make_algorithm(RLConfig(overrides={"clip_eps_hi": 0.3}))
    with pytest.raises(ValueError, match="set algorithm.kl_coef instead"):
        make_algorithm(RLConfig(overrides={"kl_coef": 0.3}))


def test_output_dir_of_a_submitted_job_is_persistent(tmp_path):
    from primitives.io.outputs import inside_submitted_job, resolve_output_dir

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


def test_a_scripts_output_dir_is_created_where_a_job_would_write(tmp_path, capsys):
    from primitives.io.outputs import output_dir

    copy = "/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_ab12"
    job_env = {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}", "RAYRL_OUTPUT_ROOT": str(tmp_path / "root")}
    assert output_dir("runs/a", job_env, cwd=copy) == str(tmp_path / "root" / "runs" / "a")
    assert os.path.isdir(tmp_path / "root" / "runs" / "a")
    assert f"writing outputs to {tmp_path / 'root' / 'runs' / 'a'}" in capsys.readouterr().out
    assert output_dir("b", {}, cwd=str(tmp_path)) == str(tmp_path / "b") and os.path.isdir(tmp_path / "b")
    assert capsys.readouterr().out == ""  # outside a submitted job: where the path says, quietly


@pytest.mark.parametrize("cluster, with_reference, with_critic, staleness, busy", [
    ({"generators": 1, "trainers": 1}, False, False, 0, (1, "1 generator worker")),  # the first phase on a tie
    ({"generators": 1, "trainers": 1}, False, False, 1, (2, "1 generator worker and 1 trainer rank")),
    ({"generators": 2, "trainers": 4}, True, False, 0, (4, "4 trainer ranks")),
    # a chunk a generator: its reference scores it once it is done, so no more scoring than chunks
    ({"generators": 1, "trainers": 1, "reference_workers": 2}, True, False, 0, (1, "1 generator worker")),
    ({"generators": 3, "trainers": 1, "reference_workers": 2}, True, False, 0, (3, "3 generator workers")),
    ({"generators": 1, "trainers": 1}, True, False, 1, (2, "1 generator worker and 1 trainer rank")),
    # two steps ahead: one step's chunks are scored while the next step's are generated
    ({"generators": 2, "trainers": 1, "reference_workers": 4}, True, False, 2,
     (5, "2 generator workers and 2 reference workers and 1 trainer rank")),
    ({"generators": 2, "trainers": 2, "reference_on_trainers": True}, True, False, 0, (2, "2 generator workers")),
    ({"generators": 1, "trainers": 2, "critics": 2}, False, True, 0, (4, "2 trainer ranks and 2 critic ranks")),
    ({"generators": 1, "trainers": 1, "critics": 1}, True, True, 1,
     (3, "1 generator worker and 1 trainer rank and 1 critic rank")),
    ({"generate_on_trainers": True, "generators": 0, "trainers": 2}, False, False, 1, (2, "2 trainer ranks")),
    ({"generate_on_trainers": True, "generators": 0, "trainers": 2, "reference_workers": 3}, True, False, 0,
     (2, "2 reference workers")),  # a tie with the trainers: a chunk per trainer rank, scored after
    ({"generators": 1, "trainers": 1, "scaling": {"policy": "idle", "maximum": 3}}, False, False, 1,
     (4, "3 generator workers and 1 trainer rank")),  # the most generators the run may grow to
])
def test_busy_actors_counts_the_phases_that_run_at_once(cluster, with_reference, with_critic, staleness, busy):
    from cluster.jobs.config import record_from_dict
    from cluster.ray_wing.config import ClusterConfig, busy_actors

    assert busy_actors(record_from_dict(ClusterConfig, cluster), with_reference, with_critic, staleness) == busy


def test_more_threads_than_cores_at_once_is_warned_with_the_count_that_fits():
    from cluster.ray_wing.config import ClusterConfig, oversubscribed

    two = ClusterConfig(generators=1, trainers=1, threads_per_actor=2)
    assert oversubscribed(two, False, False, staleness=0, cores=2) is None  # one phase at a time: 2 threads
    assert oversubscribed(two._replace(threads_per_actor=1), False, False, staleness=1, cores=2) is None
    assert oversubscribed(two, False, False, staleness=1, cores=2) == (
        "cluster.threads_per_actor 2 x 1 generator worker and 1 trainer rank busy at once (algorithm.max_staleness "
        "generates beside training) = 4 torch threads on this machine's 2 cores: threads beyond the cores wait on "
        "each other at every parallel operation, often costing more than they add; cluster.threads_per_actor 1 fits")
    assert oversubscribed(two, False, False, staleness=1, cores=4) is None
    warned = oversubscribed(ClusterConfig(generators=3, trainers=2, threads_per_actor=4), False, False, False, 8)
    assert warned.startswith("cluster.threads_per_actor 4 x 3 generator workers busy at once = 12 torch threads "
                             "on this machine's 8 cores") and warned.endswith("cluster.threads_per_actor 2 fits")
    more = ClusterConfig(generators=4, trainers=1, threads_per_actor=2)
    assert oversubscribed(more, False, False, 0, 2).endswith(
        "cluster.threads_per_actor 1 comes closest (4 actors for 2 cores)")  # more actors than cores
    assert oversubscribed(more._replace(threads_per_actor=1), False, False, 0, 2) is None  # no pool to wait on


@pytest.mark.parametrize("staleness, algorithm, address, warned", [
    (1, "grpo", None, True), (0, "grpo", None, False),
    (1, "dapo", None, False),  # dynamic sampling's filters generate a step at a time
    (1, "grpo", "127.0.0.1:6379", False),  # a cluster's nodes have cores of their own
])
def test_a_local_job_warns_of_oversubscribed_threads_before_ray_starts(monkeypatch, capsys, staleness, algorithm,
                                                                        address, warned):
    import cluster.jobs.rl as rl
    import cluster.ray_wing.roles as roles
    from cluster.jobs.config import RLJob, record_from_dict
    from cluster.jobs.inputs import job_extensions

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(roles, "start_ray", lambda cfg, specs: "started")
    job = record_from_dict(RLJob, {"data": {"task": "arithmetic"}, "algorithm": {
        "name": algorithm, "max_staleness": staleness, "kl_coef": 0.0}, "cluster": {
        "generators": 1, "trainers": 1, "threads_per_actor": 2, "ray_address": address}})
    assert rl.start_ray_for(job, job_extensions(job)) == "started"
    err = capsys.readouterr().err
    said = "warning: cluster.threads_per_actor 2 x 1 generator worker and 1 trainer rank busy at once"
    assert err.startswith(said) if warned else err == ""


def test_a_cluster_built_by_hand_refuses_trainer_settings_its_trainer_config_contradicts(monkeypatch):
    """``ClusterConfig`` and ``TrainerConfig`` both hold the ZeRO stage, micro-batch and checkpointing;
    the ranks run the TrainerConfig's. A cluster setting given (not a default) that the TrainerConfig
    contradicts is refused by name before Ray starts, for the trainers, an SFT group and the critics."""
    import cluster.ray_wing.roles as roles
    from cluster.ray_wing.config import ClusterConfig, trainer_config, trainer_conflicts
    from primitives.fixtures.tasks import arithmetic_reward
    from rl_actors.deepspeed_rank import TrainerConfig

    monkeypatch.setattr(roles, "start_ray", lambda *a: pytest.fail("Ray started"))
    given = ClusterConfig(zero_stage=3, micro_batch_size=8, gradient_checkpointing=True)
    assert trainer_conflicts(given, trainer_config(given, 1e-3)) == []  # a job's: built from the cluster
    assert trainer_conflicts(ClusterConfig(), TrainerConfig(zero_stage=3, micro_batch_size=4)) == []  # defaults
    assert trainer_conflicts(given._replace(zero_stage=2), TrainerConfig(zero_stage=3, micro_batch_size=8,
                                                                         gradient_checkpointing=True)) == []
    with pytest.raises(ValueError) as e:
        roles.build_rl_cluster("unused", given, TrainerConfig(micro_batch_size=8), arithmetic_reward,
                               with_reference=False)
    assert str(e.value) == (
        "cluster.zero_stage is 3 but the trainer group's TrainerConfig.zero_stage is 2, which its ranks would run: "
        "build the TrainerConfig with trainer_config(cluster, lr), or give both the same zero_stage; "
        "cluster.gradient_checkpointing is True but the trainer group's TrainerConfig.gradient_checkpointing is "
        "False, which its ranks would run: build the TrainerConfig with trainer_config(cluster, lr), or give both "
        "the same gradient_checkpointing")
    with pytest.raises(ValueError, match=r"^cluster.micro_batch_size is 8 but the trainer group's "
                                         r"TrainerConfig.micro_batch_size is 64"):
        roles.build_sft_cluster("unused", ClusterConfig(micro_batch_size=8), TrainerConfig())
    with pytest.raises(ValueError, match=r"^cluster.zero_stage is 3 but the critic group's"):
        roles.add_critics(roles.RLCluster(*[None] * 10), "unused", ClusterConfig(zero_stage=3), TrainerConfig())
