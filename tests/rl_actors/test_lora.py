"""LoRA on real DeepSpeed trainer ranks (``model.lora``): only the adapters train, under ZeRO-1/2/3
and on 1 or 2 ranks, to the weights one process computes; the reference is the base model with
the adapters off (no copy), or a frozen adapter that moves on adapter weights; checkpoints hold
the adapters as PEFT loads them and merged into a plain HF model, and resume exactly."""

import os

import numpy as np
import pytest
import torch

from primitives.maths.algorithms import grpo
from primitives.maths.batching import make_batch
from primitives.maths.kl import RefState, create_ema_updater
from primitives.model.logprobs import rollout_logprobs
from primitives.model.lora import adapter_names, merged_state, with_lora
from primitives.model.training import forward_backward, optim_step, step_counts
from primitives.types import LoraConfig, ModelConfig
from rl_actors.trainer import TrainerConfig, TrainerWorker
from tests.actors import done, rendezvous, start_ranks
from tests.conftest import scored_rollouts

LR, EPS = 1e-2, 1e-6  # a large lr: the adapters' first steps must move the logprobs measurably
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj"))


def _group(ray, path, stage, world, lora=LORA, mbs=3, fresh=False, bf16=False, checkpointing=False, **kwargs):
    cfg = TrainerConfig(zero_stage=stage, lr=LR, micro_batch_size=mbs, max_grad_norm=1.0, adam_eps=EPS, bf16=bf16,
                        gradient_checkpointing=checkpointing)
    actors = start_ranks(ray, TrainerWorker, [((ModelConfig(path, lora=lora), r, world, cfg, 0), kwargs)
                                              for r in range(world)], fresh=fresh)
    rendezvous(ray, actors)
    return actors


def _batch(path, kl=False):
    rollouts, tok = scored_rollouts(path)
    if kl:
        rollouts = [r._replace(ref_logprobs=None) for r in rollouts]
    algo = grpo(kl_coef=0.05 if kl else 0.0)
    return make_batch(rollouts, algo, tok.pad_token_id, budget=4), algo, rollouts, tok


def _peft_model(path, state):
    """A one-process PEFT model of the same adapters, set to ``state`` (the actor's parameters)."""
    from transformers import AutoModelForCausalLM

    model = with_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), LORA)
    policy = {k: torch.from_numpy(np.array(v)) for k, v in state.items() if ".reference." not in k}  # its own adapter
    missing, unexpected = model.load_state_dict(policy, strict=False)
    assert not unexpected and not [m for m in missing if ".lora_" in m]
    return model


def _one_process(path, before, batch, algo, steps=2):
    """``steps`` updates of the same adapters in this process (AdamW, micro-batches of 5): each
    update's ``(loss, grad norm)`` and the parameters after them."""
    one = _peft_model(path, before)
    opt = torch.optim.AdamW([p for p in one.parameters() if p.requires_grad], lr=LR, eps=EPS, weight_decay=0.0)
    logged = []
    for _ in range(steps):
        metrics = forward_backward(one, batch, algo, step_counts(batch), micro_batch_size=5)
        logged.append((metrics["loss/policy"], optim_step(one, opt, max_grad_norm=1.0)))
    return logged, {n: p.detach().numpy() for n, p in one.named_parameters()}


@pytest.mark.parametrize("stage,world,checkpointing", [(1, 2, False), (2, 2, False), (3, 2, False), (2, 1, False),
                                                      (3, 1, False), (3, 2, True)])
def test_lora_trains_only_the_adapters_as_one_process_does(ray_local, tiny_model_path, stage, world, checkpointing):
    """Two updates (``B`` starts at zero, so the first moves ``B`` alone and the second both ``A`` and
    ``B``): every rank count and stage ends on the adapters one process computes; and ZeRO-3 with
    gradient checkpointing, which recomputes layers whose frozen base weights ZeRO-3 partitions
    (``rl_actors.common.frozen_recompute_error``)."""
    from transformers import AutoConfig

    batch, algo, _, _ = _batch(tiny_model_path)
    actors = _group(ray_local, tiny_model_path, stage, world, checkpointing=checkpointing)
    try:
        assert ray_local.get(actors[0].info.remote())["model"]["gradient_checkpointing"] is checkpointing
        before = ray_local.get([a.full_state.remote() for a in actors], timeout=300)[0]
        meta = ray_local.get(actors[0].weight_meta.remote())
        stats = [[u[0] for u in ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)]
                 for _ in range(2)]
        states = ray_local.get([a.full_state.remote() for a in actors], timeout=300)
    finally:
        done(ray_local, actors)
    trained = adapter_names(before)
    layers = AutoConfig.from_pretrained(tiny_model_path).num_hidden_layers
    # layers x 3 targets x (A, B), what a sync sends: the adapters alone
    assert sorted(m.name for m in meta) == sorted(trained) and len(trained) == layers * 3 * 2
    logged, expected = _one_process(tiny_model_path, before, batch, algo)
    for step, (ref_loss, ref_norm) in enumerate(logged):
        assert sum(s["loss/policy"] for s in stats[step]) == pytest.approx(ref_loss, abs=1e-6)
        assert stats[step][0]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    for name, w in states[0].items():
        if name in trained:
            assert np.abs(w - expected[name]).max() < 0.02 * LR, name  # Adam's steps: see test_trainer_zero
        else:
            assert np.array_equal(w, before[name]), f"frozen {name} moved"
    for kind in ("lora_A", "lora_B"):  # both factors moved (A from the second update, once B is not zero)
        assert max(np.abs(states[0][n] - before[n]).max() for n in trained if kind in n) > 0.5 * LR, kind
    for n in trained:
        assert np.array_equal(states[0][n], states[-1][n])  # every rank holds the same adapters


def test_one_bf16_rank_trains_the_adapters_as_fp32_does(ray_local, tiny_model_path):
    """bf16 (what a GPU runs) on one rank runs ZeRO-1 (``engine_stage``) with the base frozen: two updates
    leave every base weight where it was and move the adapters where one fp32 process moves them, to
    bf16's rounding of the forward (the gradient norms within 1 %, the adapters' gap a small part of
    their movement: 1.4e-4 against 1.3e-2 when written)."""
    batch, algo, _, _ = _batch(tiny_model_path)
    actors = _group(ray_local, tiny_model_path, 2, 1, bf16=True)
    try:
        info = ray_local.get(actors[0].info.remote())
        before = ray_local.get(actors[0].full_state.remote())
        norms = [ray_local.get(actors[0].train_step.remote(batch, algo, 1.0), timeout=300)[0]["grad_norm"]
                 for _ in range(2)]
        after = ray_local.get(actors[0].full_state.remote())
    finally:
        done(ray_local, actors)
    assert (info["engine_stage"], info["bf16"]) == (1, True)
    trained = adapter_names(before)
    logged, expected = _one_process(tiny_model_path, before, batch, algo)
    for step, (_, ref_norm) in enumerate(logged):
        assert norms[step] == pytest.approx(ref_norm, rel=1e-2), step
    for name, w in after.items():
        if name not in trained:
            assert np.array_equal(w, before[name]), f"frozen {name} moved"
    moved = np.concatenate([(expected[n] - before[n]).ravel() for n in trained])
    ours = np.concatenate([(after[n] - before[n]).ravel() for n in trained])
    assert np.abs(ours).mean() == pytest.approx(np.abs(moved).mean(), rel=0.05)
    assert np.abs(ours - moved).mean() < 0.05 * np.abs(moved).mean()


def test_adapters_off_reference_is_the_base_model(ray_local, tiny_model_path):
    """A fixed reference with LoRA: the trainer ranks' logprobs with the adapters off equal the base
    model's, after the adapters have trained (so on equals off would fail)."""
    from transformers import AutoModelForCausalLM

    batch, algo, rollouts, tok = _batch(tiny_model_path, kl=True)
    actors = _group(ray_local, tiny_model_path, 2, 2, reference=True)
    try:
        for _ in range(2):
            ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)
        ref = ray_local.get(actors[1].reference_logprobs.remote(rollouts, 0.7))
        policy = ray_local.get(actors[1].logprobs.remote(rollouts, 0.7))
    finally:
        done(ray_local, actors)
    base = rollout_logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_path), rollouts, tok.pad_token_id, 0.7)
    gap = max(float(np.abs(a - b).max()) for a, b in zip(ref, base))
    assert gap < 1e-5
    assert max(float(np.abs(a - b).max()) for a, b in zip(policy, base)) > 1e-2  # the adapters are on for the policy


def test_ema_reference_moves_on_adapter_weights(ray_local, tiny_model_path):
    """An EMA reference with LoRA is a frozen adapter: after a step and a move it scores as a PEFT
    model whose adapter is decay * start + (1 - decay) * policy, computed here from the ranks' state."""
    batch, algo, rollouts, tok = _batch(tiny_model_path, kl=True)
    ema = create_ema_updater(0.5)
    actors = _group(ray_local, tiny_model_path, 2, 2, reference=True, ref_update_fn=ema)
    try:
        start = ray_local.get([a.full_state.remote() for a in actors], timeout=300)[0]
        for _ in range(2):  # A moves from the second update on
            ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)
        ray_local.get([a.move_reference.remote(1) for a in actors], timeout=300)
        policy = ray_local.get([a.full_state.remote() for a in actors], timeout=300)[0]
        ref = ray_local.get(actors[1].with_reference_logprobs.remote(rollouts, 1.0), timeout=300)
    finally:
        done(ray_local, actors)
    names = adapter_names(start)
    moved = ema(RefState({n: torch.tensor(start[n]) for n in names}, 0), {n: torch.tensor(policy[n]) for n in names},
                1).weights
    expected_model = _peft_model(tiny_model_path, {**policy, **{n: v.numpy() for n, v in moved.items()}})
    expected = rollout_logprobs(expected_model, rollouts, tok.pad_token_id, 1.0)
    gap = max(float(np.abs(r.ref_logprobs - e).max()) for r, e in zip(ref, expected))
    assert gap < 1e-5
    policy_lp = rollout_logprobs(_peft_model(tiny_model_path, policy), rollouts, tok.pad_token_id, 1.0)
    assert max(float(np.abs(r.ref_logprobs - p).max()) for r, p in zip(ref, policy_lp)) > 1e-3  # not the policy


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_holds_adapter_and_merged_model_and_resumes_exactly(ray_local, tiny_model_path, tmp_path, stage):
    """Steps 1-2 (KL to an EMA reference adapter, moved after each), checkpoint, step 3 on one group; a
    new group loads the checkpoint (the reference adapter from ``reference/``, as a job does) and makes
    step 3: the same adapters and reference bit for bit (Adam moments, RNG and the reference came
    back). The checkpoint's ``adapter/`` loads with PEFT and its ``hf/`` with plain transformers, both
    computing what the ranks do."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch, algo, rollouts, tok = _batch(tiny_model_path, kl=True)
    path, ema = str(tmp_path / "ckpt"), create_ema_updater(0.5)

    def step(actors, n):
        ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)
        ray_local.get([a.move_reference.remote(n) for a in actors], timeout=300)

    actors = _group(ray_local, tiny_model_path, stage, 2, reference=True, ref_update_fn=ema)
    try:
        step(actors, 1)
        step(actors, 2)
        ray_local.get([a.save_checkpoint.remote(path, {"iteration": 2}) for a in actors], timeout=300)
        ray_local.get(actors[0].save_reference.remote(str(tmp_path / "reference")), timeout=300)
        policy = ray_local.get([a.logprobs.remote(rollouts, 1.0) for a in actors], timeout=300)[0]  # ZeRO-3: all
        step(actors, 3)
        continuous = ray_local.get([a.full_state.remote() for a in actors], timeout=300)[0]
        continuous_ref = ray_local.get(actors[1].reference_checksums.remote())
    finally:
        done(ray_local, actors)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(os.path.join(path, "adapter")))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    adapter = PeftModel.from_pretrained(base, os.path.join(path, "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(path, "hf"))
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    for model in (adapter, merged):
        got = rollout_logprobs(model, rollouts, tok.pad_token_id, 1.0)
        assert max(float(np.abs(a - b).max()) for a, b in zip(got, policy)) < 1e-5
    actors = _group(ray_local, tiny_model_path, stage, 2, reference=True, ref_update_fn=ema)
    try:
        ray_local.get([a.load_checkpoint.remote(path) for a in actors], timeout=300)
        ray_local.get([a.load_reference_from.remote(str(tmp_path / "reference")) for a in actors], timeout=300)
        step(actors, 3)
        resumed = ray_local.get([a.full_state.remote() for a in actors], timeout=300)[0]
        assert ray_local.get(actors[1].reference_checksums.remote()) == continuous_ref
    finally:
        done(ray_local, actors)
    for name in adapter_names(continuous):
        assert np.array_equal(resumed[name], continuous[name]), name
    # merged_state's fold is the one PEFT's own merge makes
    plain = merged_state(continuous, LORA)
    peft_merged = _peft_model(tiny_model_path, continuous).merge_and_unload().state_dict()
    assert max(float((torch.as_tensor(v) - peft_merged[k]).abs().max()) for k, v in plain.items()) < 1e-6


@pytest.mark.parametrize("ema", [False, True], ids=["adapters_off", "ema_adapter"])
def test_zero3_reference_with_uneven_shards_scores_what_zero2_scores(ray_local, tiny_model_path, ema):
    """Under ZeRO-3 the LoRA reference's forwards are collective: 16 rows on 3 ranks in micro-batches of
    5 give shards of 6, 5 and 5 rows, so 2, 1 and 1 scoring forwards, and the short ranks pad. Their
    padding forwards must run with the reference's adapters (off, or the reference adapter on), or the
    gathers mix adapters (or hang). The KL the step logs equals ZeRO-2's (no collective there), after a
    move of the EMA reference."""
    batch, algo, _, _ = _batch(tiny_model_path, kl=True)
    kwargs = {"reference": True, "ref_update_fn": create_ema_updater(0.5) if ema else None}
    logged = {}
    for stage in (2, 3):
        actors = _group(ray_local, tiny_model_path, stage, 3, mbs=5, **kwargs)
        try:
            ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)
            if ema:
                ray_local.get([a.move_reference.remote(1) for a in actors], timeout=300)
            updates = ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)
        finally:
            done(ray_local, actors)
        logged[stage] = sum(u[0]["loss/kl"] for u in updates)
    assert logged[2] > 1e-6  # the policy moved off the reference
    assert logged[3] == pytest.approx(logged[2], rel=1e-5)


def test_a_rebuilt_group_restores_adapters_optimizer_and_reference_from_a_snapshot(ray_local, tiny_model_path):
    """What recovery does after a rank dies, with LoRA: the snapshot holds the adapters, their Adam
    moments and the EMA reference adapter, not the frozen base (a new group loads the base from the
    model). A new group restored from it makes the next step exactly as the old group did."""
    batch, algo, rollouts, _ = _batch(tiny_model_path, kl=True)
    ema = create_ema_updater(0.5)
    actors = _group(ray_local, tiny_model_path, 2, 2, reference=True, ref_update_fn=ema)
    try:
        ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)
        ray_local.get([a.move_reference.remote(1) for a in actors], timeout=300)
        parts = [part for _, part in ray_local.get([a.snapshot.remote() for a in actors], timeout=300)]
        sizes = ray_local.get([a.snapshot.remote() for a in actors], timeout=300)
        ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)
        continuous = ray_local.get(actors[0].full_state.remote())
        reference = ray_local.get(actors[0].reference_checksums.remote())
    finally:
        done(ray_local, actors)
    # rank 0's part: the adapters, its half of their fp32 masters and Adam moments, and the reference adapter;
    # a part that held the frozen base would be larger than the base itself
    frozen_bytes = sum(v.nbytes for k, v in continuous.items() if ".lora_" not in k)
    assert sizes[0][0] < 0.5 * frozen_bytes
    actors = _group(ray_local, tiny_model_path, 2, 2, reference=True, ref_update_fn=ema, fresh=True)  # new processes
    try:
        ray_local.get([a.restore.remote(*parts) for a in actors], timeout=300)
        assert ray_local.get(actors[1].reference_checksums.remote()) == reference
        ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)
        replayed = ray_local.get(actors[0].full_state.remote())
    finally:
        done(ray_local, actors)
    for name, value in continuous.items():
        assert np.array_equal(replayed[name], value), name


def test_the_local_backend_refuses_model_lora_by_name(tiny_model_path):
    from cluster.local import LocalBackend

    with pytest.raises(ValueError, match=r"LocalBackend: model.lora is for the Ray trainer ranks .*with_lora"):
        LocalBackend(ModelConfig(tiny_model_path, lora=LORA), reward_fn=lambda r: 0.0)


def test_a_rank_built_from_python_refuses_lora_checkpointing_under_zero3_on_an_old_deepspeed(
        monkeypatch, tiny_model_path):
    """A group built by hand passes no job check: its rank refuses the combination itself, by its role
    and rank, before it loads the model (the installed DeepSpeed builds it:
    ``test_lora_trains_only_the_adapters_as_one_process_does``)."""
    import importlib.metadata

    import rl_actors.trainer as trainer_module

    loads = []
    real_load = trainer_module.load_causal_lm
    monkeypatch.setattr(trainer_module, "load_causal_lm", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    config = TrainerConfig(zero_stage=3, lr=1e-2, gradient_checkpointing=True)
    worker = TrainerWorker(ModelConfig(tiny_model_path, lora=LORA), 0, 1, config, seed=0)
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.19.2" if name == "deepspeed" else real_version(name))
    with pytest.raises(ValueError, match=r"^trainer 0: cluster.gradient_checkpointing with model.lora under "
                                         r"cluster.zero_stage 3 needs DeepSpeed 0.19.8 or later.*this is "
                                         r"DeepSpeed 0.19.2"):
        worker.setup(*worker.endpoint())
    assert loads == []  # refused before the model loads
