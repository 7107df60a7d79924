"""The seeds' names over ours, piece by piece: the Rollout views and their refusals, bare
prompts and ``prompt_loader(iteration)``, ``iteration_hook(state, batch)`` on the loop,
the seeds' configs and factories, ``quick_start_training`` and the debugging utilities."""
import copy
import os
import pickle
import re

import cloudpickle
import numpy as np
import pytest
import torch

from primitives.io.data import PromptItem, make_prompt_source, prompt_source_from_loader
from primitives.types import Conversation, DataPosition, Message, Rollout, RolloutBatch


def rollout(**changes) -> Rollout:
    fields = dict(uid="e0/i0/s0", group="e0/i0", prompt="2+2=", prompt_ids=np.arange(4),
                  completion_ids=np.array([5, 6, 7]), loss_mask=np.ones(3, np.float32),
                  logprobs=np.array([-0.1, -0.2, -0.3], np.float32), finish_reason="stop", text="4. yes", reward=1.0)
    return Rollout(**{**fields, **changes})


# ----------------------------------------------------------------------------- Rollout views
def test_the_seeds_views_read_our_fields():
    r = rollout()
    g = r.generation
    assert g.text == "4. yes" and g.finish_reason == "stop"
    assert g.token_ids.tolist() == [5, 6, 7] and g.logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert r.token_ids is r.completion_ids and r.rewards == 1.0
    assert r._replace(reward_vector=np.array([0.5, 0.25], np.float32)).rewards == [0.5, 0.25]
    assert [(m.role, m.content) for m in r.conversation.messages] == [("user", "2+2="), ("assistant", "4. yes")]
    chat = Conversation((Message("system", "be brief"), Message("user", "hi")))
    assert [m.role for m in rollout(prompt=chat).conversation.messages] == ["system", "user", "assistant"]
    multi = rollout(metadata={"conversation": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                               {"role": "tool", "content": "3", "tool_call_id": "c0", "name": "calc"}]})
    assert [(m.role, m.content) for m in multi.conversation.messages] == [("user", "q"), ("assistant", "a"),
                                                                          ("tool", "3")]
    assert multi.conversation.messages[2].tool_call_id == "c0"


def test_unknown_seed_names_say_what_stands_for_them_and_other_names_stay_plain():
    r = rollout()
    with pytest.raises(AttributeError, match=r"no attribute 'kl_divergence' \(the seeds' name\); here: nothing per "
                                             r"rollout.*kl_fn"):
        r.kl_divergence  # noqa: B018
    with pytest.raises(AttributeError, match=r"'reward_metadata' \(the seeds' name\); here: metadata"):
        r.reward_metadata  # noqa: B018
    with pytest.raises(AttributeError, match=r"^'Rollout' object has no attribute 'nonsense'$"):
        r.nonsense  # noqa: B018
    assert getattr(r, "nonsense", 7) == 7 and not hasattr(r, "per_token_kl")
    broken = rollout(metadata={"conversation": ["not a dict"]})
    with pytest.raises(AttributeError, match="'str' object has no attribute 'get'"):  # the view's own error
        broken.conversation  # noqa: B018


def test_replace_maps_a_scalar_rewards_and_refuses_the_seeds_other_fields():
    r = rollout(reward=None)
    assert r._replace(rewards=0.75).reward == 0.75 and r.reward is None  # a new rollout; the old one stays
    with pytest.raises(ValueError, match=r"rewards: reward .* and reward_vector"):
        r._replace(rewards=[0.5, 1.0])
    with pytest.raises(ValueError, match=r"reward_metadata: metadata\. _replace returns a new rollout.*error 9"):
        r._replace(reward_metadata={"a": 1})
    with pytest.raises(ValueError, match="unexpected field names"):
        r._replace(not_a_field=1)


def test_rollouts_and_rollout_batches_survive_pickling_copying_and_replace():
    r = rollout(reward_vector=np.array([1.0, 0.0], np.float32), metadata={"turns": 2})
    for clone in (pickle.loads(pickle.dumps(r)), cloudpickle.loads(cloudpickle.dumps(r)), copy.deepcopy(r)):
        assert type(clone) is Rollout and clone._fields == r._fields
        assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(clone, r))
    batch = RolloutBatch((r, r._replace(uid="e0/i0/s1", reward=0.0)), {"temperature": 0.7})
    assert len(batch) == 2 and len(batch.filter(lambda x: x.reward > 0.5)) == 1
    again = pickle.loads(pickle.dumps(batch))
    assert type(again) is RolloutBatch and len(again) == 2 and again.batch_metadata == {"temperature": 0.7}
    assert batch._replace(batch_metadata=None).batch_metadata is None


# ----------------------------------------------------------------------------- prompts
def test_bare_prompts_get_distinct_indices_and_serve_epoch_after_epoch():
    source = make_prompt_source(["plain", "strings", "here"], shuffle=False)
    items, pos = source(DataPosition(), 4)
    assert [(it.index, it.epoch, it.prompt) for it in items] == [(0, 0, "plain"), (1, 0, "strings"), (2, 0, "here"),
                                                                 (0, 1, "plain")]
    assert pos == DataPosition(1, 1)
    with pytest.raises(ValueError, match="prompts 0 and 1 have the same index 3"):
        make_prompt_source([PromptItem(3, "a"), PromptItem(3, "b")])
    with pytest.raises(ValueError, match="prompt 1: int is not a prompt"):
        make_prompt_source(["a", 5])


def test_a_prompt_loader_becomes_a_resumable_prompt_source():
    prompts = [f"p{i}" for i in range(6)]
    calls = []

    def load_prompts(iteration):
        calls.append(iteration)
        start = (iteration * 4) % len(prompts)
        return prompts[start:start + 4]

    source = prompt_source_from_loader(load_prompts)
    first, pos = source(DataPosition(), 4)
    second, pos2 = source(pos, 4)
    assert [it.prompt for it in first] == ["p0", "p1", "p2", "p3"] and [it.prompt for it in second] == ["p4", "p5"]
    assert [(it.epoch, it.index) for it in first + second] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert pos == DataPosition(0, 1) and pos2 == DataPosition(0, 2) and calls == [0, 1]
    assert [it.prompt for it in source(pos2, 4)[0]] == load_prompts(2)  # resuming calls the loader where it stopped
    with pytest.raises(ValueError, match="returned no prompts at iteration 5"):
        prompt_source_from_loader(lambda it: [])(DataPosition(0, 5), 4)
    with pytest.raises(ValueError, match="prompt_loader"):
        prompt_source_from_loader(lambda: ["x"])


# ----------------------------------------------------------------------------- the loop's hook
def reward_len(r) -> float:
    return float(len(r.text) % 3)


def test_iteration_hook_sees_each_steps_state_and_trained_rollouts(tiny_model_path):
    from cluster.local import LocalBackend
    from cluster.loop.train import Hooks, RLRun, train
    from primitives.maths.algorithms import constant_schedule, grpo
    from primitives.types import GenerationConfig

    backend = LocalBackend(tiny_model_path, reward_len, seed=0)
    seen = []
    state = train(backend, make_prompt_source(["a", "b", "c"], shuffle=False), constant_schedule(grpo(kl_coef=0.0)),
                  RLRun(GenerationConfig(max_new_tokens=4, n=2), num_steps=2, prompts_per_step=2,
                        lr_schedule=lambda it: 1e-3, progress=False),
                  hooks=Hooks(iteration_hook=lambda s, batch: seen.append((s, batch))))
    assert len(seen) == 2 and seen[-1][0] == state
    for it, (s, batch) in enumerate(seen):
        assert isinstance(batch, RolloutBatch) and len(batch) == 4 and s.iteration == it + 1
        assert s.metrics_history[-1]["step"] == it
        assert s.metrics_history[-1]["reward/mean"] == pytest.approx(np.mean([r.reward for r in batch.rollouts]))
        assert [r.reward for r in batch.rollouts] == [reward_len(r) for r in batch.rollouts]
        assert {r.policy_version for r in batch.rollouts} == {it}
    assert [r.prompt for r in seen[0][1].rollouts] == ["a", "a", "b", "b"]
    assert [r.group for r in seen[1][1].rollouts] == ["e0/i2", "e0/i2", "e1/i0", "e1/i0"]


def test_the_loop_refuses_a_bad_hook_and_a_one_argument_loader_before_any_step(tiny_model_path):
    from cluster.local import LocalBackend
    from cluster.loop.sft import SFTRun, train_sft
    from cluster.loop.train import Hooks, RLRun, train
    from primitives.maths.algorithms import constant_schedule, grpo
    from primitives.types import GenerationConfig

    backend = LocalBackend(tiny_model_path, reward_len, seed=0)
    run = RLRun(GenerationConfig(max_new_tokens=4, n=2), num_steps=1, prompts_per_step=2, lr_schedule=lambda it: 1e-3,
                progress=False)

    def load_prompts(iteration):
        return ["a", "b"]

    with pytest.raises(ValueError, match=r"prompt_loader\(iteration\) -> prompts.*prompt_source_from_loader\(loader\)"):
        train(backend, load_prompts, constant_schedule(grpo(kl_coef=0.0)), run)
    with pytest.raises(ValueError, match=r"iteration_hook: .* cannot be called with 2 argument"):
        train(backend, make_prompt_source(["a"]), constant_schedule(grpo(kl_coef=0.0)), run,
              hooks=Hooks(iteration_hook=lambda batch: None))
    with pytest.raises(ValueError, match="iteration_hook.*train_sft calls"):
        train_sft(backend, ["x"], SFTRun(1, 1, lambda s: 1e-3), Hooks(iteration_hook=lambda s, b: None))
    assert backend.policy_version == 0  # nothing ran


# ----------------------------------------------------------------------------- configs and factories
def test_generation_config_reads_the_seeds_fields():
    from rl_primitives import GenerationConfig

    g = GenerationConfig(max_new_tokens=16, temperature=0.7, top_p=0.9, do_sample=True, num_return_sequences=4,
                         stop_strings=["<done>"], logprobs=True, top_k=-1)
    assert (g.max_new_tokens, g.temperature, g.top_p, g.n, g.stop, g.top_k) == (16, 0.7, 0.9, 4, ("<done>",), 0)
    assert GenerationConfig(do_sample=False).temperature == 0.0 and GenerationConfig().n == 1
    with pytest.raises(ValueError, match="custom_params.*use the fields"):
        GenerationConfig(custom_params={"repetition_penalty": 1.1})
    with pytest.raises(ValueError, match="n=2 and num_return_sequences=3 disagree"):
        GenerationConfig(n=2, num_return_sequences=3)


def test_create_algorithm_config_is_our_preset_and_reads_as_the_seeds_dict():
    from rl_primitives import create_algorithm_config

    algo = create_algorithm_config("grpo", {"kl_coef": 0.1}, entropy_coef=0.01)
    assert algo.name == "grpo" and algo.kl_coef == 0.1 and algo.entropy_coef == 0.01
    assert algo["algorithm"] == "grpo" and algo["params"]["kl_coef"] == 0.1 and algo[0] == "grpo"
    ppo_like = create_algorithm_config("grpo", {"clip_epsilon": 0.3})
    assert (ppo_like.clip_eps_low, ppo_like.clip_eps_high) == (0.3, 0.3)
    with pytest.raises(ValueError, match="unknown AlgorithmConfig field"):
        create_algorithm_config("grpo", {"kl_cof": 0.1})
    with pytest.raises(ValueError, match=r"beta is the pairwise \(online DPO\) loss's"):
        create_algorithm_config("grpo", {"beta": 0.1})


def test_create_ref_update_fn_is_ours_with_an_explicit_step():
    from primitives.maths.kl import RefState, fixed_reference
    from rl_primitives import create_ref_update_fn

    ref, policy = RefState({"w": torch.tensor([0.0, 2.0])}), {"w": torch.tensor([1.0, 0.0])}
    ema = create_ref_update_fn("ema", decay=0.9)(ref, policy, 1, None)
    assert ema.weights["w"].tolist() == pytest.approx([0.1, 1.8])
    periodic = create_ref_update_fn("periodic", reset_every=2)
    assert periodic(ref, policy, 1, None) is ref and periodic(ref, policy, 2, None).weights["w"].tolist() == [1.0, 0.0]
    assert create_ref_update_fn("none") is fixed_reference
    with pytest.raises(ValueError, match="unknown strategy 'emma'"):
        create_ref_update_fn("emma")


def test_quick_start_training_one_call(tiny_model_path, capsys):
    from rl_primitives import quick_start_training

    def my_reward(rollout):
        return len(rollout.generation.text) / 100  # Simple length reward (seeds/003)

    prompts = ["Explain quantum computing", "What is ML?"] * 50
    final_state = quick_start_training(model_name=tiny_model_path, prompts=prompts, reward_fn=my_reward,
                                       num_iterations=2, gen_config=None, prompts_per_step=3)
    assert final_state.iteration == 2 and final_state.global_step == 2 and len(final_state.stats_history) == 2
    means = [s.rewards_mean for s in final_state.stats_history]
    assert all(0 < m <= 0.64 for m in means)  # 64 new tokens at most
    assert final_state.loop_state.data_position == DataPosition(0, 6)  # 3 prompts a step, each its own index
    with pytest.raises(ValueError, match="not a local model directory"):
        quick_start_training(model_name="meta-llama/Llama-3-8B", prompts=prompts, reward_fn=my_reward)


def _seed_train(state, iterations, reference=None, **hooks):
    """``reference`` "periodic": a KL of 0.1 to a reference reset to the policy every 3 steps."""
    from primitives.types import GenerationConfig
    from rl_primitives import create_algorithm_config, create_ref_update_fn, train

    algorithm = create_algorithm_config("grpo", kl_coef=0.1 if reference else 0.0)
    update = create_ref_update_fn("periodic", reset_every=3) if reference else None
    return train(state, make_prompt_source(["a", "b", "c", "d", "e"], shuffle=False), iterations,
                 GenerationConfig(max_new_tokens=4, n=2, temperature=1.0), algorithm,
                 reward_len, ref_model_update_fn=update, prompts_per_step=2, **hooks)


def _fresh_state(path):
    from transformers import AutoModelForCausalLM

    from rl_primitives import TrainingState

    model = AutoModelForCausalLM.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return TrainingState(model=model, optimizer=optimizer,
                         scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: 1.0 / (1 + it)))


def _same_run(a, b):
    keys = ("reward/mean", "loss/total", "grad_norm", "lr", *(("kl/ref_k3",) if a.ref_update_state else ()))
    assert b.iteration == a.iteration and b.loop_state.policy_version == a.loop_state.policy_version
    assert [[s.custom_metrics[k] for k in keys] for s in b.stats_history] == \
        [[s.custom_metrics[k] for k in keys] for s in a.stats_history]
    assert b.loop_state.data_position == a.loop_state.data_position
    for (name, x), y in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("reference", [None, "periodic"])
def test_the_returned_state_passed_back_goes_on_as_one_run(tiny_model_path, reference):
    """``train`` twice, the returned ``TrainingState`` passed back, equals one call of as many
    iterations: the same metrics at each step (the scheduler's learning rate too) and the same final
    weights (a new backend serves the state's policy version; it once started at 0, and the first
    resumed step was refused as stale). With a reference reset every 3 steps, 4 + 2 steps reset it
    at 3 and 6, as 6 do (the state passed back once forgot the reset at 3 and reset at 5)."""
    first = 4 if reference else 2
    straight = _seed_train(_fresh_state(tiny_model_path), first + 2, reference)
    resumed = _seed_train(_seed_train(_fresh_state(tiny_model_path), first, reference), 2, reference)
    assert straight.iteration == first + 2 and straight.loop_state.policy_version == first + 2
    assert len({s.custom_metrics["lr"] for s in straight.stats_history}) == first + 2  # the scheduler moved it
    if reference:
        kl = [s.custom_metrics["kl/ref_k3"] for s in straight.stats_history]
        assert [k == 0 for k in kl] == [True, False, False, True, False, False]  # reset after steps 3 and 6
        assert straight.ref_update_state.last_reset_step == resumed.ref_update_state.last_reset_step == 6
    _same_run(straight, resumed)


@pytest.mark.parametrize("reference", [None, "periodic"])
def test_a_state_saved_and_loaded_back_goes_on_as_one_run(tiny_model_path, tmp_path, reference):
    """The seeds' ``save_checkpoint(state, dir)`` after 2 iterations (4 with a reference reset every
    3 steps), ``load_checkpoint(dir, model, optimizer, scheduler)`` into a fresh model, optimizer and
    scheduler, 2 more: the run of 4 (6). The reference and its last reset come back with it (without
    them the trained policy became the reference, and KL read 0 on the first step after loading)."""
    from rl_primitives import load_checkpoint, save_checkpoint

    first = 4 if reference else 2
    straight = _seed_train(_fresh_state(tiny_model_path), first + 2, reference)
    save_checkpoint(_seed_train(_fresh_state(tiny_model_path), first, reference), str(tmp_path / "saved"))
    fresh = _fresh_state(tiny_model_path)
    loaded = load_checkpoint(str(tmp_path / "saved"), fresh.model, fresh.optimizer, fresh.scheduler)
    assert (loaded.iteration, len(loaded.stats_history), loaded.scheduler.last_epoch) == (first, first, first)
    assert (loaded.ref_model is None) == (reference is None)
    _same_run(straight, _seed_train(loaded, 2, reference))


def test_the_seeds_hooks_that_cannot_be_called_are_refused_before_a_step(tiny_model_path, tmp_path, monkeypatch):
    """The seeds' headline call passes ``checkpoint_fn=save_checkpoint`` (no directory) and
    ``logger=log_to_wandb`` (no project): each is refused with the form that works; that form runs
    (W&B offline, one run for the whole loop)."""
    import functools

    from rl_primitives import log_to_wandb, save_checkpoint

    state = _fresh_state(tiny_model_path)
    with pytest.raises(ValueError, match=r"checkpoint_fn=lambda state: save_checkpoint\(state, "):
        _seed_train(state, 2, checkpoint_fn=save_checkpoint)
    with pytest.raises(ValueError, match=r'functools.partial\(log_to_wandb, project="my-project"\)'):
        _seed_train(state, 2, logger=log_to_wandb)
    assert state.loop_state is None and torch.equal(  # nothing trained
        next(state.model.parameters()), next(_fresh_state(tiny_model_path).model.parameters()))

    from rl_primitives.loop import _WANDB_RUNS

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    saved = []
    final = _seed_train(state, 2, logger=functools.partial(log_to_wandb, project="seeds"),
                        checkpoint_fn=lambda s: saved.append(save_checkpoint(s, str(tmp_path / f"iter_{s.iteration}"))),
                        eval_every=1)
    assert final.iteration == 2 and [os.path.basename(p) for p in saved] == ["iter_1", "iter_2"]
    run = _WANDB_RUNS.pop(("seeds", None))  # one run for the loop, offline
    run.finish()
    assert run.settings.mode == "offline" and os.path.getsize(run.settings.sync_file) > 0


def test_a_loaded_model_needs_a_tokenizer_it_can_find(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from cluster.local import LocalBackend

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    backend = LocalBackend(model, reward_len)
    assert backend.policy is model and backend.tokenizer.pad_token_id is not None
    model.name_or_path = "meta-llama/Llama-3-8B"
    with pytest.raises(ValueError, match=r"needs its tokenizer \(tokenizer=...\)"):
        LocalBackend(model, reward_len)


# ----------------------------------------------------------------------------- utilities
def test_inspect_rollout_prints_every_field_with_arrays_summarised():
    from rl_primitives.utilities import inspect_rollout

    long = rollout(completion_ids=np.arange(50), loss_mask=np.r_[np.ones(30), np.zeros(20)].astype(np.float32),
                   logprobs=-np.linspace(0.1, 5.0, 50).astype(np.float32), text="x" * 1000)
    lines = []
    text = inspect_rollout(long, write=lines.append)
    assert lines == [text]
    for field in Rollout._fields:
        assert f"  {field} " in text or field in ("uid", "group", "policy_version")
    assert "array(50,) int64 [0, 1, 2, 3, 4, 5, 6, 7] ... (+42)  min 0 mean 24.5 max 49" in text
    assert "(+600 chars)" in text and "30 of 50 completion tokens in the loss" in text
    assert "e0/i0/s0" in text.splitlines()[0]


def test_validate_batch_reports_what_training_would_refuse():
    from rl_primitives.utilities import validate_batch

    good = RolloutBatch((rollout(), rollout(uid="e0/i0/s1", reward=0.0)))
    report = validate_batch(good, group_size=2)
    assert report["is_valid"] and report["groups"] == {"e0/i0": 2} and report["num_rollouts"] == 2
    bad = validate_batch([rollout(), rollout(reward=None), rollout(uid="e0/i1/s0", group="e0/i1",
                                                                    logprobs=np.zeros(2, np.float32))])
    assert not bad["is_valid"] and bad["duplicate_uids"] == ["e0/i0/s0"]
    assert [x["uid"] for x in bad["invalid_rollouts"]] == ["e0/i0/s0", "e0/i1/s0"]
    assert any("reward is None" in p for x in bad["invalid_rollouts"] for p in x["problems"])
    assert any("groups of one rollout ['e0/i1']" in p for p in bad["problems"])


def test_plot_training_curves_from_stats_or_metrics(tmp_path):
    from rl_primitives import TrainingStats
    from rl_primitives.utilities import plot_training_curves

    stats = [TrainingStats(1.0 / (i + 1), 0.5, 1e-5, 0.01 * i, 0.1 * i, 0.2) for i in range(4)]
    path = plot_training_curves(stats, save_path=str(tmp_path / "curves.png"))
    assert path.endswith("curves.png") and (tmp_path / "curves.png").stat().st_size > 1000
    metrics = [{"step": i, "loss/total": 1.0, "reward/mean": 0.1 * i} for i in range(3)]
    assert plot_training_curves(metrics, save_path=str(tmp_path / "m.png")).endswith("m.png")
    with pytest.raises(ValueError, match="none of the keys"):
        plot_training_curves(metrics, save_path=str(tmp_path / "x.png"), keys=["nope"])


def test_create_ref_update_fn_names_an_argument_it_does_not_take():
    from rl_primitives import create_ref_update_fn

    with pytest.raises(ValueError, match=r"create_ref_update_fn\('ema'\): unknown argument\(s\) \['deacy'\]; "
                                         "accepted: decay"):
        create_ref_update_fn("ema", deacy=0.5)
    with pytest.raises(ValueError, match="accepted: reset_every"):
        create_ref_update_fn("periodic", every=2)


def test_generate_takes_the_seeds_generation_backend(tiny_model, tokenizer):
    """The seeds' ``generate(model, tokenizer, prompt, config, generator=fn)``: the backend's tokens
    and text; without one, the model's own sampling, as ``create_rollout`` samples."""
    from primitives.types import Generation
    from rl_primitives import GenerationConfig, create_rollout, generate

    config = GenerationConfig(max_new_tokens=4, temperature=0.7, seed=5)
    own = generate(tiny_model, tokenizer, "12+34=", config)
    assert list(own.token_ids) == list(create_rollout(tiny_model, tokenizer, "12+34=", config).generation.token_ids)
    ids = tokenizer("77", add_special_tokens=False).input_ids
    backend = lambda model, tok, prompt, cfg: Generation("77", None, list(ids), "length")  # noqa: E731
    theirs = generate(tiny_model, tokenizer, "12+34=", config, generator=backend)
    assert theirs.text == "77" and list(theirs.token_ids) == list(ids) and len(theirs.logprobs) == len(ids)
    assert all(lp < 0 for lp in theirs.logprobs)  # the policy scored the backend's tokens


def test_single_turn_tool_tracking_with_the_seeds_parser_executor_and_tracker(tiny_model, tokenizer):
    """The seeds' ``create_rollout(..., tool_parser=)`` then ``execute_and_track_tools(rollout, executor,
    result_tracker)``, their dict shapes throughout: the calls are parsed from the completion (before the
    reward, which reads them), run in order, and tracked; the completion is not changed and the rollout
    passed in keeps no results (a new rollout is returned)."""
    import json
    import re

    from primitives.types import Generation
    from rl_primitives import GenerationConfig, create_rollout, execute_and_track_tools, safe_calculate

    text = '<tool_call name="calc">{"expression": "2+3"}</tool_call> <tool_call name="calc">{"expression": "1/0"}' \
           '</tool_call>'
    ids = tokenizer(text, add_special_tokens=False).input_ids
    backend = lambda model, tok, prompt, cfg: Generation(text, None, list(ids), "stop")  # noqa: E731

    def parse_function_calls(text):  # the seeds' parser: dicts
        return [{"name": n, "arguments": json.loads(a), "id": f"c{k}"}
                for k, (n, a) in enumerate(re.findall(r'<tool_call name="(\w+)">(.*?)</tool_call>', text))]

    def execute(call):  # the seeds' executor: a dict in, a dict out
        try:
            return {"id": call["id"], "output": str(safe_calculate(call["arguments"]["expression"])), "success": True}
        except Exception as e:  # noqa: BLE001 - the seeds' shape: failure is a result
            return {"id": call["id"], "output": str(e), "success": False}

    called = create_rollout(tiny_model, tokenizer, "2+3?", GenerationConfig(max_new_tokens=8), generator=backend,
                            tool_parser=parse_function_calls, reward_fn=lambda r: float(len(r.tool_calls)))
    assert called.reward == 2.0 and [c["name"] for c in called.tool_calls] == ["calc", "calc"]
    assert called.tool_calls[0]["arguments"] == {"expression": "2+3"} and called.tool_calls[1].id == "c1"
    done = execute_and_track_tools(called, execute, result_tracker=lambda results: {
        "success_rate": sum(r["success"] for r in results) / len(results)})
    assert [(r["output"], r["success"]) for r in done.tool_results][0] == ("5", True)
    assert done.tool_results[1]["success"] is False and done.tool_results[1].is_error
    assert done.metadata["tool_tracking"] == {"success_rate": 0.5}
    assert list(done.completion_ids) == list(ids) and called.tool_results == ()
    untracked = execute_and_track_tools(called, execute)
    assert untracked.metadata["tool_tracking"] == {} and len(untracked.tool_results) == 2


def test_tool_tracking_refuses_what_it_cannot_use(tiny_model, tokenizer):
    """Our ``create_rollout``'s parser must give ``ToolCall``s and the executor ``ToolResult``s (the seeds'
    wrappers accept their dicts); a tracker returns a dict; the seeds' ``conversation=`` is the prompt here."""
    from primitives.env.rollouts import create_rollout as ours
    from primitives.env.tools import ToolCall, ToolResult
    from primitives.env.tools import execute_and_track_tools as execute_ours
    from primitives.types import Generation
    from rl_primitives import GenerationConfig, create_rollout

    ids = tokenizer("x", add_special_tokens=False).input_ids
    backend = lambda model, tok, prompt, cfg: Generation("x", None, list(ids), "stop")  # noqa: E731
    config = GenerationConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match=r"tool_parser .*<lambda> returned dict; expected a list of "
                                         r"primitives.env.tools.ToolCall\(name, arguments, id\)"):
        ours(tiny_model, tokenizer, "q", config, generate_fn=backend, tool_parser=lambda text: [{"name": "calc"}])
    r = ours(tiny_model, tokenizer, "q", config, generate_fn=backend,
             tool_parser=lambda text: [ToolCall("calc", {"expression": "1+1"}, "c0")])
    with pytest.raises(ValueError, match=r"tool_executor .*<lambda> returned str for the call 'calc'; expected a "
                                         r"primitives.env.tools.ToolResult"):
        execute_ours(r, lambda call: "2")
    with pytest.raises(ValueError, match="result_tracker .*<lambda> returned float; expected a dict"):
        execute_ours(r, lambda call: ToolResult("c0", "calc", "2"), result_tracker=lambda results: 1.0)
    with pytest.raises(ValueError, match=r"create_rollout\(conversation=...\): here the conversation is the prompt"):
        create_rollout(tiny_model, tokenizer, "q", config, conversation=Conversation(()))


def test_the_seeds_model_loaders_and_reward_model_function(tiny_model, tokenizer, tmp_path):
    """seeds/000's ``load_tokenizer(config, tokenizer_loader=)``, ``create_reference_model(model,
    ref_model_fn=)``, ``load_reward_model(config, loader=)`` and ``create_rm_reward_fn(rm, tokenizer)``:
    the reward function's score is the reward model's own of prompt + completion; a tokenizer whose
    vocabulary is not the reward model's is refused."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    from primitives.types import ModelConfig
    from rl_primitives import (
        compute_reward_model_score,
        create_reference_model,
        create_rm_reward_fn,
        load_reward_model,
        load_tokenizer,
    )

    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    config = ModelConfig(str(tmp_path / "rm"))
    assert load_tokenizer(config).get_vocab() == tokenizer.get_vocab()
    assert load_tokenizer(config, tokenizer_loader=lambda c: c.model_name_or_path) == str(tmp_path / "rm")
    ref = create_reference_model(tiny_model)
    assert ref is not tiny_model and not any(p.requires_grad for p in ref.parameters())
    trainable = [p.requires_grad for p in tiny_model.parameters()]
    assert create_reference_model(tiny_model, ref_model_fn=lambda m: m) is tiny_model
    assert [p.requires_grad for p in tiny_model.parameters()] == trainable == [True] * len(trainable)  # not frozen
    create_reference_model(tiny_model, ref_model_fn=lambda m: m.model)  # a submodule: the policy's own weights
    assert [p.requires_grad for p in tiny_model.parameters()] == trainable
    rm = load_reward_model(config)
    assert load_reward_model(config, loader=lambda c: "mine") == "mine"
    r = rollout(prompt="2+2=", text="4. yes")
    score = create_rm_reward_fn(rm, tokenizer)(r)
    assert score == pytest.approx(compute_reward_model_score(rm, rm.reward_tokenizer, "2+2=", "4. yes"), abs=1e-6)
    other = AutoTokenizer.from_pretrained(str(tmp_path / "rm"))
    other.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match=r"this tokenizer's vocabulary is not the reward model's"):
        create_rm_reward_fn(rm, other)


def test_a_generation_backend_gets_one_seed_per_completion(tiny_model, tokenizer):
    """A seeded group of a user's backend: completion k is asked with ``seed + k`` and ``n`` 1, so a
    seeded backend (vLLM's) samples a group whose completions differ; unseeded it gets None. Token
    ids may come as an array (vllm_generator's)."""
    from primitives.types import Generation
    from rl_primitives import GenerationConfig, create_rollouts

    asked = []

    def backend(model, tok, prompt, cfg):
        asked.append((cfg.seed, cfg.n))
        ids = np.asarray(tok("7 + 8", add_special_tokens=False).input_ids)  # an array, of several tokens
        assert len(ids) > 1
        return Generation("7 + 8", None, ids, "length")

    for config in (GenerationConfig(max_new_tokens=2, n=3, seed=40), GenerationConfig(max_new_tokens=2, n=2)):
        create_rollouts(tiny_model, tokenizer, "12+34=", config, generator=backend)
    assert asked == [(40, 1), (41, 1), (42, 1), (None, 1), (None, 1)]


class _LLMBuiltWith:
    """What ``vllm_generator`` reads of a vLLM ``LLM`` before it samples: how its logprobs are made.
    Sampling fails the test: every case here must be refused first."""

    def __init__(self, logprobs_mode):
        self.model_config = type("ModelConfig", (), {"logprobs_mode": logprobs_mode})()

    def generate(self, *args, **kwargs):
        raise AssertionError("sampled before the refusal")


@pytest.mark.parametrize("mode, config, says", [
    ("raw_logprobs", dict(temperature=0.7), "before temperature 0.7"),  # the seeds' LLM(model)
    ("raw_logprobs", dict(temperature=1.3, top_p=0.9), "before temperature 1.3"),
    ("processed_logprobs", dict(temperature=0.7, top_p=0.9), "top_p 0.9 vLLM's processed logprobs are renormalised"),
    ("processed_logprobs", dict(temperature=1.0, top_k=20), "top_k 20 vLLM's processed logprobs are renormalised"),
    ("processed_logits", dict(temperature=1.0), "returns logits, not logprobs"),
    ("raw_logits", dict(temperature=0.0), "returns logits, not logprobs"),
    ("processed_logprobs", dict(temperature=0.005), "vLLM raises a temperature below 0.01 to 0.01"),
])
def test_vllm_generator_refuses_logprobs_of_another_distribution(tokenizer, mode, config, says):
    """The seeds' ``vllm_generator`` on an ``LLM`` whose sampled-token logprobs are not
    ``log_softmax(logits / T)``: refused by name, before sampling, with the ``LLM`` to build."""
    from rl_primitives import GenerationConfig, create_rollout, vllm_generator

    with pytest.raises(ValueError, match=f"vllm_generator: .*{re.escape(says)}"):
        create_rollout(_LLMBuiltWith(mode), tokenizer, "12+34=", GenerationConfig(**config), generator=vllm_generator)


def test_vllm_generator_takes_the_configs_whose_logprobs_vllm_returns():
    """The other side of the refusals: raw logprobs at T 1 (truncation is after them) or greedy
    (scored at T 1), processed ones at any T without top-p / top-k, or greedy."""
    from primitives.model.vllm_generation import behaviour_logprob_error
    from rl_primitives import GenerationConfig

    fine = [("raw_logprobs", dict(temperature=1.0)), ("raw_logprobs", dict(temperature=1.0, top_p=0.9, top_k=5)),
            ("raw_logprobs", dict(temperature=0.0, top_p=0.5)), ("processed_logprobs", dict(temperature=0.7)),
            ("processed_logprobs", dict(temperature=1.6)), ("processed_logprobs", dict(temperature=0.0, top_k=3))]
    assert [behaviour_logprob_error(mode, GenerationConfig(**c)) for mode, c in fine] == [None] * len(fine)


def test_vllm_generator_tells_a_transformers_model_to_sample_itself(tiny_model, tokenizer):
    from rl_primitives import GenerationConfig, create_rollout, vllm_generator

    with pytest.raises(TypeError, match="vllm_generator samples with a vLLM LLM .* got Qwen2ForCausalLM; a "
                                        "transformers model samples with create_rollout's own sampler"):
        create_rollout(tiny_model, tokenizer, "12+34=", GenerationConfig(), generator=vllm_generator)
