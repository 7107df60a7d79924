"""``docs/seeds.md`` is true of the code: every function or class name its tables give in the seed
column imports from ``rl_primitives`` (or ``rl_primitives.utilities``), except the functions a
reader writes (hooks) and Python's own; every dotted name of ours it gives (``primitives.maths.kl
.per_token_kl``) resolves. A name the page promises and the package lacks fails here. Every refusal message the
page quotes is what the row's call raises: ``REFUSALS`` makes each call (on the tiny model, out of Ray, before any
step), and the quote, split at its ``...`` elisions, must occur in the error's message in order."""
import copy
import importlib
import math
import os
import re

import numpy as np
import pytest
import torch

import rl_primitives
import rl_primitives as rp
import rl_primitives.utilities

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "seeds.md")

# names in the seed column that are not the package's to give, each for its reason
READERS_OWN = {
    # hooks the reader writes and passes in
    "reward_fn", "aggregate_fn", "checkpoint_fn", "eval_fn", "iteration_hook", "logger", "prompt_loader",
    "pair_selector", "get_config", "fn",
    # the seeds' own helper functions, refused by their signatures when passed (seeds README 2, 9)
    "ema_update", "truncated_kl", "adaptive_kl", "reward_history",
    # Python's, and methods of records the package does give
    "eval", "len", "exp", "_replace", "add_message",
}


def table_rows() -> list:
    with open(PAGE) as f:
        return [line for line in f if line.startswith("| ") and not line.startswith("| seed name")
                and not line.startswith("|---")]


def seed_names() -> set:
    names = set()
    for row in table_rows():
        for code in re.findall(r"`([^`]+)`", row.split("|")[1]):
            names.update(m.group(1) for m in re.finditer(r"(?<![.\w])([A-Za-z_]\w*)\s*\(", code))
            if re.fullmatch(r"[A-Za-z_]\w*", code.strip()):
                names.add(code.strip())
    return names


def our_dotted_names() -> set:
    out = set()
    for row in table_rows():
        for code in re.findall(r"`([^`]+)`", "|".join(row.split("|")[2:])):
            out.update(re.findall(r"\b((?:primitives|cluster|rl_primitives)(?:\.\w+)+)", code))
    return out


def test_the_page_has_tables_to_check():
    assert len(table_rows()) > 40 and len(seed_names()) > 40 and len(our_dotted_names()) > 10


@pytest.mark.parametrize("name", sorted(seed_names() - READERS_OWN))
def test_each_seed_name_on_the_page_imports_from_rl_primitives(name):
    assert hasattr(rl_primitives, name) or hasattr(rl_primitives.utilities, name), \
        f"docs/seeds.md lists the seeds' {name!r}; rl_primitives has no such name"


@pytest.mark.parametrize("dotted", sorted(our_dotted_names()))
def test_each_of_our_names_on_the_page_resolves(dotted):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), f"docs/seeds.md names {dotted}; {'.'.join(parts[:cut])} has no {attr}"
            obj = getattr(obj, attr)
        return
    raise AssertionError(f"docs/seeds.md names {dotted}, which does not import")


def test_everything_rl_primitives_exports_exists():
    assert all(hasattr(rl_primitives, name) for name in rl_primitives.__all__)
    assert {"generate", "weighted_sum_aggregator", "create_rollout"} <= set(rl_primitives.__all__)


# ----------------------------------------------------------------------------- the page's refusal quotes
# A status that says the seed's call is refused and quotes the message: "refused: `...`", "refused (README 4):
# `...`", "refused before ... (by `train`, ...): `...`", "refused: it has no temperature (`...`)". A `...` in a
# quote stands for elided text. Shorter quotes are names, not messages (`algorithm.critic_lr`).
REFUSAL_QUOTE = re.compile(r"refused(?: \([^)]*\))?[^`|]{0,80}?(?:\([^)]*\))?:\s*(?:[^`|(]{0,40}\()?`([^`]+)`",
                           re.IGNORECASE)
EXCEPTION_PREFIX = re.compile(r"^([A-Z]\w*(?:Error|Exception|Warning)): ")


def row_key(row: str) -> str:
    """A row's name: the first code of its seed column, or the column's text."""
    seed = row.split("|")[1]
    codes = re.findall(r"`([^`]+)`", seed)
    return codes[0] if codes else seed.strip()


def refusal_quotes() -> list:
    """``(row key, quoted message)`` of every refusal the page quotes."""
    return [(row_key(row), m.group(1)) for row in table_rows() for m in REFUSAL_QUOTE.finditer(row)
            if len(m.group(1)) >= 30]


class Fixtures:
    """The conftest fixtures a refusal's call needs, each made when first read (``fx.tiny_model``)."""

    def __init__(self, request):
        self._request = request

    def __getattr__(self, name):
        return self._request.getfixturevalue(name)


def _rollout(**changes):
    from primitives.types import Rollout

    fields = dict(uid="e0/i0/s0", group="e0/i0", prompt="2+2=", prompt_ids=np.arange(4),
                  completion_ids=np.array([5, 6, 7]), loss_mask=np.ones(3, np.float32),
                  logprobs=np.array([-0.1, -0.2, -0.3], np.float32), finish_reason="stop", text="4. yes", reward=1.0)
    return Rollout(**{**fields, **changes})


def _model(fx):
    """A copy of the tiny model that refuses to run: a refusal "before the first step" must come before any
    generation or update (a forward pass raises, and its message is not the page's)."""
    model = copy.deepcopy(fx.tiny_model)

    def no_forward(module, args):
        raise AssertionError("the tiny model ran a forward pass before the refusal (generated or trained)")

    model.register_forward_pre_hook(no_forward)
    return model


def _seed_train(fx, **changes):
    """The seeds' headline ``train(...)`` (seeds/002 Example 1's shape) on the tiny model, GRPO with two
    completions per prompt; ``changes`` are the row's own arguments."""
    kwargs = dict(initial_state=rp.TrainingState(model=_model(fx), tokenizer=fx.tokenizer),
                  prompt_loader=lambda iteration: ["What is 2+2?", "What color is the sky?"], num_iterations=1,
                  gen_config=rp.GenerationConfig(max_new_tokens=4, temperature=0.7, do_sample=True,
                                                 num_return_sequences=2),
                  algorithm_config=rp.create_algorithm_config("grpo", {"kl_coef": 0.1}),
                  reward_fn=lambda rollout: float(len(rollout.generation.text)))
    return rp.train(**{**kwargs, **changes})


def _truncated_kl(logprobs, ref_logprobs, threshold=1.0):  # seeds/002 Example 5's, on float lists (README 2)
    kl = 0.0
    for lp, ref_lp in zip(logprobs, ref_logprobs):
        kl += min(math.exp(lp) * (lp - ref_lp), threshold)
    return kl


_truncated_kl.__name__ = _truncated_kl.__qualname__ = "truncated_kl"


def _select_pairs(batch):  # the seeds' pair_selector(batch): pairs across the whole batch
    ranked = sorted(batch.rollouts, key=lambda r: r.reward)
    return [(ranked[-1], ranked[0])]


class _AdaptiveAlgorithmConfig:
    """seeds/002 Example 6's shape: ``get_config()`` reads state the object keeps between calls."""

    def __init__(self):
        self.reward_history = []

    def get_config(self):
        late = len(self.reward_history) > 10
        return rp.create_algorithm_config("grpo", {"kl_coef": 0.05 if late else 0.1})


def _ema_update(ref_model, policy_model, decay):  # the seeds' model-to-model update
    return ref_model


def _loop_train_with_a_loader(fx):
    """Our loop's ``train`` given the seeds' ``prompt_loader(iteration)`` where a prompt source goes."""
    from cluster.local import LocalBackend
    from cluster.loop.train import RLRun, train
    from primitives.maths.algorithms import constant_schedule, grpo

    def load_prompts(iteration):
        return ["What is 2+2?", "What color is the sky?"]

    backend = LocalBackend(fx.tiny_model_path, lambda rollout: 1.0, seed=0)
    run = RLRun(rp.GenerationConfig(max_new_tokens=4, n=2), num_steps=1, prompts_per_step=2,
                lr_schedule=lambda it: 1e-3, progress=False)
    return train(backend, load_prompts, constant_schedule(grpo(kl_coef=0.0)), run)


class _LLMBuiltWith:
    """What ``vllm_generator`` reads of a vLLM ``LLM`` before sampling (``model_config.logprobs_mode``);
    sampling raises, so only a refusal before it passes."""

    def __init__(self, logprobs_mode: str):
        self.model_config = type("ModelConfig", (), {"logprobs_mode": logprobs_mode})()

    def generate(self, *args, **kwargs):
        raise AssertionError("vllm_generator sampled before refusing")


def _plan_backend(fx):
    model = copy.deepcopy(fx.tiny_model)
    return rp.PyTorchTrainingBackend(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                     loss_fn=rp.grpo_loss)


def _plan_batch(fx) -> dict:
    ids = np.array([fx.tokenizer.encode("12+34=46"), fx.tokenizer.encode("5+6=11..")])
    mask = np.ones(ids.shape, np.float32)
    mask[:, :5] = 0  # the prompt
    return {"input_ids": ids, "labels": ids.copy(), "loss_mask": mask, "advantages": np.array([1.0, -1.0], np.float32)}


def _reward_model_and_policy_tokenizer(fx):
    """A sequence-classification reward model whose own tokenizer has a token the policy's lacks, loaded
    as the seeds load it; the seeds then pass the policy's tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    from primitives.types import ModelConfig

    path = str(fx.tmp_path / "rm")
    fx.tokenizer.save_pretrained(path)
    own = AutoTokenizer.from_pretrained(path)
    own.add_tokens(["<extra>"])
    own.save_pretrained(path)
    cfg = Qwen2Config(vocab_size=len(own), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=own.pad_token_id)
    Qwen2ForSequenceClassification(cfg).save_pretrained(path)
    return rp.load_reward_model(ModelConfig(path)), fx.tokenizer


# each refused row's call, as the row gives it; each must raise the page's message
REFUSALS = {
    "rollout.kl_divergence": lambda fx: _rollout().kl_divergence,
    "rollout._replace(rewards=[...])": lambda fx: _rollout()._replace(reward_metadata={"length": 6}),
    "Rollout(prompt=, conversation=, generation=, rewards=, kl_divergence=, ...)": lambda fx: rp.Rollout(
        prompt="What color is the sky?", conversation=rp.Conversation(messages=[]), generation=_rollout().generation,
        rewards=0.0, kl_divergence=0.1),
    "GenerationConfig(custom_params={...})": lambda fx: rp.GenerationConfig(custom_params={"repetition_penalty": 1.1}),
    "quick_start_training(model_name=, prompts=, reward_fn=, num_iterations=)": lambda fx: rp.quick_start_training(
        model_name="meta-llama/Llama-3-8B", prompts=["Explain quantum computing", "What is ML?"],
        reward_fn=lambda rollout: len(rollout.generation.text) / 100, num_iterations=100),
    "log_to_wandb(state, stats, project, entity)": lambda fx: _seed_train(fx, logger=rp.log_to_wandb),
    "save_checkpoint(state, checkpoint_dir)": lambda fx: _seed_train(fx, checkpoint_fn=rp.save_checkpoint),
    "GenerationConfig()": lambda fx: _seed_train(  # the seeds' default: one completion per prompt
        fx, gen_config=rp.GenerationConfig(max_new_tokens=4, temperature=0.7, top_p=0.9, do_sample=True)),
    'create_algorithm_config("dapo", {"beta": ..., "pair_selector": ...})': lambda fx: rp.create_algorithm_config(
        "dapo", {"beta": 0.1, "pair_selector": _select_pairs}),
    "pair_selector(batch)": lambda fx: rp.create_algorithm_config(
        "online_dpo", {"beta": 0.1, "pair_selector": _select_pairs}),
    "get_config()": lambda fx: _seed_train(fx, algorithm_config=_AdaptiveAlgorithmConfig().get_config),
    "ref_model_update_fn=lambda ref, policy: ema_update(ref, policy, 0.995)": lambda fx: _seed_train(
        fx, ref_model_update_fn=lambda ref, policy: _ema_update(ref, policy, 0.995)),
    "compute_kl(logprobs, ref_logprobs, kl_fn=)": lambda fx: rp.compute_kl([-1.0, -2.0], [-1.5, -1.0],
                                                                           kl_fn=_truncated_kl),
    "create_ema_model(m, decay)": lambda fx: rp.create_ema_model(torch.nn.Linear(1, 1), 0.999),
    "get_algorithm_for_iteration(iteration)": lambda fx: rp.get_algorithm_for_iteration(7),
    "prompt_loader(iteration) -> prompts": lambda fx: _loop_train_with_a_loader(fx),
    "truncated_kl(logprobs, ref_logprobs)": lambda fx: _seed_train(
        fx, algorithm_config=rp.create_algorithm_config("grpo", {"kl_coef": 0.1, "kl_fn": _truncated_kl})),
    "vllm_generator(model, tokenizer, prompt, config)": lambda fx: rp.create_rollout(
        _LLMBuiltWith("raw_logprobs"), fx.tokenizer, "12+34=", rp.GenerationConfig(temperature=0.7),
        generator=rp.vllm_generator),
    "get_reference_logprobs(ref_model, tokenizer, prompt, token_ids)": lambda fx: rp.get_reference_logprobs(
        _model(fx), fx.tokenizer, "What color is the sky?", [5, 6, 7]),
    "compute_grpo_loss(batch, advantages, kl_coef=)": lambda fx: rp.compute_grpo_loss(
        rp.Batch(rollouts=(_rollout(),)), [0.0], kl_coef=0.1),
    "aggregate_vector_rewards(vector, aggregator=)": lambda fx: rp.aggregate_vector_rewards(
        [1.0, 0.5], aggregator=rp.weighted_sum_aggregator),
    "safety_check_reward()": lambda fx: rp.safety_check_reward(),
    "load_reward_model(config, loader=)": lambda fx: rp.create_rm_reward_fn(*_reward_model_and_policy_tokenizer(fx)),
    'fwd_metrics["grad_norm"]': lambda fx: _plan_backend(fx).forward_backward(_plan_batch(fx)).result()["grad_norm"],
    "backend.optim_step()": lambda fx: _plan_backend(fx).optim_step(),
    "tokenize_conversation(conv, tokenizer)": lambda fx: rp.load_sft_samples("dataset.jsonl"),  # as the plan calls it
    "compute_advantages(rollouts, normalize=)": lambda fx: rp.compute_advantages(
        [_rollout(), _rollout(uid="e0/i0/s1", reward=0.0)], normalize=True),
}
# refused rows whose call cannot run here (Ray, a long run), each for its reason; keep it empty where possible
NOT_CALLED: dict = {}


def _squeeze(text: str) -> str:
    return " ".join(text.split())


def test_the_page_quotes_refusals_to_check():
    quotes = refusal_quotes()
    assert len(quotes) >= 20, quotes
    keys = [key for key, _ in quotes]
    assert len(set(keys)) == len(keys), f"two refusal quotes in one row: {sorted(k for k in keys if keys.count(k) > 1)}"


@pytest.mark.parametrize("key, quote", refusal_quotes(), ids=[key for key, _ in refusal_quotes()])
def test_each_refusal_the_page_quotes_is_the_codes_message(key, quote, request):
    if key in NOT_CALLED:
        pytest.skip(f"not called here: {NOT_CALLED[key]}")
    assert key in REFUSALS, f"docs/seeds.md quotes a refusal of {key!r}, and REFUSALS has no call for that row"
    try:
        REFUSALS[key](Fixtures(request))
    except Exception as e:  # any exception: its message is checked below
        raised = e
    else:
        raise AssertionError(f"docs/seeds.md says {key!r} is refused with `{quote}`; the call raised nothing")
    message, expected = _squeeze(str(raised)), quote
    if isinstance(raised, KeyError) and raised.args:  # str() of a KeyError is its repr
        message = _squeeze(str(raised.args[0]))
    prefix = EXCEPTION_PREFIX.match(quote)
    if prefix:
        assert type(raised).__name__ == prefix.group(1), \
            f"docs/seeds.md says {key!r} raises {prefix.group(1)}; it raised {type(raised).__name__}: {raised}"
        expected = quote[prefix.end():]
    at = 0
    for fragment in (_squeeze(f) for f in expected.split("...")):
        found = message.find(fragment, at) if fragment else at
        assert found >= 0, (f"docs/seeds.md quotes the refusal of {key!r} as\n  `{quote}`\nbut the code says\n  "
                            f"{type(raised).__name__}: {message}\n(missing, in order: {fragment!r})")
        at = found + len(fragment)


def test_every_refusal_call_is_of_a_row_the_page_quotes():
    quoted = {key for key, _ in refusal_quotes()}
    assert not set(REFUSALS) - quoted, f"REFUSALS has calls for rows the page does not quote: {set(REFUSALS) - quoted}"
    assert not set(NOT_CALLED) - quoted, f"NOT_CALLED names rows the page does not quote: {set(NOT_CALLED) - quoted}"
    assert not set(REFUSALS) & set(NOT_CALLED), set(REFUSALS) & set(NOT_CALLED)
