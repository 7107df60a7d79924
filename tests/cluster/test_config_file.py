"""The config file and the command line (cluster/jobs/config.py, cluster/jobs/cli.py): YAML -> records,
overrides, --help, --print-config, and errors that name the key, its line and the closest key."""
import glob
import os
import subprocess
import sys
from typing import get_args, get_origin, get_type_hints

import numpy as np
import pytest

from cluster.jobs.cli import parse
from cluster.jobs.config import (
    JOBS,
    ConfigError,
    RLJob,
    SFTJob,
    dump_config,
    load_job_config,
    record_from_dict,
)
from primitives.env.rewards import RewardSpec
from tests.conftest import ROOT

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "examples", "configs", "*.yaml")))


def _write(tmp_path, text, name="job.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_yaml_sections_fill_records_over_their_defaults(tmp_path):
    path = _write(tmp_path, """
model: {model_name_or_path: /m, dtype: bfloat16}
data:
  path: prompts.jsonl
  fields: {prompt: question, answer: solution}
  eval_set: {size: 0.1}
rewards:
  - {name: exact_match, weight: 0.7, kwargs: {parser: boxed}}
  - {name: regex_format, weight: 0.3, kwargs: {pattern: '\\\\boxed'}, label: format}
algorithm: {lr: 1e-5, steps: 3}
""")
    job = load_job_config(path, RLJob)
    assert job.model.model_name_or_path == "/m" and job.model.dtype == "bfloat16" and job.model.device == "auto"
    # a section given in the file starts from its record's defaults: no task left over from RLJob()
    assert job.data.task is None and job.data.path == "prompts.jsonl" and job.data.shuffle is True
    assert (job.data.fields.prompt, job.data.fields.answer, job.data.eval_set.size) == ("question", "solution", 0.1)
    assert job.rewards == (RewardSpec("exact_match", 0.7, {"parser": "boxed"}),
                           RewardSpec("regex_format", 0.3, {"pattern": "\\\\boxed"}, "format"))
    # YAML 1.1 reads 1e-5 (no dot) as a string; a float field takes it as the number
    assert job.algorithm.lr == 1e-5 and isinstance(job.algorithm.lr, float) and job.algorithm.steps == 3
    assert job.algorithm.name == "grpo" and job.cluster == RLJob().cluster  # untouched sections keep defaults
    # a section fills the job's own default of it: an SFT job's sft.steps and logging.out stay
    sft = load_job_config(_write(tmp_path, "sft: {path: d.jsonl}\nlogging: {console_every: 5}\n"), SFTJob)
    assert (sft.sft.path, sft.sft.steps, sft.logging.out, sft.logging.console_every) == ("d.jsonl", 100, "runs/sft", 5)
    assert sft.cluster.generators == 0
    # a held-out size is a share (float) or a count (int): YAML's int stays a count
    job = load_job_config(_write(tmp_path, "data: {path: p.jsonl, eval_set: {size: 64}}\n"), RLJob)
    assert job.data.eval_set.size == 64 and isinstance(job.data.eval_set.size, int)
    with pytest.raises(ConfigError, match="data.eval_set.size: expected int or float, got 'ten'"):
        load_job_config(_write(tmp_path, "data: {eval_set: {size: ten}}\n"), RLJob)


@pytest.mark.parametrize("text, message", [
    ("algoritm: {lr: 1}\n", "job.yaml:1: algoritm: unknown key; did you mean 'algorithm'?"),
    ("algorithm:\n  name: grpo\n  learning_rate: 1\n", "job.yaml:3: algorithm.learning_rate: unknown key"),
    ("data:\n  fields: {promt: q}\n", "job.yaml:2: data.fields.promt: unknown key; did you mean 'prompt'?"),
    ("rewards:\n  - name: exact_match\n  - {name: x, wieght: 2}\n", "job.yaml:3: rewards.1.wieght: unknown key; "
                                                                    "did you mean 'weight'?"),
    ("algorithm: {steps: many}\n", "job.yaml:1: algorithm.steps: expected int, got 'many'"),
    ("algorithm: {steps: 2.5}\n", "algorithm.steps: expected int, got 2.5"),
    ("cluster: {pin_roles: 1}\n", "cluster.pin_roles: expected bool, got 1"),
    ("algorithm: [1, 2]\n", "algorithm: expected a mapping of RLConfig fields"),
    ("rewards: {name: x}\n", "rewards: expected a list"),
    ("rewards:\n  - {weight: 2}\n", "rewards.0: missing required key 'name'"),
    ("data: {task_kwargs: {a: [1, 2]}}\n", "data.task_kwargs.a: expected a number, string or boolean"),
    ("model: {model_name_or_path: null}\n", "model.model_name_or_path: may not be empty"),
    ("- a\n- b\n", "expected a mapping of sections"),
    ("algorithm: {lr: 1\n", "not valid YAML"),
    ("algorithm: {name: dapo, lr: 1.0e-5}\nsft: {steps: 0}\nalgorithm: {steps: 10}\n",
     "'algorithm' is written twice in one mapping (lines 1 and 3); the second would replace the first"),
])
def test_bad_files_name_the_key_and_line(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        load_job_config(_write(tmp_path, text), RLJob)
    assert message in str(e.value)


def test_numbers_with_an_exponent_and_booleans_reach_functions_and_overrides_typed(tmp_path):
    """PyYAML reads ``1e-3`` (no dot) as a string (YAML 1.1): a shaping function's ``coef`` then failed
    at the first RL step on the reward workers, and ``value_clip: 1e9`` was refused as "must be > 0, got
    1e9". The command line's ``false`` in ``algorithm.overrides`` (tyro reads only ``False``) was the string
    ``'false'``, which is true (``kl_in_reward false`` kept the KL in the reward). Each now arrives as the
    number or boolean."""
    from cluster.jobs.checks import ConfigErrors, algorithm_of
    from cluster.jobs.extensions import build_shaping
    from primitives.types import Rollout

    text = ("algorithm:\n  name: ppo\n  overrides: {value_clip: 1e9, gamma: 1}\n"
            "shaping:\n  - {name: length_penalty, kwargs: {coef: 1e-3, target_len: 3}}\n")
    job = load_job_config(_write(tmp_path, text), RLJob)
    assert job.shaping[0].kwargs == {"coef": 0.001, "target_len": 3}
    assert algorithm_of(job.algorithm).value_clip == 1e9 and isinstance(algorithm_of(job.algorithm).gamma, float)
    rollout = Rollout(uid="e0/i0/s0", group="e0/i0", prompt="p", prompt_ids=np.arange(1), completion_ids=np.arange(5),
                      loss_mask=np.ones(5, np.float32), logprobs=np.zeros(5, np.float32))
    assert build_shaping(job)(rollout, 1.0) == pytest.approx(1.0 - 0.001 * 2)  # 2 tokens over the target of 3
    path = os.path.join(ROOT, "examples", "configs", "default.yaml")
    _, cli, _ = parse(["rl", path, "--algorithm.name", "ppo", "--algorithm.overrides", "filter_overlong", "true",
                       "whiten_advantages", "FALSE", "--print-config"])
    algo = algorithm_of(cli.algorithm)
    assert algo.filter_overlong is True and algo.whiten_advantages is False
    with pytest.raises(ConfigErrors, match="algorithm.overrides.kl_in_reward: expected bool, got 'maybe'"):
        algorithm_of(cli.algorithm._replace(overrides={"kl_in_reward": "maybe"}))
    from cluster.jobs.extensions import build_ref_update

    wrong = load_job_config(_write(tmp_path, "reference: {update: ema, kwargs: {decay: high}}\n"), RLJob)
    with pytest.raises(ConfigErrors, match="reference.update: '<=' not supported"):  # named, not a traceback
        build_ref_update(wrong)


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: /no/such.yaml"):
        load_job_config("/no/such.yaml", RLJob)
    assert load_job_config(_write(tmp_path, "# nothing\n"), RLJob) == RLJob()
    assert load_job_config(None, SFTJob) == SFTJob()


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_configs_load_and_print_back_to_themselves(path, tmp_path):
    """--print-config's YAML loads back to the same record (the resolved config saved in a run
    directory can be run again as it is)."""
    job_type = SFTJob if os.path.basename(path).startswith("sft") else RLJob
    job = load_job_config(path, job_type)
    again = load_job_config(_write(tmp_path, dump_config(job), "printed.yaml"), job_type)
    assert again == job


def test_overrides_on_the_command_line(tmp_path):
    path = os.path.join(ROOT, "examples", "configs", "default.yaml")
    command, job, print_only = parse(["rl", path, "--algorithm.lr", "1e-5", "--cluster.generators", "3",
                                      "--rewards.0.kwargs", "parser", "last_number", "--data.shuffle", "False",
                                      "--generation.stop", "\n", ";", "--print-config"])
    assert command == "rl" and print_only
    assert job.algorithm.lr == 1e-5 and job.cluster.generators == 3 and job.data.shuffle is False
    assert job.rewards[0].kwargs == {"parser": "last_number"} and job.generation.stop == ("\n", ";")
    # the rest is the file's
    assert job.algorithm.kl_coef == 0.01 and job.sft.steps == 1500 and job.data.task_kwargs["num_heldout"] == 256


def test_a_second_command_line_parses_no_record_source_and_keeps_the_help(monkeypatch, capsys):
    """tyro reads the records' field comments from their source, parsing the whole module for each record,
    and clears its caches at every call (``keep_class_sources``): a process's second command line has tyro
    read no record's source again and takes its own overrides; a second help reads none and still documents
    the fields."""
    import inspect

    path = os.path.join(ROOT, "examples", "configs", "default.yaml")
    parse(["rl", path, "--algorithm.lr", "1e-5"])
    read, getsource = [], inspect.getsource

    def counted(obj):
        if sys._getframe(1).f_code.co_filename.endswith(os.path.join("tyro", "_docstrings.py")):
            read.append(obj)
        return getsource(obj)

    monkeypatch.setattr(inspect, "getsource", counted)
    _, job, _ = parse(["rl", path, "--algorithm.lr", "2e-5", "--cluster.generators", "3"])
    assert read == [] and job.algorithm.lr == 2e-5 and job.cluster.generators == 3
    from tyro import _docstrings

    _docstrings._ClassTokenization.make.cache_clear()  # what a process's first command line reads
    parse(["rl", path])
    assert len(read) >= 5
    monkeypatch.setenv("COLUMNS", "200")
    for _ in range(2):  # the help reads the comments of records a parse does not need, once
        read.clear()
        with pytest.raises(SystemExit):
            parse(["rl", "--help"])
        assert "RL learning rate" in capsys.readouterr().out
    assert read == []


def test_unknown_override_names_the_closest_flag(capsys):
    with pytest.raises(SystemExit):
        parse(["rl", "--algoritm.lr", "1"])
    err = capsys.readouterr().err
    assert "--algoritm.lr" in err and "--algorithm.lr" in err


def test_bad_command_and_bad_file_are_usage_errors(tmp_path):
    with pytest.raises(SystemExit, match="expected a command, rl or sft, got 'train'"):
        parse(["train"])
    with pytest.raises(SystemExit, match=r"rayrl rl: .*job.yaml:1: algoritm: unknown key"):
        parse(["rl", _write(tmp_path, "algoritm: {}\n")])


def _is_records(tp) -> bool:
    inner = get_args(tp)[0] if get_args(tp) else None
    return isinstance(inner, type) and hasattr(inner, "_fields")


def _fields(record, prefix=""):
    """Every leaf field of a job record as a command-line flag."""
    for name, tp in get_type_hints(record).items():
        flag = f"{prefix}{name.replace('_', '-')}"
        default = record._field_defaults.get(name)
        if isinstance(tp, type) and hasattr(tp, "_fields"):
            yield from _fields(tp, flag + ".")
        elif get_origin(tp) is tuple and not default and _is_records(tp):
            continue  # a list of records empty by default (shaping, tools.use, schedule.phases): tyro makes no flag
        elif isinstance(default, tuple) and default and hasattr(default[0], "_fields"):
            for i in range(len(default)):
                yield from _fields(type(default[0]), f"{flag}.{i}.")
        else:
            yield "--" + flag


@pytest.mark.parametrize("command", sorted(JOBS))
def test_help_documents_every_field(command):
    """``rayrl <command> --help`` (run as a user would, from a checkout) lists every field of the
    job's records, each with its documentation."""
    env = {**os.environ, "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "cluster", command, "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    flags = list(_fields(JOBS[command]))
    assert len(flags) > 30
    missing = [f for f in flags if f not in out.stdout]
    assert not missing
    for doc in ("RL learning rate", "completions per prompt (G)", "DeepSpeed ZeRO stage (1, 2 or 3)"):
        assert doc in out.stdout or command == "sft"


def test_print_config_prints_yaml_and_starts_nothing():
    """Through the installed console script (its exit status is 0 on success, with nothing on
    stderr) and through ``python -m cluster``."""
    rayrl = os.path.join(os.path.dirname(sys.executable), "rayrl")
    args = ["rl", "examples/configs/default.yaml", "--algorithm.steps", "7", "--print-config"]
    script = subprocess.run([rayrl, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert script.returncode == 0 and script.stderr == "", script.stderr
    out = subprocess.run([sys.executable, "-m", "cluster", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == script.stdout
    import yaml

    printed = yaml.safe_load(out.stdout)
    assert printed["algorithm"]["steps"] == 7 and printed["model"]["model_name_or_path"] == "tiny"
    assert record_from_dict(RLJob, printed).algorithm.steps == 7


VLLM_TOP_P = """
data: {task: arithmetic}
generation: {top_p: 0.9}
cluster: {generator_backend: vllm}
"""


def test_vllm_with_top_p_and_an_importance_weight_is_refused_before_ray(tmp_path, monkeypatch):
    """vLLM's behaviour logprobs are renormalised over the top-p / top-k set, the trainer's are of
    the full softmax(logits / T): with the importance weight applied (algorithm.is_level token, the
    default) the job stops before Ray starts, naming the fields and what would be right."""
    import cluster.jobs.rl as job_module
    from cluster.jobs.cli import run

    def start_ray_for(job, extensions):
        raise AssertionError("Ray was started for a job its checks should have refused")

    monkeypatch.setattr(job_module, "start_ray_for", start_ray_for)
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    with pytest.raises(SystemExit) as e:
        run(["rl", _write(tmp_path, VLLM_TOP_P), "--logging.out", str(tmp_path / "out")])
    assert ("generation.top_p 0.9 with cluster.generator_backend vllm and algorithm.is_level token: vLLM's behaviour "
            "logprobs are renormalised") in str(e.value)
    assert "use generation.top_p 1 and generation.top_k 0, or cluster.generator_backend hf" in str(e.value)
    assert "ray" not in sys.modules


REFUSED = "with cluster.generator_backend"


@pytest.mark.parametrize("changes, refused", [
    ({"generation": {"top_k": 20}, "cluster": {"generator_backend": "vllm"}}, "generation.top_k 20 with"),
    ({"generation": {"top_p": 0.5, "top_k": 4}, "cluster": {"generator_backend": "vllm"},
      "algorithm": {"is_level": "sequence"}}, "generation.top_p 0.5 and generation.top_k 4 with"),
    ({"generation": {"top_p": 0.9}, "cluster": {"generator_gpus": 1}},  # auto: vLLM on GPU generators
     "cluster.generator_backend auto (vLLM on generator workers with cluster.generator_gpus 1.0)"),
    ({"generation": {"top_p": 0.9}, "cluster": {"generator_backend": "hf"}}, None),  # HF: full distribution
    ({"generation": {"top_p": 0.9}, "cluster": {"generator_backend": "vllm"}, "algorithm": {"is_level": "off"}},
     None),  # the weight is measured, not applied
    ({"generation": {"top_p": 0.9}, "cluster": {"generator_backend": "vllm"}, "algorithm": {"name": "online_dpo"}},
     None),  # a pairwise loss has no ratio to weight
    ({"generation": {"top_p": 0.9}}, None),  # auto without generator GPUs: HF
    ({"generation": {"top_p": 0.9}, "cluster": {"generator_gpus": 1, "generate_on_trainers": True, "generators": 0}},
     None),  # generation on the trainer ranks: HF
    ({"cluster": {"generator_backend": "vllm"}}, None),  # no truncation: vLLM's logprobs are the full ones
    ({"generation": {"temperature": 0.005}, "cluster": {"generator_backend": "vllm"}},
     "generation.temperature 0.005 with cluster.generator_backend vllm: vLLM raises a temperature below 0.01"),
    ({"generation": {"temperature": 0.005}, "cluster": {"generator_backend": "hf"}}, None),  # HF samples at 0.005
    ({"generation": {"temperature": 0.0}, "cluster": {"generator_backend": "vllm"}}, None),  # greedy
    ({"generation": {"temperature": 0.01}, "cluster": {"generator_backend": "vllm"}}, None),
], ids=["vllm-top_k", "vllm-both-sequence", "auto-gpus", "hf", "is_level-off", "online_dpo", "auto-cpu",
        "on-trainers", "vllm-untruncated", "vllm-below-0.01", "hf-below-0.01", "vllm-greedy", "vllm-0.01"])
def test_which_generator_and_truncation_go_together(changes, refused):
    from cluster.jobs.checks import rl_errors

    job = record_from_dict(RLJob, {"data": {"task": "arithmetic"}, **changes})
    errors = [e for e in rl_errors(job) if REFUSED in e]
    assert (errors == []) if refused is None else (len(errors) == 1 and refused in errors[0]), errors


@pytest.mark.parametrize("cluster, refused", [
    ({"generator_gpus": 1}, True),  # generator workers on GPUs
    ({"generate_on_trainers": True, "generators": 0, "trainer_gpus": 1}, True),  # the trainer ranks on GPUs
    ({"generate_on_trainers": True, "generators": 0, "generator_gpus": 1}, False),  # the generators' GPUs unused
    ({"trainer_gpus": 1}, False),  # generator workers on the CPU
    ({}, False),
], ids=["generator-gpus", "trainer-gpus-generating", "generator-gpus-unused", "trainer-gpus-only", "cpu"])
def test_packed_decoding_is_refused_where_generation_runs_on_gpus(cluster, refused):
    from cluster.jobs.checks import rl_errors

    job = record_from_dict(RLJob, {"data": {"task": "arithmetic"}, "generation": {"decode": "packed"},
                                   "cluster": cluster})
    errors = [e for e in rl_errors(job) if "generation.decode packed" in e]
    assert errors == (["generation.decode packed packs weights for oneDNN on a CPU, and generation here runs on "
                       "GPUs (cluster.generator_gpus, or cluster.trainer_gpus with cluster.generate_on_trainers): "
                       "use auto"] if refused else []), errors


@pytest.mark.parametrize("lora,stage,checkpointing,version,refused", [
    (True, 3, True, "0.19.2", True), (True, 3, True, "0.15.4", True),
    (True, 3, True, "0.19.8", False), (True, 3, True, "0.20.0+cu130", False),
    (True, 2, True, "0.19.2", False), (False, 3, True, "0.19.2", False), (True, 3, False, "0.19.2", False),
])
def test_lora_checkpointing_under_zero3_needs_a_deepspeed_that_recomputes_frozen_weights(
        monkeypatch, lora, stage, checkpointing, version, refused):
    """By hand, and through the job's checks with the installed version read from the package metadata."""
    import importlib.metadata

    from cluster.jobs.checks import rl_errors
    from rl_actors.common import frozen_recompute_error

    error = frozen_recompute_error(lora, stage, checkpointing, version)
    assert (error is not None) is refused
    if refused:
        assert error.endswith(f"this is DeepSpeed {version}: upgrade it, or use cluster.zero_stage 2, or no "
                              "checkpointing") and "needs DeepSpeed 0.19.8 or later" in error
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version if name == "deepspeed" else real(name))
    job = record_from_dict(RLJob, {"data": {"task": "arithmetic"}, "model": {"lora": {"rank": 4 if lora else 0}},
                                   "cluster": {"zero_stage": stage, "gradient_checkpointing": checkpointing}})
    assert [e for e in rl_errors(job) if "needs DeepSpeed" in e] == ([error] if refused else [])


@pytest.mark.parametrize("cluster, refused", [
    ({"generator_backend": "vllm"}, "vllm"),
    ({"generator_gpus": 1}, "auto (vLLM on generator workers with cluster.generator_gpus 1.0)"),
    ({"generator_backend": "hf", "generator_gpus": 1}, None),
    ({"generate_on_trainers": True, "generators": 0, "trainer_gpus": 1}, None),  # the trainers' HF module
    ({}, None),  # auto on the CPU: HF
], ids=["vllm", "auto-gpus", "hf-gpus", "on-trainers", "cpu"])
def test_max_batch_rows_is_refused_where_vllm_generates(cluster, refused):
    from cluster.jobs.checks import rl_errors

    job = record_from_dict(RLJob, {"data": {"task": "arithmetic"}, "generation": {"max_batch_rows": 16},
                                   "cluster": cluster})
    errors = [e for e in rl_errors(job) if "max_batch_rows" in e]
    assert errors == ([f"generation.max_batch_rows 16 caps the rows an HF generator decodes together; "
                       f"cluster.generator_backend {refused} generates with vLLM, which schedules its own batches "
                       "within its KV-cache memory (cluster.vllm.gpu_memory_utilization, cpu_kv_cache_gib): use 0, "
                       "or cluster.generator_backend hf"] if refused else []), errors


@pytest.mark.parametrize("cluster, refused", [
    ({"generator_backend": "vllm", "vllm": {"tensor_parallel_size": 2}},
     "cluster.vllm.tensor_parallel_size 2 splits the model over GPUs; the generators run on CPU"),
    ({"generator_backend": "vllm", "generator_gpus": 2, "trainer_gpus": 1, "vllm": {"tensor_parallel_size": 2}},
     "cluster.vllm.tensor_parallel_size 2: each of an engine's GPU workers would need a rank of its own"),
    ({"generator_backend": "vllm", "generator_gpus": 1}, None),  # vLLM on GPUs takes CPU trainers' gloo, as HF does
    ({"generator_gpus": 1}, None),
    ({"generator_backend": "vllm", "vllm": {"enable_sleep_mode": True}},
     "cluster.vllm.enable_sleep_mode releases GPU memory; the generators run on CPU"),
    ({"vllm": {"gpu_memory_utilization": 1.5}}, "cluster.vllm.gpu_memory_utilization must be in (0, 1], got 1.5"),
    ({"vllm": {"cpu_kv_cache_gib": 0}}, "cluster.vllm.cpu_kv_cache_gib must be at least 1, got 0"),
    ({"vllm": {"max_model_len": 1}}, "cluster.vllm.max_model_len must be at least 2 tokens, got 1"),
    ({"generator_backend": "vllm", "generator_gpus": 1, "trainer_gpus": 1, "vllm": {"enable_sleep_mode": True,
                                                                                      "gpu_memory_utilization": 0.5}},
     None),
    ({"generator_backend": "hf", "generator_gpus": 1}, None),  # HF generators on GPUs take the trainers' gloo
    ({"generator_backend": "vllm", "vllm": {"max_model_len": 64, "cpu_kv_cache_gib": 2}}, None),
    ({"generator_backend": "vllm", "vllm": {"block_size": 0}}, "cluster.vllm.block_size must be positive, got 0"),
    ({"generator_backend": "vllm", "vllm": {"block_size": 48}},
     "cluster.vllm.block_size 48: vLLM's CPU attention takes multiples of 32 tokens"),
    ({"generator_backend": "vllm", "vllm": {"block_size": 64}}, None),
    ({"generator_backend": "vllm", "generator_gpus": 1, "vllm": {"block_size": 16}}, None),
], ids=["tp-on-cpu", "tp-on-gpus", "vllm-gpus-cpu-trainers", "auto-gpus-cpu-trainers", "sleep-on-cpu", "gpu-share",
        "kv-cache", "max-len", "gpu-ok", "hf-gpus-cpu-trainers", "cpu-ok", "block-zero", "block-48-on-cpu",
        "block-64-on-cpu", "block-16-on-gpus"])
def test_vllm_settings_that_cannot_apply_are_named_before_ray(cluster, refused):
    from cluster.jobs.checks import rl_errors

    job = record_from_dict(RLJob, {"data": {"task": "arithmetic"}, "cluster": cluster})
    errors = [e for e in rl_errors(job) if "cluster.vllm." in e or "generator_gpus" in e]
    assert (errors == []) if refused is None else (len(errors) == 1 and refused in errors[0]), errors


@pytest.mark.parametrize("cluster, refused", [
    ({"generate_on_trainers": True, "generators": 4}, "cluster.generators 4 would be ignored: cluster.generate_on_"),
    ({"generate_on_trainers": True, "generator_gpus": 1}, "cluster.generator_gpus 1.0 would be ignored"),
    ({"generate_on_trainers": True, "vllm": {"max_model_len": 64}}, "cluster.vllm VLLMConfig("),
    ({"reference_on_trainers": True, "reference_workers": 3}, "cluster.reference_workers 3 would be ignored: cluster"),
    ({"reference_on_trainers": True, "reference_gpus": 0.5}, "cluster.reference_gpus 0.5 would be ignored"),
], ids=["generators", "generator-gpus", "vllm", "reference-workers", "reference-gpus"])
def test_settings_of_roles_that_do_not_run_are_refused(cluster, refused):
    from cluster.jobs.checks import rl_errors

    job = record_from_dict(RLJob, {"data": {"task": "arithmetic"}, "cluster": cluster})
    errors = [e for e in rl_errors(job) if "would be ignored" in e]
    assert len(errors) == 1 and refused in errors[0], errors


def test_no_workers_of_a_role_on_the_trainers_is_a_valid_layout():
    """0 generator and 0 reference workers say what the trainer ranks do; the defaults pass too."""
    from cluster.jobs.checks import rl_errors

    for extra in ({"generators": 0, "reference_workers": 0}, {}):
        cluster = {"generate_on_trainers": True, "reference_on_trainers": True, **extra}
        assert rl_errors(record_from_dict(RLJob, {"data": {"task": "arithmetic"}, "cluster": cluster})) == []
    bare = record_from_dict(RLJob, {"data": {"task": "arithmetic"}, "cluster": {"reference_workers": 0}})
    assert any("cluster.reference_workers must be at least 1" in e for e in rl_errors(bare))


def test_an_sft_job_refuses_the_rl_roles(tmp_path):
    from cluster.jobs.checks import cluster_errors

    base = SFTJob._field_defaults["cluster"]
    assert cluster_errors(base, rl_roles=False, base=base) == []
    errors = cluster_errors(base._replace(reward_workers=2, critics=3), rl_roles=False, base=base)
    assert [e.split(" would")[0] for e in errors] == ["cluster.reward_workers 2", "cluster.critics 3"]


@pytest.mark.parametrize("cluster, refused", [
    ({"start_timeout_s": 0}, "cluster.start_timeout_s must be positive"),
    ({"start_timeout_s": -5.0}, "cluster.start_timeout_s must be positive"),
    ({"start_timeout_s": 900, "call_timeout_s": 30}, None),
    ({}, None),
], ids=["zero", "negative", "longer-than-calls", "default"])
def test_the_start_timeout_is_positive_or_none(cluster, refused):
    from cluster.jobs.checks import rl_errors

    job = record_from_dict(RLJob, {"data": {"task": "arithmetic"}, "cluster": cluster})
    errors = [e for e in rl_errors(job) if "start_timeout_s" in e]
    assert (errors == []) if refused is None else (len(errors) == 1 and refused in errors[0]), errors
