"""The seeds' worked examples (seeds/002 Examples 1 to 6) as their readers write them, through
``rl_primitives``: each test copies the example's user code - its reward functions, loaders,
hooks and calls - and runs it for 1 to 3 steps on the embedded tiny model (a local directory
in place of "meta-llama/Llama-3-8B", CPU and float32 in place of cuda and bfloat16, and
``num_return_sequences=2``: GRPO needs two completions per prompt, the seeds' n=1 is refused,
tested below). Where an example repeats one of the seeds' known errors (seeds README 1 to
9), a test checks the refusal and the supported form it names. docs/seeds.md has the table.
"""
import copy
import math
import re
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import rl_primitives.api as seed_api
from rl_primitives import (
    Batch,
    Conversation,
    GenerationConfig,
    Message,
    Rollout,
    TrainingState,
    TrainingStats,
    compute_grpo_advantages,
    compute_grpo_loss,
    compute_per_token_kl,
    create_algorithm_config,
    create_batch_rollouts,
    create_multiturn_rollout,
    create_ref_update_fn,
    generate_with_logprobs,
    get_reference_logprobs,
    log_to_console,
    safe_calculate,
    save_checkpoint,
    train,
    training_iteration,
    training_step,
)

TRAINING_PROMPTS = [
    "What is 2+2? Explain your answer.",
    "Is Paris the capital of France?",
    "What color is the sky?",
] * 10


def load_prompts(iteration: int) -> List[str]:
    """Load prompts for iteration (seeds/002 Example 1, as written)"""
    batch_size = 4
    start_idx = (iteration * batch_size) % len(TRAINING_PROMPTS)
    end_idx = start_idx + batch_size
    return TRAINING_PROMPTS[start_idx:end_idx]


def correctness_reward(rollout: Rollout) -> float:
    """Check if generation contains correct answer (seeds/002 Example 1, as written)"""
    text = rollout.generation.text.lower()
    if "correct" in text or "yes" in text:
        return 1.0
    elif "incorrect" in text or "no" in text:
        return 0.0
    else:
        return 0.5


def conciseness_reward(rollout: Rollout) -> float:
    """Reward conciseness (seeds/002 Example 2, as written): varies with the sampled length"""
    length = len(rollout.generation.text)
    if 100 <= length <= 300:
        return 1.0
    elif length < 100:
        return length / 100
    else:
        return max(300 / length, 0.3)


def setup(path, lr=1e-5):
    """Example 1's setup, on the tiny model: policy, tokenizer, frozen reference copy, AdamW."""
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ref_model = copy.deepcopy(model)
    ref_model.eval()
    for param in ref_model.parameters():
        param.requires_grad = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, tokenizer, ref_model, optimizer


def gen_config_of_example_1(**changes):
    return GenerationConfig(**{"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "do_sample": True,
                               "num_return_sequences": 2, **changes})


# ----------------------------------------------------------------------------- Example 1
def test_example_1_basic_grpo_loop_runs_as_written(tiny_model_path, capsys):
    torch.manual_seed(0)
    model, tokenizer, ref_model, optimizer = setup(tiny_model_path)
    algorithm_config = create_algorithm_config(algorithm="grpo", params={"kl_coef": 0.1})
    initial_state = TrainingState(iteration=0, global_step=0, model=model, optimizer=optimizer, ref_model=ref_model,
                                  stats_history=[])
    seen = []
    final_state = train(
        initial_state=initial_state,
        prompt_loader=load_prompts,
        num_iterations=2,
        gen_config=gen_config_of_example_1(),
        algorithm_config=algorithm_config,
        reward_fn=correctness_reward,
        logger=log_to_console,
        eval_every=10,
        iteration_hook=lambda state, batch: seen.append((state, batch)),
    )
    print(f"Training complete! Final iteration: {final_state.iteration}")
    out = capsys.readouterr().out
    assert "[Iter 1] Loss:" in out and "[Iter 2] Loss:" in out and "Final iteration: 2" in out
    assert final_state.iteration == 2 and final_state.global_step == 2 and len(final_state.stats_history) == 2
    assert final_state.model is model and final_state.optimizer is optimizer and final_state.ref_model is ref_model
    assert algorithm_config["algorithm"] == "grpo" and algorithm_config.kl_coef == 0.1
    for it, (state, batch) in enumerate(seen):
        # the loader's prompts of that iteration, each answered twice, scored by the seed's reward on the views
        assert sorted({str(r.prompt) for r in batch.rollouts}) == sorted(set(load_prompts(it)))
        assert len(batch) == 2 * len(load_prompts(it)) and len({r.uid for r in batch.rollouts}) == len(batch)
        assert all(r.uid.startswith(f"e{it}/") for r in batch.rollouts)
        assert [r.reward for r in batch.rollouts] == [correctness_reward(r) for r in batch.rollouts]
        assert all(r.generation.text == r.text and r.ref_logprobs is not None for r in batch.rollouts)
        stats = state.stats_history[-1]
        assert isinstance(stats, TrainingStats) and state.iteration == it + 1
        assert stats.rewards_mean == pytest.approx(np.mean([r.reward for r in batch.rollouts]), abs=1e-6)
        assert stats.learning_rate == pytest.approx(1e-5) and math.isfinite(stats.loss)
        assert stats.kl_divergence >= 0.0


def test_example_1_one_completion_per_prompt_is_refused_before_any_generation(tiny_model_path, monkeypatch):
    """The seed's GenerationConfig has n=1 (no num_return_sequences): GRPO compares completions of one
    prompt, so the run is refused before anything is generated, naming n, the seeds' name, the job
    file's, and the single-completion algorithm that would learn."""
    model, _, ref_model, optimizer = setup(tiny_model_path)

    def no_generation(*args, **kwargs):
        raise AssertionError("generated before the n check")

    monkeypatch.setattr(model, "generate", no_generation)
    with pytest.raises(ValueError) as e:
        train(initial_state=TrainingState(model=model, optimizer=optimizer, ref_model=ref_model),
              prompt_loader=load_prompts, num_iterations=1,
              gen_config=GenerationConfig(max_new_tokens=4, temperature=0.7, top_p=0.9, do_sample=True),
              algorithm_config=create_algorithm_config("grpo", {"kl_coef": 0.1}), reward_fn=correctness_reward)
    assert str(e.value) == (
        "algorithm 'grpo' compares completions of the same prompt and needs at least 2 per prompt; the run samples 1 "
        "(GenerationConfig.n, the seeds' num_return_sequences; generation.group_size in a job file). Sample n >= 2, "
        "or learn from single completions with REINFORCE and a constant baseline: "
        "primitives.maths.algorithms.reinforce(baseline=0.5) "
        "(rl_primitives.create_algorithm_config('reinforce', {'baseline': 0.5}))")


def test_example_1_with_one_completion_per_prompt_learns_with_the_named_constant_baseline(tiny_model_path):
    """The refusal's alternative, run: the seed's n=1 with REINFORCE and baseline 0.5 trains; each
    rollout's advantage is its reward minus 0.5 (test_advantages works the numbers by hand)."""
    torch.manual_seed(0)
    model, _, ref_model, optimizer = setup(tiny_model_path)
    before = [p.detach().clone() for p in model.parameters()]
    seen = []
    final = train(initial_state=TrainingState(model=model, optimizer=optimizer, ref_model=ref_model),
                  prompt_loader=load_prompts, num_iterations=1,
                  gen_config=GenerationConfig(max_new_tokens=4, temperature=0.7, do_sample=True),
                  algorithm_config=create_algorithm_config("reinforce", {"baseline": 0.5}),
                  reward_fn=correctness_reward, iteration_hook=lambda state, batch: seen.append(batch))
    (batch,) = seen
    assert len(batch) == 4 and len({r.group for r in batch.rollouts}) == 4  # one completion per prompt
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert final.loop_state.metrics_history[-1]["algorithm"] == "reinforce"
    assert create_algorithm_config("reinforce", {"baseline": 0.5}).advantage_fn.baseline == 0.5  # not the default 0


# ----------------------------------------------------------------------------- Example 2
def helpfulness_reward(rollout: Rollout) -> float:
    text = rollout.generation.text
    helpful_markers = ["here's how", "you can", "i recommend", "step"]
    score = sum(1 for marker in helpful_markers if marker in text.lower())
    return min(score / 4, 1.0)


def safety_reward(rollout: Rollout) -> float:
    text = rollout.generation.text.lower()
    unsafe_markers = ["hack", "illegal", "dangerous"]
    if any(marker in text for marker in unsafe_markers):
        return 0.0
    return 1.0


def correctness_reward_2(rollout: Rollout) -> float:
    text = rollout.generation.text
    return 1.0 if len(text) > 50 and "because" in text else 0.5


def multi_objective_reward(rollout: Rollout) -> List[float]:
    return [correctness_reward_2(rollout), helpfulness_reward(rollout), safety_reward(rollout),
            conciseness_reward(rollout)]


def weighted_sum_aggregator(rewards: List[float]) -> float:
    weights = [0.4, 0.3, 0.2, 0.1]
    return sum(w * r for w, r in zip(weights, rewards))


def min_threshold_aggregator(rewards: List[float], threshold: float = 0.5) -> float:
    if any(r < threshold for r in rewards):
        return 0.0
    return math.prod(rewards)


def final_reward_fn(rollout: Rollout) -> float:
    vector_rewards = multi_objective_reward(rollout)
    rollout = rollout._replace(reward_metadata={"vector_rewards": vector_rewards})  # noqa: F841 (the seed's line)
    return weighted_sum_aggregator(vector_rewards)


@pytest.mark.parametrize("aggregator", [weighted_sum_aggregator, min_threshold_aggregator])
def test_example_2_vector_rewards_with_the_seeds_aggregators(tiny_model_path, aggregator):
    """The seed's reward vector and its aggregators, as written; the trainer keeps the vector."""
    model, _, _, optimizer = setup(tiny_model_path)
    seen = []
    final_state = train(initial_state=TrainingState(model=model, optimizer=optimizer), prompt_loader=load_prompts,
                        num_iterations=1, gen_config=gen_config_of_example_1(max_new_tokens=12),
                        algorithm_config=create_algorithm_config("grpo", {"kl_coef": 0.0}),
                        reward_fn=multi_objective_reward, aggregate_fn=aggregator,
                        iteration_hook=lambda state, batch: seen.append(batch))
    rollouts = seen[0].rollouts
    for r in rollouts:
        assert r.rewards == pytest.approx(multi_objective_reward(r), abs=1e-6)  # the seeds' view: the vector
        assert r.reward == pytest.approx(aggregator(multi_objective_reward(r)), abs=1e-6)
    assert final_state.stats_history[0].rewards_mean == pytest.approx(np.mean([r.reward for r in rollouts]), abs=1e-6)
    assert any(0 < r.rewards[3] < 1 for r in rollouts)  # conciseness varies with the sampled text


def test_example_2_final_reward_fn_replace_is_refused_naming_metadata(tiny_model_path):
    """seeds README error 9: a reward function's ``_replace(reward_metadata=...)`` is dropped."""
    model, _, _, optimizer = setup(tiny_model_path)
    with pytest.raises(Exception, match=r"reward_metadata: metadata.*seeds README error 9") as info:
        train(initial_state=TrainingState(model=model, optimizer=optimizer), prompt_loader=load_prompts,
              num_iterations=1, gen_config=gen_config_of_example_1(max_new_tokens=4),
              algorithm_config=create_algorithm_config("grpo", {"kl_coef": 0.0}), reward_fn=final_reward_fn)
    assert "final_reward_fn" in str(info.value)


def test_example_2_our_aggregator_factories_are_named_when_passed_as_aggregators():
    from primitives.env.rewards import weighted_sum_aggregator as ours
    from rl_primitives import aggregate_vector_rewards

    with pytest.raises(ValueError, match=r"returned a function: it is a factory; pass weighted_sum_aggregator\(...\)"):
        aggregate_vector_rewards([1.0, 0.5], ours)
    assert aggregate_vector_rewards([1.0, 0.5], aggregator=ours([0.4, 0.6])) == pytest.approx(0.7)


# ----------------------------------------------------------------------------- Example 3
class AlgorithmScheduler:
    """Schedule algorithm changes during training (seeds/002 Example 3; phases at 0, 1, 60)"""

    def __init__(self):
        self.phase_thresholds = {
            0: ("grpo", {"kl_coef": 0.2}),
            1: ("grpo", {"kl_coef": 0.05}),
            60: ("dapo", {"beta": 0.1, "pair_selector": self.top_bottom_pairs})
        }

    def top_bottom_pairs(self, batch: Batch) -> List[tuple]:
        sorted_rollouts = sorted(batch.rollouts,
                                 key=lambda r: r.rewards if isinstance(r.rewards, float) else sum(r.rewards),
                                 reverse=True)
        n = len(sorted_rollouts)
        return [(sorted_rollouts[i], sorted_rollouts[n - 1 - i]) for i in range(n // 2)]

    def get_config(self, iteration: int) -> Dict[str, Any]:
        applicable_threshold = 0
        for threshold in sorted(self.phase_thresholds.keys(), reverse=True):
            if iteration >= threshold:
                applicable_threshold = threshold
                break
        algo, params = self.phase_thresholds[applicable_threshold]
        return create_algorithm_config(algo, params)


def test_example_3_the_seeds_switching_loop_runs_as_written(tiny_model_path, capsys):
    torch.manual_seed(0)
    model, tokenizer, ref_model, optimizer = setup(tiny_model_path, lr=1e-3)
    initial_state = TrainingState(iteration=0, global_step=0, model=model, optimizer=optimizer, ref_model=ref_model)

    def train_with_algorithm_switching(initial_state, prompt_loader, num_iterations, gen_config, algorithm_scheduler,
                                       reward_fn, logger):
        state = initial_state
        for iteration in range(num_iterations):
            algorithm_config = algorithm_scheduler.get_config(iteration)
            if iteration == 0 or algorithm_config != algorithm_scheduler.get_config(iteration - 1):
                print(f"\n=== Switching to {algorithm_config['algorithm'].upper()} at iteration {iteration} ===\n")
            prompts = prompt_loader(iteration)
            state, batch, stats = training_iteration(state, prompts, state.model, tokenizer, gen_config,
                                                     algorithm_config, reward_fn)
            logger(state, stats)
        return state

    scheduler = AlgorithmScheduler()
    before = [p.detach().clone() for p in model.parameters()]
    final_state = train_with_algorithm_switching(initial_state=initial_state, prompt_loader=load_prompts,
                                                 num_iterations=2, gen_config=gen_config_of_example_1(),
                                                 algorithm_scheduler=scheduler, reward_fn=conciseness_reward,
                                                 logger=log_to_console)
    out = capsys.readouterr().out
    assert "=== Switching to GRPO at iteration 0 ===" in out and "=== Switching to GRPO at iteration 1 ===" in out
    assert "[Iter 1] Loss:" in out and "[Iter 2] Loss:" in out
    assert final_state.iteration == 2 and final_state.global_step == 2
    assert [s.custom_metrics["algorithm"] for s in final_state.stats_history] == ["grpo", "grpo"]
    assert scheduler.get_config(0).kl_coef == 0.2 and scheduler.get_config(1).kl_coef == 0.05
    assert all(s.kl_divergence >= 0 and math.isfinite(s.loss) for s in final_state.stats_history)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the model trained


def test_example_3_the_seeds_pairwise_dapo_phase_is_refused_naming_online_dpo():
    """seeds README error 4: the pairwise loss is online DPO here; "dapo" is the paper's DAPO."""
    with pytest.raises(ValueError, match=r"online DPO: create_algorithm_config\('online_dpo', \{'beta': 0.1\}\).*"
                                         r"arXiv 2503.14476.*seeds README error 4"):
        AlgorithmScheduler().get_config(60)
    algo = create_algorithm_config("online_dpo", {"beta": 0.1})
    assert algo.name == "online_dpo" and algo.dpo_beta == 0.1 and algo["algorithm"] == "online_dpo"
    assert create_algorithm_config("dapo").clip_eps_high == 0.28  # the paper's clip-higher


def test_example_3_a_whole_batch_pair_selector_is_refused_naming_the_group_shape():
    with pytest.raises(ValueError, match=r"pair_selector\(members, rng\).*different prompts"):
        create_algorithm_config("online_dpo", {"beta": 0.1, "pair_selector": AlgorithmScheduler().top_bottom_pairs})


def test_example_3_get_config_as_the_facade_trains_schedule(tiny_model_path):
    """The seed's ``get_config(iteration)`` is a function of the iteration: train takes it."""
    model, _, _, optimizer = setup(tiny_model_path)
    final_state = train(initial_state=TrainingState(model=model, optimizer=optimizer), prompt_loader=load_prompts,
                        num_iterations=2, gen_config=gen_config_of_example_1(max_new_tokens=4),
                        algorithm_config=AlgorithmScheduler().get_config, reward_fn=conciseness_reward)
    assert [s.custom_metrics["algorithm"] for s in final_state.stats_history] == ["grpo", "grpo"]
    assert final_state.ref_model is not None  # kl_coef 0.2 needs a reference: a frozen copy was made


# ----------------------------------------------------------------------------- Example 4
AVAILABLE_TOOLS = {
    "calculator": {"description": "Perform arithmetic calculations", "parameters": {"expression": "string"}},
    "search": {"description": "Search for information", "parameters": {"query": "string"}},
    "python": {"description": "Execute Python code", "parameters": {"code": "string"}},
}


def parse_tool_calls_xml(text: str) -> List[Dict[str, Any]]:
    pattern = r'<tool_call name="([^"]+)">(.*?)</tool_call>'
    matches = re.findall(pattern, text, re.DOTALL)
    tool_calls = []
    for name, args_text in matches:
        if name in AVAILABLE_TOOLS:
            tool_calls.append({"id": f"call_{len(tool_calls)}", "name": name,
                               "arguments": {"input": args_text.strip()}})
    return tool_calls


def execute_tool_mock(tool_call: Dict[str, Any]) -> Dict[str, Any]:
    """The seed's executor, its ``eval(args["input"])`` replaced by ``safe_calculate`` (README 6)."""
    name = tool_call["name"]
    args = tool_call["arguments"]
    if name == "calculator":
        try:
            result = safe_calculate(args["input"])
            return {"id": tool_call["id"], "output": str(result), "success": True}
        except Exception:
            return {"id": tool_call["id"], "output": "Error evaluating expression", "success": False}
    elif name == "search":
        return {"id": tool_call["id"], "output": f"Search results for: {args['input']}", "success": True}
    return {"id": tool_call["id"], "output": "Unknown tool", "success": False}


def tool_usage_reward(rollout: Rollout) -> float:
    if not rollout.tool_calls:
        return 0.0
    base_reward = 0.5
    if rollout.tool_results:
        success_rate = sum(r.get("success", False) for r in rollout.tool_results) / len(rollout.tool_results)
        base_reward += success_rate * 0.5
    unique_tools = len(set(call["name"] for call in rollout.tool_calls))
    diversity_bonus = min(unique_tools * 0.1, 0.3)
    turn_bonus = min(len(rollout.conversation.messages) * 0.05, 0.3)
    return base_reward + diversity_bonus + turn_bonus


def create_tool_rollout(model: Any, tokenizer: Any, initial_prompt: str, max_turns: int = 5) -> Rollout:
    initial_conversation = Conversation(messages=[Message(role="user", content=initial_prompt)])

    def stop_condition(conv: Conversation) -> bool:
        if not conv.messages:
            return False
        return "<done>" in conv.messages[-1].content.lower()

    rollout = create_multiturn_rollout(
        model=model, tokenizer=tokenizer, initial_conversation=initial_conversation,
        gen_config=GenerationConfig(max_new_tokens=32, temperature=0.7, stop_strings=["<done>"]),
        num_turns=max_turns, tool_parser=parse_tool_calls_xml, tool_executor=execute_tool_mock,
        stop_condition=stop_condition)
    reward = tool_usage_reward(rollout)
    rollout = rollout._replace(rewards=reward)
    return rollout


@pytest.fixture
def scripted_turns(monkeypatch):
    """The model's turns scripted (a random tiny model never writes a tool call): a calculator
    call, then an answer ending in <done>. Everything else - parsing, execution, the chat
    template, masks, the seed's reward - is real."""
    from tests.primitives.test_tools import _scripted_turns

    script = ['<tool_call name="calculator">123+456</tool_call>', "The sum is 579. <done>"]

    def scripted(model, tokenizer, config, generator=None):
        return _scripted_turns(tokenizer, script)

    monkeypatch.setattr(seed_api, "hf_turn_generator", scripted)


def test_example_4_tool_rollout_and_reward_run_as_written(tiny_model_path, scripted_turns):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model_path), AutoTokenizer.from_pretrained(
        tiny_model_path)
    rollout = create_tool_rollout(model, tokenizer, "Calculate the sum of 123 and 456.")
    assert [m.role for m in rollout.conversation.messages] == ["user", "assistant", "tool", "assistant"]
    assert rollout.tool_calls[0]["name"] == "calculator" and rollout.tool_calls[0]["arguments"] == {"input": "123+456"}
    assert rollout.tool_results[0].get("success") is True and rollout.tool_results[0]["output"] == "579"
    assert rollout.reward == pytest.approx(0.5 + 0.5 + 0.1 + 4 * 0.05)  # the seed's tool_usage_reward
    assert rollout.rewards == rollout.reward
    # README 7: the tool's output is in the completion but not in the loss
    mask, text = np.asarray(rollout.loss_mask), tokenizer.decode(rollout.completion_ids)
    assert "<tool_response>579</tool_response>" in text and 0 < mask.sum() < len(mask)
    ids = rollout.completion_ids.tolist()
    tool_ids = tokenizer("579</tool_response>", add_special_tokens=False).input_ids
    start = next(i for i in range(len(ids)) if ids[i:i + len(tool_ids)] == tool_ids)
    assert mask[start:start + len(tool_ids)].sum() == 0 and mask[0] == 1 and mask[-1] == 1


def test_example_4_the_hand_loop_is_refused_at_the_float_loss(tiny_model_path, scripted_turns):
    """The seed's loop: ``Batch(rollouts=...)`` works; one-at-a-time rollouts share index 0 and
    are refused by ``compute_grpo_advantages``; ``compute_grpo_loss`` (README 1) names
    ``training_step``."""
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model_path), AutoTokenizer.from_pretrained(
        tiny_model_path)
    batch = Batch(rollouts=[create_tool_rollout(model, tokenizer, "Calculate 123+456")])
    assert len(batch) == 1 and sum(len(r.tool_calls) for r in batch.rollouts) / len(batch) == 1.0
    with pytest.raises(ValueError, match="two rollouts have uid e0/i0/s0.*create_batch_rollouts"):
        compute_grpo_advantages(Batch(rollouts=[batch.rollouts[0], batch.rollouts[0]]))
    with pytest.raises(TypeError, match=r"no gradient reaches the model \(seeds README error 1\).*training_step"):
        compute_grpo_loss(batch, [0.0], kl_coef=0.1)


def test_example_4_tool_use_on_the_loop_with_the_seeds_parser_and_executor(tiny_model_path, monkeypatch):
    """The seed's parser, executor and reward on ``train(..., tools=ToolConfig(...))``: the
    generator's turns scripted by context (a tool call, then, after the tool's answer, <done>)."""
    import cluster.local
    from primitives.env.tools import ToolConfig
    from primitives.model.generation import GenerationOutput

    def scripted(model, tokenizer, config, generator=None):
        def generate_turn(context_ids):
            seen = tokenizer.decode(context_ids.tolist())
            text = "The sum is 579. <done>" if "<tool_response>" in seen else \
                '<tool_call name="calculator">123+456</tool_call>'
            ids = np.asarray(tokenizer(text, add_special_tokens=False).input_ids, dtype=np.int64)
            return GenerationOutput(ids, np.full(len(ids), -0.5, np.float32), "stop", text)

        return lambda contexts: [generate_turn(c) for c in contexts]

    monkeypatch.setattr(cluster.local, "hf_turns_generator", scripted)

    def stop_condition(conv: Conversation) -> bool:
        return bool(conv.messages) and "<done>" in conv.messages[-1].content.lower()

    model, _, _, optimizer = setup(tiny_model_path)
    seen = []
    final_state = train(initial_state=TrainingState(model=model, optimizer=optimizer),
                        prompt_loader=lambda iteration: ["Calculate the sum of 123 and 456.", "Add 123 and 456."],
                        num_iterations=1, gen_config=gen_config_of_example_1(max_new_tokens=32),
                        algorithm_config=create_algorithm_config("grpo", {"kl_coef": 0.0}), reward_fn=tool_usage_reward,
                        tools=ToolConfig(execute_tool_mock, parse_tool_calls_xml, stop_condition, max_turns=3),
                        iteration_hook=lambda state, batch: seen.append(batch))
    rollouts = seen[0].rollouts
    assert len(rollouts) == 4 and [r.reward for r in rollouts] == pytest.approx([1.3] * 4)
    assert all(r.tool_calls[0]["name"] == "calculator" and r.tool_results[0].get("success") for r in rollouts)
    assert final_state.stats_history[0].custom_metrics["tools/calls_per_rollout"] == pytest.approx(1.0)


# ----------------------------------------------------------------------------- Example 5
def test_example_5_ema_reference_updates_through_train(tiny_model_path):
    """``create_ref_update_fn("ema", decay=0.995)`` passed as ``ref_model_update_fn``: after
    one step the reference is exactly 0.995 * start + 0.005 * trained policy."""
    torch.manual_seed(0)
    model, _, ref_model, optimizer = setup(tiny_model_path, lr=1e-2)
    ref0 = {k: v.detach().clone() for k, v in ref_model.named_parameters()}
    ref_update_fn = create_ref_update_fn("ema", decay=0.995)
    final_state = train(initial_state=TrainingState(iteration=0, global_step=0, model=model, optimizer=optimizer,
                                                    ref_model=ref_model, stats_history=[]),
                        prompt_loader=load_prompts, num_iterations=1, gen_config=gen_config_of_example_1(),
                        algorithm_config=create_algorithm_config("grpo", {"kl_coef": 0.1}),
                        reward_fn=conciseness_reward, ref_model_update_fn=ref_update_fn, logger=log_to_console)
    policy = dict(model.named_parameters())
    moved = 0
    for name, p in final_state.ref_model.named_parameters():
        expected = 0.995 * ref0[name] + 0.005 * policy[name].detach()
        assert torch.allclose(p, expected, atol=1e-6), name
        moved += int(not torch.equal(p, ref0[name]))
    assert moved > 0 and final_state.ref_model is ref_model


def test_example_5_the_seeds_model_to_model_update_is_refused_naming_create_ref_update_fn(tiny_model_path):
    def ema_update(ref_model, policy_model, decay=0.999):
        return ref_model

    model, _, ref_model, optimizer = setup(tiny_model_path)
    with pytest.raises(ValueError, match=r"ref_update_fn\(ref_state, policy_weights, step, kl\).*"
                                         r"create_ref_update_fn\('ema', decay=0.995\)"):
        train(initial_state=TrainingState(model=model, optimizer=optimizer, ref_model=ref_model),
              prompt_loader=load_prompts, num_iterations=1, gen_config=gen_config_of_example_1(),
              algorithm_config=create_algorithm_config("grpo", {"kl_coef": 0.1}), reward_fn=correctness_reward,
              ref_model_update_fn=lambda ref, policy: ema_update(ref, policy, 0.995))


def test_example_5_the_seeds_float_kl_functions_are_refused_as_kl_fn(tiny_model_path):
    """README 2: ``truncated_kl(logprobs, ref_logprobs, threshold)`` sums ``exp(lp) * (lp - ref_lp)``
    into a float; as a ``kl_fn`` it fails the algorithm's check before any step."""
    def truncated_kl(logprobs: List[float], ref_logprobs: List[float], threshold: float = 1.0) -> float:
        kl = 0.0
        for lp, ref_lp in zip(logprobs, ref_logprobs):
            prob = math.exp(lp)
            token_kl = prob * (lp - ref_lp)
            token_kl = min(token_kl, threshold)
            kl += token_kl
        return kl

    model, _, ref_model, optimizer = setup(tiny_model_path)
    with pytest.raises(ValueError, match=r"kl_fn .*truncated_kl fails on a small sample"):
        train(initial_state=TrainingState(model=model, optimizer=optimizer, ref_model=ref_model),
              prompt_loader=load_prompts, num_iterations=1, gen_config=gen_config_of_example_1(),
              algorithm_config=create_algorithm_config("grpo", {"kl_coef": 0.1, "kl_fn": truncated_kl}),
              reward_fn=correctness_reward)


def test_example_5_custom_kl_rollout_parts(tiny_model_path):
    """``generate_with_logprobs`` runs; ``get_reference_logprobs`` (no temperature) and the
    seed's ``Rollout(conversation=, generation=, kl_divergence=)`` are refused by name;
    ``compute_per_token_kl`` is Schulman's k3, not ``exp(lp) * (lp - ref_lp)`` (README 2)."""
    model, tokenizer, ref_model, _ = setup(tiny_model_path)
    gen_config = GenerationConfig(max_new_tokens=6, temperature=0.7, do_sample=True)
    generation = generate_with_logprobs(model, tokenizer, "What color is the sky?", gen_config)
    assert len(generation.token_ids) == len(generation.logprobs) > 0 and np.all(generation.logprobs <= 0)
    with pytest.raises(TypeError, match=r"create_rollout\(model, tokenizer, prompt, gen_config, ref_model=ref_model\)"):
        get_reference_logprobs(ref_model, tokenizer, "What color is the sky?", generation.token_ids)
    with pytest.raises(TypeError, match=r"Rollout\(conversation=..., generation=..., kl_divergence=..., rewards=..., "
                                        r"token_ids=...\).*create_rollout.*kl_divergence: nothing per rollout"):
        Rollout(prompt="x", conversation=Conversation(messages=[]), generation=generation,
                token_ids=generation.token_ids, logprobs=generation.logprobs, rewards=0.0, kl_divergence=0.1)
    lp, ref = [-1.0, -2.0], [-1.5, -1.0]  # l = lp - ref = [0.5, -1.0]; k3 = exp(-l) - 1 + l
    assert compute_per_token_kl(lp, ref) == pytest.approx([math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0], abs=1e-6)


# ----------------------------------------------------------------------------- Example 6
class RewardEnsemble:
    """Ensemble of reward functions (seeds/002 Example 6; no reward model path given)"""

    def __init__(self, reward_model_path: str = None):
        self.rm = None

    def rule_based_reward(self, rollout: Rollout) -> float:
        text = rollout.generation.text
        score = 0.0
        length = len(text)
        if 100 <= length <= 500:
            score += 0.3
        if any(marker in text for marker in ["\n\n", "1.", "2.", "First", "Second"]):
            score += 0.2
        if any(kw in text.lower() for kw in ["because", "therefore", "explanation"]):
            score += 0.2
        if text.strip().endswith((".", "!", "?")):
            score += 0.1
        return score + length / 1000  # + a length term, so a random model's groups have a spread

    def model_based_reward(self, rollout: Rollout) -> float:
        if self.rm is None:
            return 0.0
        raise AssertionError("no reward model in this test")

    def combined_reward(self, rollout: Rollout) -> float:
        rule_score = self.rule_based_reward(rollout)
        model_score = self.model_based_reward(rollout)
        if self.rm is not None:
            return 0.3 * rule_score + 0.7 * model_score
        return rule_score


class AdaptiveAlgorithmConfig:
    def __init__(self):
        self.iteration = 0
        self.reward_history = []

    def update(self, stats: TrainingStats):
        self.iteration += 1
        self.reward_history.append(stats.rewards_mean)

    def get_config(self) -> Dict[str, Any]:
        if self.iteration < 30:
            return create_algorithm_config("grpo", {"kl_coef": 0.2})
        elif self.iteration < 60:
            return create_algorithm_config("grpo", {"kl_coef": 0.1})
        return create_algorithm_config("dapo", {"beta": 0.1})


def test_example_6_the_complete_pipeline_runs_as_written(tiny_model_path, tmp_path, monkeypatch, capsys):
    """``advanced_training_loop`` (wandb off): create_batch_rollouts, training_step, the
    user's own EMA on models, the cosine scheduler, the logger, eval and checkpoints."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)

    def setup_models(model_name: str):
        model = AutoModelForCausalLM.from_pretrained(model_name)
        tokenizer = AutoTokenizer.from_pretrained(model_name)
        tokenizer.pad_token = tokenizer.eos_token
        ref_model = copy.deepcopy(model)
        ref_model.eval()
        for param in ref_model.parameters():
            param.requires_grad = False
        return model, tokenizer, ref_model

    def ema_update(ref_model, policy_model, decay=0.999):
        with torch.no_grad():
            for ref_param, policy_param in zip(ref_model.parameters(), policy_model.parameters()):
                ref_param.data.mul_(decay).add_(policy_param.data, alpha=1 - decay)
        return ref_model

    def advanced_training_loop(model_name, prompts_dataset, num_iterations, batch_size=8):
        model, tokenizer, ref_model = setup_models(model_name)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=num_iterations)
        reward_ensemble = RewardEnsemble()
        algo_config = AdaptiveAlgorithmConfig()

        def ema_ref_update(ref, policy):
            return ema_update(ref, policy, decay=0.999)

        state = TrainingState(iteration=0, global_step=0, model=model, optimizer=optimizer, scheduler=scheduler,
                              ref_model=ref_model, stats_history=[])
        gen_config = GenerationConfig(max_new_tokens=12, temperature=0.8, top_p=0.95, do_sample=True,
                                      num_return_sequences=2)
        import random

        def load_prompts(iteration: int) -> List[str]:
            random.seed(iteration)
            return random.sample(prompts_dataset, min(batch_size, len(prompts_dataset)))

        def custom_logger(state: TrainingState, stats: TrainingStats):
            print(f"[Iter {state.iteration:3d}] Loss: {stats.loss:.4f} | "
                  f"Reward: {stats.rewards_mean:.4f}±{stats.rewards_std:.4f} | "
                  f"KL: {stats.kl_divergence:.4f} | LR: {stats.learning_rate:.2e}")

        def checkpoint_fn(state: TrainingState):
            save_checkpoint(state, f"checkpoints/iter_{state.iteration}")

        def eval_fn(state: TrainingState) -> Dict[str, float]:
            eval_prompts = ["Explain quantum computing in simple terms.", "What are the benefits of exercise?"]
            eval_batch = create_batch_rollouts(state.model, tokenizer, eval_prompts, gen_config,
                                               ref_model=state.ref_model, reward_fn=reward_ensemble.combined_reward)
            rewards = [r.rewards for r in eval_batch.rollouts]
            return {"eval_reward_mean": sum(rewards) / len(rewards), "eval_reward_max": max(rewards),
                    "eval_reward_min": min(rewards)}

        evals = []
        for iteration in range(num_iterations):
            algorithm_config = algo_config.get_config()
            prompts = load_prompts(iteration)
            batch = create_batch_rollouts(model, tokenizer, prompts, gen_config, ref_model=ref_model,
                                          reward_fn=reward_ensemble.combined_reward, batch_size=batch_size)
            state, stats = training_step(state, batch, algorithm_config)
            algo_config.update(stats)
            new_ref_model = ema_ref_update(ref_model, model)
            ref_model = new_ref_model
            state = state._replace(ref_model=ref_model)
            state = state._replace(iteration=iteration + 1)
            custom_logger(state, stats)
            if iteration % 10 == 0:
                eval_results = eval_fn(state)
                print(f"  Eval: {eval_results}")
                evals.append(eval_results)
            if iteration % 20 == 0:
                checkpoint_fn(state)
        checkpoint_fn(state)
        return state, algo_config, evals

    prompts = ["Explain how neural networks work.", "What is the capital of France and why?",
               "Write a short story about a robot learning to paint."] * 10
    final_state, algo_config, evals = advanced_training_loop(tiny_model_path, prompts, num_iterations=2,
                                                             batch_size=3)
    out = capsys.readouterr().out
    assert final_state.iteration == 2 and final_state.global_step == 2 and len(final_state.stats_history) == 2
    assert "[Iter   1] Loss:" in out and "[Iter   2] Loss:" in out and "  Eval: {'eval_reward_mean':" in out
    lrs = [s.learning_rate for s in final_state.stats_history]
    assert lrs[0] == pytest.approx(1e-3) and lrs[1] == pytest.approx(0.5e-3)  # cosine, T_max=2: stepped once
    assert algo_config.reward_history == [s.rewards_mean for s in final_state.stats_history]
    assert all(s.kl_divergence >= 0 and math.isfinite(s.loss) for s in final_state.stats_history)
    assert evals and evals[0]["eval_reward_min"] <= evals[0]["eval_reward_mean"] <= evals[0]["eval_reward_max"]
    for name in ("iter_1", "iter_2"):  # iteration 0's checkpoint is written after it: iter_1, then the final
        assert (tmp_path / "checkpoints" / name / "config.json").exists()


def test_example_6_the_late_dapo_phase_and_a_stateful_config_object_are_refused(tiny_model_path):
    config = AdaptiveAlgorithmConfig()
    config.iteration = 60
    with pytest.raises(ValueError, match=r"create_algorithm_config\('online_dpo'"):
        config.get_config()
    model, _, _, optimizer = setup(tiny_model_path)
    with pytest.raises(ValueError, match=r"hidden \(seeds README error 9\).*last_metrics"):
        train(initial_state=TrainingState(model=model, optimizer=optimizer), prompt_loader=load_prompts,
              num_iterations=1, gen_config=gen_config_of_example_1(), algorithm_config=config.get_config,
              reward_fn=correctness_reward)


def test_example_6_training_step_needs_the_sampling_temperature(tiny_model_path):
    model, tokenizer, _, optimizer = setup(tiny_model_path)
    batch = create_batch_rollouts(model, tokenizer, ["a", "b"], gen_config_of_example_1(max_new_tokens=3),
                                  reward_fn=conciseness_reward)
    assert batch.batch_metadata["temperature"] == 0.7
    assert [r.group for r in batch.rollouts] == ["e0/i0", "e0/i0", "e0/i1", "e0/i1"]
    with pytest.raises(ValueError, match="does not record the temperature"):
        training_step(TrainingState(model=model, optimizer=optimizer), Batch(rollouts=batch.rollouts),
                      create_algorithm_config("grpo", {"kl_coef": 0.0}))


def test_the_seeds_load_model_with_lora_trains_the_adapters_alone(tiny_model_path):
    """seeds/001's ``load_model(model_name, use_lora=True)`` and its loop: the seeds' seven
    projections get rank-16 adapters, a step moves only them, and the reference copy stays."""
    from rl_primitives import load_model

    torch.manual_seed(0)
    model = load_model(tiny_model_path, use_lora=True)
    ref_model = copy.deepcopy(model).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    assert {n.split(".")[-4] for n in trained} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = train(initial_state=TrainingState(model=model, optimizer=optimizer, ref_model=ref_model),
                  prompt_loader=load_prompts, num_iterations=2, gen_config=gen_config_of_example_1(),
                  algorithm_config=create_algorithm_config("grpo", {"kl_coef": 0.1}),
                  reward_fn=lambda r: float(len(r.text) % 3))
    assert state.iteration == 2
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert moved and moved <= trained  # the base weights are frozen
    assert all(torch.equal(p, before[n]) for n, p in ref_model.named_parameters())
