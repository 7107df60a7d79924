"""The general jobs (cluster/jobs/): every bad input fails in prepare, before Ray, naming the
culprit; the default job (examples/configs/default.yaml) lifts held-out accuracy; a job resumes
from its checkpoint; the SFT job trains, evaluates, checkpoints and resumes exactly."""
import glob
import json
import os
import sys

import numpy as np
import pytest

from cluster.jobs.checks import ConfigErrors
from cluster.jobs.config import (
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    RLConfig,
    RLJob,
    SFTConfig,
    SFTJob,
    ShapingSpec,
)
from cluster.jobs.inputs import prepare_rl, vllm_room_errors
from cluster.jobs.sft import run_sft
from primitives.env.rewards import RewardSpec
from primitives.io.data import EvalData, FieldMap, PromptFormat, PromptItem, SFTFields
from primitives.types import LoraConfig, ModelConfig, VLLMConfig
from tests.conftest import ROOT, ray_up

DEFAULT = os.path.join(ROOT, "examples", "configs", "default.yaml")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _file_job(tmp_path, model, **data):
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "level": a % 3} for a in range(20)]
    data.setdefault("path", _jsonl(tmp_path / "prompts.jsonl", rows))
    data.setdefault("eval_set", EvalData(size=0.25))
    return RLJob(model=ModelConfig(model), data=DataConfig(**data),
                 logging=LoggingConfig(out=str(tmp_path / "out")))


def test_a_prompt_file_job_is_prepared_without_ray(tmp_path, tiny_model_path, monkeypatch):
    """A JSONL of prompts with answers and an extra field: items, held-out split, metadata for
    the rewards, the resolved output path - and Ray is never imported."""
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    job = _file_job(tmp_path, tiny_model_path)
    job = job._replace(rewards=(RewardSpec("exact_match", 0.5, {"parser": "first_number"}),
                                RewardSpec("length_window", 0.5, {"min_tokens": 1, "max_tokens": 4})))
    inputs = prepare_rl(job)
    assert "ray" not in sys.modules
    assert (len(inputs.train_items), len(inputs.eval_items)) == (15, 5)
    assert {it.index for it in inputs.train_items} | {it.index for it in inputs.eval_items} == set(range(20))
    item = inputs.eval_items[0]
    assert item.answer == str(2 * item.index // 1) and item.metadata == {"level": item.index % 3}
    assert item.source.endswith(f"prompts.jsonl:{item.index + 1}")
    assert inputs.component_names == ("exact_match", "length_window")
    assert inputs.aggregate_fn([1.0, 0.0]) == pytest.approx(0.5) and inputs.aggregate_fn([1.0, 1.0]) == 1.0
    assert inputs.job.logging.out == str(tmp_path / "out") and inputs.sft_samples == []


def test_sft_stage_of_an_rl_job_reads_its_file(tmp_path, tiny_model_path):
    sft_rows = [{"prompt": f"{a}+1=", "completion": str(a + 1)} for a in range(10)]
    job = _file_job(tmp_path, tiny_model_path)._replace(sft=SFTConfig(
        steps=5, path=_jsonl(tmp_path / "sft.jsonl", sft_rows), eval_set=EvalData(size=2)))
    inputs = prepare_rl(job)
    assert (len(inputs.sft_samples), len(inputs.sft_eval_samples)) == (8, 2)
    # loss on the completion and eos only: "3+1=" is 4 prompt characters, "4" and eos are targets
    sample = inputs.sft_samples[0]
    assert sample.loss_mask.tolist() == [0, 0, 0, 0, 1, 1]


def _bad(tmp_path, base_model, changes):
    job = _file_job(tmp_path, base_model)
    for section, value in changes.items():
        job = job._replace(**{section: value})
    return job


BROKEN_REWARD = "def fn(rollout):\n    return 1.0\n\ndef broken(:\n    pass\n"  # a syntax error on line 4
RAISING_REWARD = "def fn(rollout):\n    return 1.0\nSCALE = 1 / 0\n"  # raises on line 3 when imported

BAD_INPUTS = [
    # (what to change, text the error must contain)
    (lambda t, m: {"data": DataConfig(path=str(t / "nope.jsonl"), eval_set=EvalData(size=0.25))},
     "data file not found: {t}/nope.jsonl"),
    (lambda t, m: {"data": DataConfig(path=str(_text(t / "bad.jsonl", '{"prompt": "1+1=", "answer": "2"}\n{"prompt": '
                                                                   '"2+2=", "answer": \n')),
                                      eval_set=EvalData(size=0.5))}, "bad.jsonl:2"),
    (lambda t, m: {"data": DataConfig(path=_jsonl(t / "q.jsonl", [{"question": "1+1=", "answer": "2"}] * 4),
                                      eval_set=EvalData(size=1))}, "q.jsonl:1: missing field 'prompt' (fields: answer, "
                                                                   "question)"),
    (lambda t, m: {"data": DataConfig(path=str(_text(t / "empty.jsonl", "")), eval_set=EvalData(size=1))},
     "empty dataset"),
    (lambda t, m: {"rewards": (RewardSpec("exact_mach"),)}, "did you mean 'exact_match'"),
    (lambda t, m: {"rewards": (RewardSpec("no_such_module:reward"),)}, "cannot import 'no_such_module'"),
    (lambda t, m: {"rewards": (RewardSpec(f"{_text(t / 'my_reward.py', BROKEN_REWARD)}:fn"),)},
     "{t}/my_reward.py:4: syntax error: "),
    (lambda t, m: {"rewards": (RewardSpec(f"{_text(t / 'raising.py', RAISING_REWARD)}:fn"),)},
     "importing '{t}/raising.py' raised ZeroDivisionError: division by zero ({t}/raising.py:3)"),
    (lambda t, m: {"rewards": (RewardSpec("exact_match", 0.0), RewardSpec("length_window", 0.0,
                                                                       {"min_tokens": 1, "max_tokens": 3}))},
     "all reward weights are 0"),
    (lambda t, m: {"rewards": (RewardSpec("exact_match", kwargs={"parse": "boxed"}),)}, "did you mean 'parser'"),
    (lambda t, m: {"model": ModelConfig(str(t))}, "no config.json"),
    (lambda t, m: {"model": ModelConfig(_weights_only(t, m))}, "no tokenizer"),
    (lambda t, m: {"model": ModelConfig(_without_chat_template(t, m)),
                   "data": DataConfig(path=_jsonl(t / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}],
                                                                      "answer": "x"}] * 4),
                                      fields=FieldMap(messages="messages"), format=PromptFormat(chat=True),
                                      eval_set=EvalData(size=1))}, "needs a chat template"),
    (lambda t, m: {"data": DataConfig(path=_jsonl(t / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 4))},
     "evaluation is on but data.eval_set has neither path"),
    (lambda t, m: {"data": DataConfig(path=_jsonl(t / "long.jsonl", [{"prompt": "1" * 50, "answer": "2"}] * 4),
                                      eval_set=EvalData(size=1), max_prompt_tokens=20)},
     "long.jsonl:1: prompt is 50 tokens, over max_prompt_tokens=20"),
    (lambda t, m: {"data": DataConfig(task="arithmetc")}, "did you mean 'arithmetic'"),
    (lambda t, m: {"data": DataConfig(task="arithmetic", task_kwargs={"heldout": 3})}, "data.task_kwargs"),
    (lambda t, m: {"data": DataConfig(task="arithmetic", path="x.jsonl")}, "give either task"),
    (lambda t, m: {"data": DataConfig(task="arithmetic", format=PromptFormat(chat=True))},
     "format and split apply to a prompt file"),
    (lambda t, m: {"data": DataConfig(path=str(_unreadable(t)), eval_set=EvalData(size=1))}, "unreadable.jsonl"),
    (lambda t, m: {"sft": SFTConfig(steps=3)}, "sft.steps > 0 but there is no SFT data"),
    (lambda t, m: {"checkpoint": CheckpointConfig(resume=str(t))}, "not a checkpoint directory"),
    (lambda t, m: {"eval": EvalConfig(k=4)}, "eval.k 4 samples at eval.temperature 0"),
    (lambda t, m: {"eval": EvalConfig(temperature=0.005), "cluster": ClusterConfig(generator_backend="vllm")},
     "eval.temperature 0.005 with cluster.generator_backend vllm: vLLM raises a temperature below 0.01 to 0.01"),
    (lambda t, m: {"cluster": ClusterConfig(generator_backend="vllm", vllm=VLLMConfig(max_model_len=10))},
     "prompts.jsonl:11: prompt is 6 tokens, and generation.max_new_tokens 5 after it is over "
     "cluster.vllm.max_model_len 10 (the longest prompt is 6 tokens)"),
    (lambda t, m: {"model": ModelConfig(m, lora=LoraConfig(rank=8, target_modules=("q_projj", "v_proj")))},
     "model.lora.target_modules: 'q_projj' matches no module of {m}; did you mean 'q_proj'?; its linear layers "
     "are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
    (lambda t, m: {"model": ModelConfig(m, lora=LoraConfig(rank=8, target_modules=("embed_tokens",)))},
     "'embed_tokens' names Embedding modules, not linear layers"),
    (lambda t, m: {"model": ModelConfig(m, lora=LoraConfig(rank=-2))}, "model.lora.rank must be 0 (off) or more"),
    (lambda t, m: {"model": ModelConfig(m, lora=LoraConfig(rank=8, alpha=0.0))}, "model.lora.alpha must be > 0"),
    (lambda t, m: {"model": ModelConfig(m, lora=LoraConfig(rank=8, dropout=0.1))},
     "model.lora.dropout must be 0, got 0.1: every forward that computes logprobs"),
    (lambda t, m: {"model": ModelConfig(m, lora=LoraConfig(rank=8)), "cluster": ClusterConfig(reference_workers=2)},
     "cluster.reference_workers 2 would be ignored: with model.lora the reference is the trainer ranks' model"),
    (lambda t, m: {"model": ModelConfig(m, lora=LoraConfig(rank=8)), "cluster": ClusterConfig(zero_stage=3),
                   "shaping": (ShapingSpec("kl_penalty", {"coef": 0.1}),)},
     "the shaping (it reads reference logprobs) with model.lora under cluster.zero_stage 3"),
    (lambda t, m: {"model": ModelConfig(m, lora=LoraConfig(rank=8)), "cluster": ClusterConfig(zero_stage=3),
                   "algorithm": RLConfig(name="ppo")},
     "algorithm ppo (KL in the reward) with model.lora under cluster.zero_stage 3"),
    (lambda t, m: {"model": ModelConfig(m, lora=LoraConfig(rank=8, target_modules=("lm_head", "q_proj")))},
     "'lm_head' is the output head, whose weight is the input embeddings' (tied in {m})"),
]


def _unreadable(tmp_path):
    path = tmp_path / "unreadable.jsonl"
    path.mkdir()  # a directory named like a file: reading it fails with an OSError, as an unreadable file does
    return path


def _text(path, text):
    path.write_text(text)
    return path


def _without_chat_template(tmp_path, model):
    import shutil

    target = tmp_path / "no_template"
    shutil.copytree(model, target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return str(target)


def _weights_only(tmp_path, model):
    import shutil

    target = tmp_path / "weights_only"
    target.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(model, name), target / name)
    return str(target)


@pytest.mark.parametrize("change, message", BAD_INPUTS, ids=[m[:40] for _, m in BAD_INPUTS])
def test_bad_input_fails_before_ray_naming_the_culprit(tmp_path, tiny_model_path, change, message, monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    job = _bad(tmp_path, tiny_model_path, change(tmp_path, tiny_model_path))
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        prepare_rl(job)
    assert message.format(t=tmp_path, m=tiny_model_path) in str(e.value)
    assert "ray" not in sys.modules


def test_vllm_room_is_checked_at_its_bound_and_only_for_vllm(tmp_path, tiny_model_path):
    """Prompts of 4 and 6 tokens with 5 new tokens need a vLLM engine of 11: 11 passes, 10 names the
    6-token prompt; HF generators, or vLLM without a max_model_len, are not asked."""
    items, lengths = [PromptItem(0, "1+1="), PromptItem(1, "12+12=", source="p.jsonl:2")], np.array([4, 6])
    job = _file_job(tmp_path, tiny_model_path)

    def with_vllm(limit, backend="vllm"):
        return job._replace(cluster=ClusterConfig(generator_backend=backend, vllm=VLLMConfig(max_model_len=limit)))

    assert vllm_room_errors(items, lengths, with_vllm(11)) == []
    assert vllm_room_errors(items, lengths, with_vllm(10))[0].startswith("p.jsonl:2: prompt is 6 tokens")
    assert vllm_room_errors(items, lengths, with_vllm(10, "hf")) == []
    assert vllm_room_errors(items, lengths, with_vllm(None)) == []


@pytest.mark.ray
@pytest.mark.own_ray  # shuts the run's Ray down: no Ray may be left running
def test_an_error_found_while_ray_starts_leaves_no_ray_running(tmp_path, tiny_model_path, monkeypatch):
    """run_rl starts Ray beside the model's loading, after every value check: a prompt too long
    for the tokenizer is found then, and the job stops with its message and shuts Ray down."""
    import ray

    import cluster.jobs.rl as job_module

    starts = []
    real = job_module.start_ray_for
    monkeypatch.setattr(job_module, "start_ray_for", lambda job, extensions: starts.append(real(job, extensions)))
    ray.shutdown()
    job = _bad(tmp_path, tiny_model_path, {"data": DataConfig(
        path=_jsonl(tmp_path / "long.jsonl", [{"prompt": "1" * 50, "answer": "2"}] * 4), eval_set=EvalData(size=1),
        max_prompt_tokens=20)})
    with pytest.raises(ValueError, match="long.jsonl:1: prompt is 50 tokens"):
        job_module.run_rl(job)
    assert len(starts) == 1 and starts[0]  # Ray did start (its address), beside the loading
    assert not ray.is_initialized()


def test_side_by_side_keeps_here_in_this_thread_and_work_beside():
    import threading
    import time

    from cluster.jobs.inputs import side_by_side

    seen = {}

    def work():
        seen["work in main"] = threading.current_thread() is threading.main_thread()
        return 7

    def here():
        seen["here in main"] = threading.current_thread() is threading.main_thread()

    assert side_by_side(work, here) == 7
    assert seen == {"work in main": False, "here in main": True}
    finished = []

    def failing_work():
        time.sleep(0.2)
        finished.append(True)
        raise ValueError("bad prompt file")

    def failing_here():
        raise RuntimeError("ray did not start")

    with pytest.raises(ValueError, match="bad prompt file"):  # work's error wins, after work finished
        side_by_side(failing_work, failing_here)
    assert finished == [True]
    with pytest.raises(RuntimeError, match="ray did not start"):
        side_by_side(lambda: 1, failing_here)


def test_value_errors_are_collected_and_the_cli_exits_cleanly(tmp_path, capsys):
    from cluster.jobs.cli import run

    with pytest.raises(SystemExit) as e:
        run(["rl", DEFAULT, "--cluster.zero-stage", "5", "--cluster.generators", "0",
              "--cluster.generate-on-trainers", "False", "--generation.temperature", "0", "--algorithm.name", "ppo",
              "--cluster.critics", "0", "--generation.decode", "fast", "--generation.max_batch_rows", "-2",
              "--logging.out", str(tmp_path)])
    text = str(e.value)
    for part in ("cluster.zero_stage must be 1, 2 or 3", "cluster.generators must be at least 1",
                 "generation.temperature must be > 0", "cluster.critics must be at least 1",
                 "generation.decode must be one of auto, eager, packed, static, captured, got 'fast'",
                 "generation.max_batch_rows must be >= 0 (0: every row at once), got -2"):
        assert part in text
    with pytest.raises(ConfigErrors, match="sft.path is required"):
        run_sft(SFTJob(logging=LoggingConfig(out=str(tmp_path))))


@pytest.mark.parametrize("size, algorithm, message", [
    (0, "grpo", "generation.group_size must be at least 1 (completions per prompt), got 0"),
    (1, "grpo", "generation.group_size must be at least 2 for 'grpo' (completions per prompt: its advantages or "
                "pairs compare completions of one prompt), got 1; algorithm.name reinforce learns from single"),
    (1, "online_dpo", "generation.group_size must be at least 2 for 'online_dpo'"),
    (1, "reinforce", None),  # a constant baseline learns from one completion per prompt
])
def test_a_bad_group_size_is_named_alone(tmp_path, size, algorithm, message):
    """generation.group_size is reported as itself, with what is valid for the algorithm - not as the
    rows it would leave each mini-batch; REINFORCE with its constant baseline takes one per prompt."""
    from cluster.jobs.checks import rl_errors
    from cluster.jobs.config import RLJob, load_job_config

    job = load_job_config(DEFAULT, RLJob)
    job = job._replace(generation=job.generation._replace(group_size=size),
                       algorithm=job.algorithm._replace(name=algorithm))
    errors = rl_errors(job)
    if message is None:
        assert errors == []
    else:
        assert len(errors) == 1 and message in errors[0] and "mini_batches" not in errors[0], errors


@pytest.mark.slow
def test_ppo_with_a_critic_learns_the_default_task(tmp_path, sft_policy):
    """``--algorithm.name ppo`` from the default job's SFT'd policy: the job adds a critic group after
    a short SFT stage (kept, ``sft.save``), initialised from the policy it leaves; GAE on its values
    lifts held-out accuracy by 10 points or more in 20 steps (0.508 -> 0.828 here), the critic's value loss
    falls by more than half (0.23 -> 0.09 from the first 5 steps to the last), and the final checkpoint holds
    the critic. The SFT stage runs on the job's trainer ranks at its full rate (no warm-up): the test checks
    what it hands RL."""

    from cluster.jobs.cli import run

    ray_up()
    out = str(tmp_path / "ppo")
    summary = run(["rl", DEFAULT, "--logging.out", out, "--model.model-name-or-path", sft_policy,
                   "--sft.steps", "5", "--sft.warmup", "1", "--sft.save", "True", "--algorithm.name", "ppo",
                   "--algorithm.steps", "20",
                   "--eval.every", "10", "--eval.final-pass-k", "0",
                   "--data.task-kwargs", "num_heldout", "128", "carry_error_rate", "0.7"])
    assert summary["algorithm"] == "ppo"
    assert summary["accuracy_after_rl"] >= summary["accuracy_before_rl"] + 0.10
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"critic/value_loss"' in line]
    assert len(rows) == 20 and all(r["algorithm"] == "ppo" for r in rows)
    first, last = (np.mean([r["critic/value_loss"] for r in part]) for part in (rows[:5], rows[-5:]))
    assert last < 0.5 * first  # the critic learns the returns
    assert os.path.isfile(os.path.join(out, "final_model", "critic", "critic.json"))
    # the critic's starting point: the SFT stage's model that sft.save kept (the chaos test's PPO runs without it,
    # so the critic's own copy is built there)
    assert os.path.isfile(os.path.join(out, "sft_model", "hf", "config.json"))
    assert summary["sft_model"] == os.path.join(out, "sft_model")
    # the SFT stage on the job's trainer ranks handed RL what it trained: its model moved off the given one (5 steps
    # at the full rate: no warm-up), and the evaluation before RL (on the trainer ranks, which generate here) wrote
    # that model's greedy completions, which differ from the given model's
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primitives.fixtures.tasks import arithmetic_task
    from primitives.model.generation import generate_rollouts
    from primitives.types import GenerationConfig

    def greedy(path: str) -> dict:
        rollouts = generate_rollouts(AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path),
                                     arithmetic_task(seed=0, num_heldout=128).eval,
                                     GenerationConfig(max_new_tokens=5, temperature=0.0, n=1))
        return {r.prompt: r.text for r in rollouts}

    with open(os.path.join(out, "samples", "step_0.jsonl")) as f:
        evaluated = {r["prompt"]: r["completion"] for r in map(json.loads, f)}
    trained, given = greedy(os.path.join(out, "sft_model", "hf")), greedy(sft_policy)
    assert len(evaluated) == 128 and evaluated == trained and trained != given


@pytest.mark.slow
def test_default_job_lifts_heldout_accuracy(tmp_path, sft_policy):
    """The default job's RL as `make run` runs it (40 of its 80 steps, 128 held-out problems), through the
    command-line entry point, from its SFT stage's policy (``sft_policy``: the same stage, made once per test
    run in one process; the stage on the job's trainer ranks, and its hand-over to RL, is the PPO test's)."""
    from cluster.jobs.cli import run

    ray_up()
    out = str(tmp_path / "run")
    summary = run(["rl", DEFAULT, "--logging.out", out, "--model.model-name-or-path", sft_policy, "--sft.steps", "0",
                   "--algorithm.steps", "40", "--eval.every", "20",
                   "--data.task-kwargs", "num_heldout", "128", "carry_error_rate", "0.7"])
    assert summary["sft_steps"] == 0 and "sft_model" not in summary
    assert summary["accuracy_after_rl"] >= summary["accuracy_before_rl"] + 0.10
    assert summary["reward_mean_last5"] > summary["reward_mean_first5"]
    assert (summary["generators"], summary["trainer_ranks"], summary["zero_stage"]) == (2, 2, 2)
    assert summary["reference"] == "trainers" and summary["generation"] == "trainers"
    assert summary["eval_prompts"] == 128
    for phase in ("generate", "reward", "train", "sync"):  # the reference scores inside the train step
        assert summary[f"time_{phase}_mean_s"] > 0
    assert "time_ref_mean_s" not in summary
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["rl_steps"] == 40
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [-1, 19, 39]  # before RL, then every 20 steps
    assert os.path.isfile(os.path.join(out, "curves.png")) and os.path.isfile(os.path.join(out, "config.yaml"))
    samples = {os.path.basename(p): [json.loads(line) for line in open(p)]
               for p in glob.glob(os.path.join(out, "samples", "step_*.jsonl"))}
    assert sorted(samples) == ["step_0.jsonl", "step_20.jsonl", "step_40.jsonl"]
    for records in samples.values():
        assert len(records) == 128 and len({r["uid"] for r in records}) == 128
        assert {"prompt", "completion", "answer", "reward", "reward_components", "uid", "step"} <= set(records[0])
    assert sum(r["reward"] >= 1.0 for r in samples["step_40.jsonl"]) / 128 == pytest.approx(
        summary["accuracy_after_rl"], abs=1e-9)
    with open(os.path.join(out, "samples", "pass_at_4_step_40.jsonl")) as f:
        sampled = [json.loads(line) for line in f]
    assert len(sampled) == 4 * 128
    solved = {r["group"] for r in sampled if r["reward"] >= 1.0}  # pass@4 with 4 samples: any right
    assert summary["eval/pass@4"] == pytest.approx(len(solved) / 128, abs=1e-12)
    # the final model, loaded in one process, has the greedy accuracy the job logged at the end
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primitives.env.rewards import exact_match
    from primitives.fixtures.tasks import arithmetic_task
    from primitives.io.evaluation import greedy_accuracy

    hf = os.path.join(out, "final_model", "hf")
    heldout = arithmetic_task(seed=0, num_heldout=128).eval
    accuracy = greedy_accuracy(AutoModelForCausalLM.from_pretrained(hf), AutoTokenizer.from_pretrained(hf), heldout,
                               exact_match("first_number"), max_new_tokens=5)
    assert accuracy == pytest.approx(summary["accuracy_after_rl"], abs=1e-9)
    # and the policy it started from, the one the evaluation before RL scored
    accuracy = greedy_accuracy(AutoModelForCausalLM.from_pretrained(sft_policy),
                               AutoTokenizer.from_pretrained(sft_policy), heldout, exact_match("first_number"),
                               max_new_tokens=5)
    assert accuracy == pytest.approx(summary["accuracy_before_rl"], abs=1e-9)


@pytest.mark.slow
def test_checkpoint_then_resume_from_the_command_line(tmp_path):
    from cluster.jobs.cli import run

    out = str(tmp_path / "run")
    short = ["--sft.steps", "20", "--eval.enabled", "False", "--eval.final-pass-k", "0"]
    ray_up()
    run(["rl", DEFAULT, "--logging.out", out, "--algorithm.steps", "2", "--checkpoint.every", "2", *short])
    ckpt = os.path.join(out, "checkpoints", "step_2")
    assert os.path.isfile(os.path.join(ckpt, "train_state.json"))
    assert os.path.isdir(os.path.join(ckpt, "reference")) and os.path.isdir(os.path.join(ckpt, "deepspeed"))
    summary = run(["rl", DEFAULT, "--logging.out", out + "_resumed", "--algorithm.steps", "3",
                    "--checkpoint.resume", ckpt, *short])
    rows = [json.loads(line) for line in open(os.path.join(out + "_resumed", "metrics.jsonl"))]
    assert [r["step"] for r in rows if "reward/mean" in r] == [2]  # continued at step 2; no SFT again
    assert not any("loss/sft" in r for r in rows)
    assert not any(k.startswith("eval/") for r in rows for k in r)  # eval.enabled False: no evaluation at all
    assert not os.path.exists(os.path.join(out + "_resumed", "samples"))
    assert summary["rl_steps"] == 3


def _sft_job(tmp_path, model, out, steps, **changes):
    rows = [{"prompt": f"{a:02d}+{b:02d}=", "completion": str(a + b)} for a in range(8) for b in range(8)]
    path = tmp_path / "sft.jsonl"
    if not path.exists():
        _jsonl(path, rows)
    job = SFTJob(model=ModelConfig(model),
                 sft=SFTConfig(steps=steps, batch=16, lr=1e-3, path=str(path), eval_set=EvalData(size=0.25),
                               eval_every=3, fields=SFTFields()),
                 logging=LoggingConfig(out=str(tmp_path / out)))
    return job._replace(**changes)


@pytest.mark.slow
def test_sft_job_learns_checkpoints_and_resumes_exactly(tmp_path, tiny_model_path):
    """`rayrl sft`: eval loss on a held-out quarter falls; 6 steps straight equal 3 steps,
    a checkpoint, and 3 more steps resumed from it (weights and logged losses)."""
    from safetensors.numpy import load_file

    ray_up()
    straight = run_sft(_sft_job(tmp_path, tiny_model_path, "straight", 6,
                                checkpoint=CheckpointConfig(every=3)))
    ckpt = str(tmp_path / "straight" / "checkpoints" / "step_3")
    resumed = run_sft(_sft_job(tmp_path, tiny_model_path, "resumed", 6, checkpoint=CheckpointConfig(resume=ckpt)))
    assert straight["eval_samples"] == 16 and straight["train_samples"] == 48
    assert straight["eval_loss_after"] < straight["eval_loss_before"]
    assert resumed["resumed_at_step"] == 3
    a = load_file(os.path.join(straight["hf_model"], "model.safetensors"))
    b = load_file(os.path.join(resumed["hf_model"], "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-6, err_msg=name)
    rows = {out: [json.loads(line) for line in open(tmp_path / out / "metrics.jsonl")]
            for out in ("straight", "resumed")}
    last = {out: [r for r in rs if r["step"] == 5][0] for out, rs in rows.items()}
    assert last["resumed"]["loss/sft"] == pytest.approx(last["straight"]["loss/sft"], abs=1e-6)
    assert last["resumed"]["eval/loss_sft"] == pytest.approx(last["straight"]["eval/loss_sft"], abs=1e-6)
    # the logged eval loss (2 ranks, merged shares) against one process on the final weights
    from transformers import AutoModelForCausalLM

    from cluster.jobs.inputs import prepare_sft
    from primitives.io.data import collate_sft
    from primitives.model.training import sft_eval_loss

    eval_samples = prepare_sft(_sft_job(tmp_path, tiny_model_path, "check", 6)).eval_samples
    model = AutoModelForCausalLM.from_pretrained(straight["hf_model"])
    ids, attn, mask = collate_sft(eval_samples, model.config.pad_token_id or 0)
    single = sft_eval_loss(model, ids, attn, mask, num_tokens=int(mask[:, 1:].sum()))
    assert straight["eval_loss_after"] == pytest.approx(single["eval/loss_sft"], abs=1e-5)


@pytest.mark.ray
def test_sft_job_with_lora_trains_the_adapters_and_saves_both_forms(tmp_path, tiny_model_path):
    """`rayrl sft` with ``model.lora``: the held-out loss falls with the base frozen, and the final model
    is a PEFT adapter directory and a merged HF model that compute the same logits."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ray_up()
    job = _sft_job(tmp_path, tiny_model_path, "lora", 6)
    summary = run_sft(job._replace(model=ModelConfig(tiny_model_path, lora=LoraConfig(rank=8))))
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    final = os.path.dirname(summary["hf_model"])
    merged = AutoModelForCausalLM.from_pretrained(summary["hf_model"])
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                                        os.path.join(final, "adapter"))
    ids = torch.arange(3, 20).reshape(1, -1)
    with torch.no_grad():
        gap = (merged(input_ids=ids).logits - adapter(input_ids=ids).logits).abs().max().item()
        moved = (merged(input_ids=ids).logits - AutoModelForCausalLM.from_pretrained(tiny_model_path)(
            input_ids=ids).logits).abs().max().item()
    assert gap < 1e-4 and moved > 1e-3
    # `rayrl rl` with model.lora on the SFT job's merged model starts from the SFT job's policy: its greedy
    # answers before RL are the merged model's in one process (and not the base model's)
    from cluster.jobs.config import SamplingConfig
    from cluster.jobs.rl import run_rl
    from primitives.fixtures.tasks import arithmetic_task
    from primitives.model.generation import generate_rollouts
    from primitives.types import GenerationConfig

    rl_out = tmp_path / "rl"
    ray_up()
    run_rl(RLJob(model=ModelConfig(summary["hf_model"], lora=LoraConfig(rank=8)),
                 data=DataConfig(task="arithmetic", task_kwargs={"num_train": 32, "num_heldout": 8}),
                 algorithm=RLConfig(steps=1, prompts_per_step=4, kl_coef=0.05),
                 generation=SamplingConfig(group_size=4, max_new_tokens=4),
                 cluster=ClusterConfig(generate_on_trainers=True, generators=0, reference_on_trainers=True),
                 eval=EvalConfig(every=0, final_pass_k=0), logging=LoggingConfig(out=str(rl_out))))
    before = [json.loads(line) for line in open(rl_out / "samples" / "step_0.jsonl")]  # before the first step
    heldout = arithmetic_task(seed=0, num_train=32, num_heldout=8).eval
    tok = AutoTokenizer.from_pretrained(summary["hf_model"])

    def greedy(model):
        rollouts = generate_rollouts(model, tok, heldout, GenerationConfig(max_new_tokens=4, temperature=0.0))
        return [r.text for r in rollouts]

    assert [b["completion"] for b in before] == greedy(merged)
    assert greedy(merged) != greedy(AutoModelForCausalLM.from_pretrained(tiny_model_path))


def test_a_user_task_is_a_function(tmp_path, tiny_model_path):
    """data.task: path/file.py:function(seed, **task_kwargs) -> TaskData; its demonstrations
    feed the SFT stage; what it returns is checked."""
    (tmp_path / "my_task.py").write_text(
        "from primitives.io.data import PromptItem\n"
        "from primitives.fixtures.tasks import TaskData\n"
        "def task(seed, n=4):\n"
        "    items = [PromptItem(i, f'{i}+{seed}=', str(i + seed)) for i in range(n)]\n"
        "    return TaskData(items[1:], items[:1], [{'prompt': '1+1=', 'completion': '2'}])\n"
        "def wrong(seed):\n"
        "    return []\n")
    job = RLJob(model=ModelConfig(tiny_model_path), seed=5, sft=SFTConfig(steps=2),
                data=DataConfig(task=f"{tmp_path}/my_task.py:task", task_kwargs={"n": 6}),
                logging=LoggingConfig(out=str(tmp_path / "out")))
    inputs = prepare_rl(job)
    assert [it.prompt for it in inputs.train_items] == [f"{i}+5=" for i in range(1, 6)]
    assert [it.answer for it in inputs.eval_items] == ["5"] and len(inputs.sft_samples) == 1
    with pytest.raises(ConfigErrors, match="returned list, not a primitives.fixtures.tasks.TaskData"):
        prepare_rl(job._replace(data=DataConfig(task=f"{tmp_path}/my_task.py:wrong")))
    with pytest.raises(ConfigErrors, match=r"data.task_kwargs \{'m': 1\} do not fit"):
        prepare_rl(job._replace(data=DataConfig(task=f"{tmp_path}/my_task.py:task", task_kwargs={"m": 1})))


LORA_SFT_STEPS = 100  # the LoRA job's own stage, on top of the default job's 1500


def _sampled_reward(model_dir: str, items, n: int, seed: int = 0) -> float:
    """Mean exact-match reward of ``n`` completions per item sampled at temperature 1 in one process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primitives.env.rewards import exact_match, score_rollouts
    from primitives.model.generation import generate_rollouts
    from primitives.types import GenerationConfig

    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    rollouts = generate_rollouts(model, tok, list(items), GenerationConfig(max_new_tokens=5, n=n, temperature=1.0),
                                 generator=torch.Generator().manual_seed(seed))
    return float(np.mean([r.reward for r in score_rollouts(rollouts, exact_match("first_number"))]))


@pytest.mark.slow
def test_lora_default_job_with_its_sft_stage_lifts_the_task(tmp_path, sft_policy):
    """The default job with adapters (``--model.lora.rank 16 --algorithm.lr 3e-3``), its SFT stage included:
    the stage trains every weight (``sft.full_weights``) and RL trains rank-16 adapters on the model it leaves,
    generating in an HF generator worker that receives the adapters after every step.

    It starts from the default job's SFT'd policy (``sft_policy``, 1500 steps) and its own stage runs 100 more
    steps at a higher rate, so the stage's model is a different one (checked), and RL must start from that
    one, not from the model the job was given (a LoRA job once did, after its own stage: 0.578 -> 0.0):

    * the merged final model is the stage's model plus the final adapters, as PEFT merges them (1e-5),
      and not the given model plus them;
    * the first RL step samples as the stage's model does (its reward is the one-process model's on the
      same prompts, to sampling noise), from the reference (KL 0);
    * held-out accuracy rises by 10 points or more; what trains and what is frozen are counted by hand;
      the merged final model's greedy accuracy is the one the job logged.

    Until issue 32 this job ran its own 1000-step stage from the random model (about 90 s more). The
    stage's default (every weight for the random ``tiny`` model, adapters for any other) is
    ``test_lora_combinations``' case, and the same job generating on the trainer ranks is one of its runs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primitives.env.rewards import exact_match
    from primitives.fixtures.tasks import arithmetic_task
    from primitives.io.evaluation import greedy_accuracy
    from tests.conftest import lora_numel, run_job

    out = str(tmp_path / "lora")
    layout = ["--cluster.generate-on-trainers", "False", "--cluster.generators", "1"]
    summary = run_job(["rl", DEFAULT, "--logging.out", out, "--model.model-name-or-path", sft_policy,
                       "--model.lora.rank", "16", "--algorithm.lr", "3e-3", "--sft.full-weights", "True",
                       "--sft.steps", str(LORA_SFT_STEPS), "--sft.lr", "3e-3", "--sft.warmup", "10",
                       "--algorithm.steps", "30", "--eval.final-pass-k", "0",
                       "--data.task-kwargs", "num_heldout", "128", "carry_error_rate", "0.7", *layout])
    sft = os.path.join(out, "sft_model", "hf")
    assert summary["sft_model"] == os.path.dirname(sft) and summary["generation"] == "workers"
    assert summary["accuracy_after_rl"] >= summary["accuracy_before_rl"] + 0.10, summary
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert len([r for r in rows if r.get("phase") == "sft" and "loss/sft" in r]) == LORA_SFT_STEPS

    def weights(path):
        return AutoModelForCausalLM.from_pretrained(path).state_dict()

    given, stage = weights(sft_policy), weights(sft)
    final = os.path.join(out, "final_model")

    def merged_onto(path):
        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path),
                                         os.path.join(final, "adapter")).merge_and_unload().state_dict()

    def furthest(a, b):
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    assert furthest(stage, given) > 1e-2  # the stage trained every weight: its model is not the one given
    merged = weights(os.path.join(final, "hf"))
    assert furthest(merged_onto(sft), merged) < 1e-5  # RL's adapters sat on the stage's model...
    assert furthest(merged_onto(sft_policy), merged) > 1e-2  # ... not on the model the job was given
    first = next(r for r in rows if "reward/mean" in r)
    assert first["kl/ref_k3"] == pytest.approx(0.0, abs=1e-7)
    # the generator worker sampled with the trainer's model too (the stage's plus B = 0), not the one given
    assert first["mismatch/max_abs_logp_diff"] < 1e-4, first
    task = arithmetic_task(seed=0, num_heldout=128)
    groups = json.loads(open(os.path.join(out, "trained_groups.jsonl")).readline())["groups"]
    prompts = [task.train[int(g.split("/i")[1])] for g in groups]
    assert len(prompts) == 32
    assert first["reward/mean"] == pytest.approx(_sampled_reward(sft, prompts, 8), abs=0.12), first
    assert summary["trained_params"] == lora_numel(sft, 16)  # counted by hand from the model's linear layers
    # frozen: the SFT'd model and the reference's adapter (KL is on: it is built, equal in size to the policy's)
    assert summary["frozen_params"] == lora_numel(sft, 16) + sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(sft).parameters())
    syncs = {r["sync/bytes"] for r in rows if "sync/bytes" in r}
    assert syncs == {4.0 * lora_numel(sft, 16)}  # the adapters alone, after every step
    assert os.path.isfile(os.path.join(final, "adapter", "adapter_model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(final, "hf"))
    accuracy = greedy_accuracy(model, AutoTokenizer.from_pretrained(os.path.join(final, "hf")), task.eval,
                               exact_match("first_number"), max_new_tokens=5)
    assert accuracy == pytest.approx(summary["accuracy_after_rl"], abs=1e-9)


def test_every_generation_setting_reaches_the_generation_config():
    """Each field of the ``generation`` section but ``group_size`` (which is ``n``) arrives under its own
    name in the ``GenerationConfig`` the actors sample with, set to a value other than its default."""
    from cluster.jobs.config import SamplingConfig
    from cluster.jobs.rl import sampling_config

    g = SamplingConfig(group_size=3, max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=4, stop=("x",),
                       decode="eager", max_batch_rows=6)
    assert all(getattr(g, f) != d for f, d in SamplingConfig._field_defaults.items())
    gen = sampling_config(g, {"enable_thinking": False})
    assert gen.n == 3 and gen.template_kwargs == {"enable_thinking": False}
    assert {f: getattr(gen, f) for f in SamplingConfig._fields if f != "group_size"} == \
        {f: getattr(g, f) for f in SamplingConfig._fields if f != "group_size"}


def test_every_trainer_setting_of_the_cluster_section_reaches_the_trainer_config(tiny_model_path):
    """``trainer_config`` carries each ``cluster`` field that ``TrainerConfig`` also has (set to a value
    other than its default) and the learning rate it is given; the local backend honours gradient
    checkpointing as the ranks do."""
    from cluster.local import LocalBackend
    from cluster.ray_wing.config import SHARED_TRAINER_FIELDS, ClusterConfig, trainer_config
    from rl_actors.deepspeed_rank import TrainerConfig

    shared = set(TrainerConfig._fields) & set(ClusterConfig._fields)
    # a field both records gain is one a hand-built cluster must also compare (trainer_conflicts)
    assert shared == set(SHARED_TRAINER_FIELDS) == {"zero_stage", "micro_batch_size", "gradient_checkpointing"}
    cluster = ClusterConfig(zero_stage=3, micro_batch_size=5, gradient_checkpointing=True)
    assert all(getattr(cluster, f) != ClusterConfig._field_defaults[f] for f in shared)
    got = trainer_config(cluster, 0.25)
    assert {f: getattr(got, f) for f in shared} == {f: getattr(cluster, f) for f in shared} and got.lr == 0.25
    assert LocalBackend(tiny_model_path, lambda r: 0.0, trainer=got).policy.is_gradient_checkpointing
