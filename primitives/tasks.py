"""The embedded synthetic task: two-number addition with a verifiable answer (DESIGN section 9).

Prompts look like ``"23+48="`` and the answer is the decimal sum. Operands are zero-padded
to a fixed width (``"07+40="``) so each digit sits at the same position in every prompt,
which a tiny model learns far more reliably. The SFT demonstrations
are deliberately imperfect: in a stated share of the problems that need a carry, the
demonstration drops the carry (``23+48=61``). A model that imitates them learns the
error as its most likely answer on carry problems, while still sampling the right answer
sometimes - exactly the situation in which RL with a verifiable reward helps.
"""
from __future__ import annotations

import random
from typing import NamedTuple, Optional

from primitives.data import PromptItem
from primitives.rewards import exact_match_reward, parse_first_number, parse_last_number
from primitives.types import Conversation, Message

_EXACT_SUM = exact_match_reward(parse_first_number)
_LAST_NUMBER_SUM = exact_match_reward(parse_last_number)
CHAT_QUESTION = "What is {a}+{b}? Reply with the number only."


class ArithmeticTaskSpec(NamedTuple):
    max_operand: int = 49  # operands are drawn from [0, max_operand]
    num_train: int = 2000  # distinct training problems (SFT demos and RL prompts)
    num_heldout: int = 256  # distinct held-out problems, disjoint from training
    carry_error_rate: float = 0.7  # share of carry problems whose demonstration drops the carry
    seed: int = 0


def needs_carry(a: int, b: int) -> bool:
    return (a % 10) + (b % 10) >= 10


def make_arithmetic_task(spec: ArithmeticTaskSpec = ArithmeticTaskSpec()):
    """Seeded, disjoint (train, heldout) lists of ``PromptItem`` with ``answer`` set."""
    n = spec.max_operand + 1
    if spec.num_train + spec.num_heldout > n * n:
        raise ValueError(
            f"ArithmeticTaskSpec asks for {spec.num_train}+{spec.num_heldout} distinct problems "
            f"but max_operand={spec.max_operand} allows only {n * n}"
        )
    pairs = [(a, b) for a in range(n) for b in range(n)]
    random.Random(spec.seed).shuffle(pairs)
    chosen = pairs[: spec.num_train + spec.num_heldout]
    width = len(str(spec.max_operand))
    items = [
        PromptItem(index=i, prompt=f"{a:0{width}d}+{b:0{width}d}=", answer=str(a + b), metadata={"a": a, "b": b})
        for i, (a, b) in enumerate(chosen)
    ]
    train = items[: spec.num_train]
    heldout = [it._replace(index=i) for i, it in enumerate(items[spec.num_train:])]
    return train, heldout


def demonstration(item: PromptItem, drop_carry: bool) -> str:
    """The completion a demonstrator writes; ``drop_carry`` forgets the carry into the tens."""
    a, b = item.metadata["a"], item.metadata["b"]
    total = a + b - (10 if drop_carry and needs_carry(a, b) else 0)
    return str(total)


def sft_demonstrations(items, spec: ArithmeticTaskSpec, seed: Optional[int] = None):
    """``(prompt, completion)`` pairs; carry problems are wrong with probability carry_error_rate.

    Returns ``(pairs, wrong_share)`` where ``wrong_share`` is the realised share of wrong demos.
    """
    rng = random.Random(spec.seed if seed is None else seed)
    pairs, wrong = [], 0
    for item in items:
        drop = needs_carry(item.metadata["a"], item.metadata["b"]) and rng.random() < spec.carry_error_rate
        wrong += drop
        pairs.append((item.prompt, demonstration(item, drop)))
    return pairs, wrong / max(len(items), 1)


def arithmetic_reward(rollout) -> float:
    """1.0 when the first number of the completion equals the sum, else 0.0."""
    return _EXACT_SUM(rollout)



def chat_arithmetic_items(items) -> list:
    """The same problems as chat prompts for an instruct model: one user message, operands
    unpadded, the answer unchanged (the chat template is applied at generation)."""
    return [it._replace(prompt=Conversation((Message("user", CHAT_QUESTION.format(**it.metadata)),)))
            for it in items]


def chat_demonstration(item: PromptItem) -> list:
    """A correct chat demonstration of ``item`` as messages (for ``prepare_sft_chat``)."""
    return [{"role": "user", "content": CHAT_QUESTION.format(**item.metadata)},
            {"role": "assistant", "content": str(item.answer)}]


def chat_arithmetic_reward(rollout) -> float:
    """1.0 when the last number of the completion equals the sum, else 0.0."""
    return _LAST_NUMBER_SUM(rollout)



# ----------------------------------------------------------------------------- tasks a job names

class TaskData(NamedTuple):
    """What a generated task gives a job (``data.task`` in the config)."""

    train: list  # PromptItems for RL
    eval: list  # held-out PromptItems
    sft_rows: list = []  # demonstrations as records: {"prompt", "completion"}, or {"messages"} when sft_chat
    sft_chat: bool = False  # the demonstrations are chat messages (rendered with the chat template)
    info: Optional[dict] = None  # facts for the run summary (e.g. the share of wrong demonstrations)


def arithmetic_task(seed: int = 0, max_operand: int = 49, num_train: int = 2000, num_heldout: int = 256,
                    carry_error_rate: float = 0.7) -> TaskData:
    """The default job's task: raw-text ``"23+48="`` prompts and imperfect demonstrations."""
    spec = ArithmeticTaskSpec(max_operand, num_train, num_heldout, carry_error_rate, seed)
    train, heldout = make_arithmetic_task(spec)
    pairs, wrong_share = sft_demonstrations(train, spec)
    return TaskData(train, heldout, [{"prompt": p, "completion": c} for p, c in pairs],
                    info={"sft_wrong_share": round(wrong_share, 4)})


def chat_arithmetic_task(seed: int = 0, max_operand: int = 99, num_train: int = 2000,
                         num_heldout: int = 64) -> TaskData:
    """The same sums as chat questions for an instruct model, with correct chat demonstrations."""
    train, heldout = make_arithmetic_task(ArithmeticTaskSpec(max_operand, num_train, num_heldout, 0.0, seed))
    return TaskData(chat_arithmetic_items(train), chat_arithmetic_items(heldout),
                    [{"messages": chat_demonstration(it)} for it in train], sft_chat=True)


TASKS = {"arithmetic": arithmetic_task, "chat_arithmetic": chat_arithmetic_task}
