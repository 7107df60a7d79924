"""Every LoRA job a user can write (``model.lora``): the SFT stage (none, on the adapters, on every
weight) x where generation runs (the trainer ranks, HF workers, vLLM workers) x the reference (fixed,
EMA, none) x the ZeRO stage (1, 2, 3). Each combination is refused by name before Ray starts or runs;
the runs are a covering set in which every pair of settings meets at least once (the README's LoRA
table names each one), and each checks, against a second computation, that RL starts from the policy
the SFT stage left (the first step's KL to the reference is 0), that the generators sample with the
trainer's adapters, and what trains and what a sync sends."""
import itertools
import json
import os

import pytest

from cluster.jobs.checks import rl_errors
from cluster.jobs.config import (
    ClusterConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    ReferenceConfig,
    RLConfig,
    RLJob,
    SamplingConfig,
    SFTConfig,
)
from cluster.jobs.inputs import with_sft_weights
from primitives.env.rewards import RewardSpec
from primitives.types import LoraConfig, ModelConfig
from rl_actors.common import GENERATE_ON_ZERO3
from tests.conftest import ROOT, lora_numel

SFT = ("off", "adapters", "full weights")
GENERATION = ("trainers", "hf", "vllm")
REFERENCE = ("fixed", "ema", "none")
ZERO = (1, 2, 3)
RANK = 4

# A covering set: every pair of settings of two axes meets in at least one run (an orthogonal array of
# nine rows; its row of generation on the trainers under ZeRO-3, refused, is split in two)
RUNS = [
    ("off", "trainers", "fixed", 1),
    ("adapters", "trainers", "none", 2),
    ("full weights", "trainers", "ema", 1),
    ("adapters", "hf", "ema", 1),
    ("full weights", "hf", "fixed", 2),
    ("off", "hf", "none", 3),
    ("full weights", "hf", "ema", 3),
    ("full weights", "vllm", "none", 1),
    ("off", "vllm", "ema", 2),
    ("adapters", "vllm", "fixed", 3),
]


def lora_job(out: str, model: str, sft: str, generation: str, reference: str, zero: int, **more) -> RLJob:
    """A small job of the default task on ``model`` with rank-4 adapters in the given combination."""
    cluster = ClusterConfig(trainers=2, zero_stage=zero, generate_on_trainers=generation == "trainers",
                            generators=0 if generation == "trainers" else 1, reward_workers=1,
                            generator_backend="auto" if generation == "trainers" else generation,
                            reference_on_trainers=True, micro_batch_size=8, call_timeout_s=300)
    steps = 0 if sft == "off" else 3
    return RLJob(
        model=ModelConfig(model, lora=LoraConfig(rank=RANK)),
        rewards=(RewardSpec("tests.rewards:spread_reward"),),
        data=DataConfig(task="arithmetic", task_kwargs={"num_train": 64, "num_heldout": 8}),
        algorithm=RLConfig(steps=2, prompts_per_step=4, lr=1e-2, kl_coef=0.0 if reference == "none" else 0.05),
        reference=ReferenceConfig("ema", {"decay": 0.5}) if reference == "ema" else ReferenceConfig(),
        generation=SamplingConfig(group_size=4, max_new_tokens=4, temperature=1.0),
        sft=SFTConfig(steps=steps, batch=8, lr=1e-2, full_weights=None if sft == "off" else sft == "full weights"),
        cluster=cluster, eval=EvalConfig(every=0, final_pass_k=0, max_items=4),
        logging=LoggingConfig(out=out), **more)


def refusal(sft: str, generation: str, reference: str, zero: int):
    """The named error that refuses a combination before Ray, or None where it runs."""
    errors = rl_errors(lora_job("/tmp/unused", "tiny", sft, generation, reference, zero))
    return errors[0] if errors else None


def test_each_combination_is_refused_by_name_or_run_with_each_pair_of_its_settings():
    """Generation on the trainer ranks under ZeRO-3 is the one refusal (a rank holds a shard of the
    weights); every other combination passes every check made before Ray, and each pair of its
    settings meets in one of the runs below."""
    allowed = []
    for combo in itertools.product(SFT, GENERATION, REFERENCE, ZERO):
        _, generation, _, zero = combo
        assert refusal(*combo) == (GENERATE_ON_ZERO3 if generation == "trainers" and zero == 3 else None), combo
        if refusal(*combo) is None:
            allowed.append(combo)
    assert set(RUNS) <= set(allowed) and len(set(RUNS)) == len(RUNS)
    for i, j in itertools.combinations(range(4), 2):
        assert {(c[i], c[j]) for c in allowed} == {(r[i], r[j]) for r in RUNS}, (i, j)


def test_the_readme_table_says_what_the_tests_do():
    """The README's LoRA combination table lists each run above and the refusal, as they are here."""
    text = open(os.path.join(ROOT, "README.md")).read()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`test_lora_combinations`" in line]
    listed = {tuple(cell.strip() for cell in row.strip("|").split("|")[:4]) for row in rows}
    assert listed == {(s, g, r, str(z)) for s, g, r, z in RUNS}
    assert GENERATE_ON_ZERO3.split(":")[0] in " ".join(text.split())


def test_the_sft_stage_trains_every_weight_of_the_random_tiny_model_by_default():
    """``sft.full_weights`` None: true for the embedded tiny model (adapters cannot train a random
    model's embeddings), false for any other model; as given when set; left alone without an SFT stage
    or adapters."""
    def resolved(model, full=None, steps=3, rank=RANK):
        job = RLJob(model=ModelConfig(model, lora=LoraConfig(rank=rank)), sft=SFTConfig(steps=steps, full_weights=full))
        return with_sft_weights(job).sft.full_weights

    assert (resolved("tiny"), resolved("/models/mine"), resolved("smollm2")) == (True, False, False)
    assert (resolved("tiny", full=False), resolved("/models/mine", full=True)) == (False, True)
    assert (resolved("tiny", steps=0), resolved("tiny", rank=0)) == (None, None)


@pytest.mark.parametrize("sft,message", [
    (SFTConfig(steps=0, full_weights=True), "sft.full_weights True would be ignored: sft.steps is 0"),
    (SFTConfig(steps=3, full_weights=False), "sft.full_weights false needs model.lora (rank > 0)"),
    (SFTConfig(steps=0, save=True), "sft.save would be ignored: sft.steps is 0 (no SFT stage)"),
])
def test_sft_full_weights_that_cannot_apply_is_refused(sft, message):
    job = RLJob(model=ModelConfig("tiny"), data=DataConfig(task="arithmetic"), sft=sft)
    assert any(message in e for e in rl_errors(job)), rl_errors(job)
    assert not any(message in e for e in rl_errors(job._replace(sft=sft._replace(steps=3, save=False,
                                                                                 full_weights=None))))


def test_sft_save_in_an_sft_job_is_refused_and_in_an_rl_stage_taken():
    from cluster.jobs.checks import sft_errors

    assert any("sft.save would be ignored: rayrl sft saves its model in <out>/final_model" in e
               for e in sft_errors(SFTConfig(path="data.jsonl", save=True), in_rl_job=False))
    assert not any("sft.save" in e for e in sft_errors(SFTConfig(path="data.jsonl"), in_rl_job=False))
    job = RLJob(model=ModelConfig("tiny"), data=DataConfig(task="arithmetic"), sft=SFTConfig(steps=3, save=True))
    assert not any("sft.save" in e for e in rl_errors(job))


def _rows(out: str) -> list:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


@pytest.mark.slow
@pytest.mark.parametrize("sft,generation,reference,zero", RUNS)
def test_lora_combination_runs(ray_local, tmp_path, tiny_model_path, sft, generation, reference, zero):
    from cluster.jobs.rl import run_rl

    out = str(tmp_path / "run")
    summary = run_rl(lora_job(out, tiny_model_path, sft, generation, reference, zero))
    rows = [r for r in _rows(out) if r.get("phase") != "sft" and "reward/mean" in r]
    assert len(rows) == 2 and all(r["policy/updates"] >= 1 for r in rows)
    assert (len([r for r in _rows(out) if r.get("phase") == "sft" and "loss/sft" in r])) == (0 if sft == "off" else 3)
    # what trains: the adapters alone, on the job's model or, after a full-weight SFT stage, on its model
    base = os.path.join(out, "sft_model", "hf") if sft == "full weights" else tiny_model_path
    assert summary.get("sft_model") == (os.path.join(out, "sft_model") if sft == "full weights" else None)
    assert summary["trained_params"] == lora_numel(tiny_model_path, RANK)
    assert summary["reference"] == (None if reference == "none" else "trainers")
    assert summary["generation"] == ("trainers" if generation == "trainers" else "workers")
    assert summary["generator_engine"] == ("hf" if generation == "trainers" else generation)
    adapter_bytes = 4 * lora_numel(tiny_model_path, RANK)
    for r in rows:  # a sync sends the adapters alone, or nothing when the trainer ranks generate
        assert r["sync/bytes"] == (0.0 if generation == "trainers" else adapter_bytes)
        # the generator sampled with the trainer's adapters (vLLM computes with its own kernels)
        assert r["mismatch/max_abs_logp_diff"] < (1e-4 if generation == "vllm" else 1e-5), r
    if reference != "none":
        # RL starts from the reference: the SFT stage's policy (its adapters, or its model with new adapters at
        # zero), or the model itself; the first step's KL is 0 to rounding
        assert abs(rows[0]["kl/ref_k3"]) < 1e-6, rows[0]
        assert rows[1]["kl/ref_k3"] > 1e-6  # the first update moved the policy away from it (EMA: halfway)
    else:
        assert "kl/ref_k3" not in rows[0]
    final = os.path.join(out, "final_model")
    assert os.path.isfile(os.path.join(final, "adapter", "adapter_model.safetensors"))
    config = json.load(open(os.path.join(final, "adapter", "adapter_config.json")))
    assert os.path.realpath(config["base_model_name_or_path"]) == os.path.realpath(base)
