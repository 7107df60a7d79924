"""The HF engine: generation with an HF model in this process (``primitives.model.generation``,
its own forward with a KV cache), on a generator worker or on a trainer rank's own module; and the
sampling generator of a call, which every engine and the local backend derive alike."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Sequence, Union

import torch

from primitives.env.tools import hf_turns_generator
from primitives.model.generation import generate_rollouts
from primitives.types import GenerationConfig, ModelConfig
from rl_actors.common import load_causal_lm
from rl_actors.weight_sync import TensorMeta, copy_into_model


def rollout_sampler(seed: int, rank: int, version: int, items: Sequence,
                    device: Union[str, torch.device] = "cpu") -> torch.Generator:
    """The sampling generator of one ``generate`` call, seeded by (seed, generator rank, policy
    version, first prompt): the same call after a resume, on a replacement actor, or on the
    local backend samples the same tokens.

    It lives on ``device``, the device of the model it samples for: torch's random draws
    refuse a generator on another device than its probabilities ("Expected a 'cuda' device
    type for generator"). The same key gives the same stream on the same kind of device (a
    CUDA generator draws other numbers than a CPU one seeded alike)."""
    return torch.Generator(device=device).manual_seed(sampler_key(seed, rank, version, items))


def sampler_key(seed: int, rank: int, version: int, items: Sequence) -> int:
    """The integer that seeds one ``generate`` call (``rollout_sampler``; vLLM's request seeds)."""
    import zlib

    key = f"{seed}/{rank}/{version}/{items[0].epoch}/{items[0].index}" if items else "-"
    return zlib.crc32(key.encode())



class HFEngine:
    """Generation with an HF model in this process: its own (``load``), or the module a trainer
    rank trains (``cluster.generate_on_trainers``), put in eval mode while it generates."""

    name = "hf"

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    @property
    def device(self) -> torch.device:
        """Where the model's weights are now (a trainer rank's module may move after this engine is built)."""
        return next(self.model.parameters()).device

    @classmethod
    def load(cls, config: ModelConfig, role: str) -> "HFEngine":
        """The model at ``config``; with ``config.lora`` wrapped in the same adapters as the trainer's
        policy, so that a weight sync sends only the adapters (``primitives.model.lora``)."""
        model, tokenizer = load_causal_lm(config, role)
        if config.lora.enabled:
            from primitives.model.lora import with_lora

            model = with_lora(model, config.lora)
        return cls(model.eval(), tokenizer)

    @contextmanager
    def serving(self):
        """Eval mode (no dropout) while generating; the mode it had afterwards."""
        training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(training)

    def sampler(self, seed: int, rank: int, version: int, items: Sequence) -> torch.Generator:
        """The call's sampling generator (``rollout_sampler``), on the model's device."""
        return rollout_sampler(seed, rank, version, items, device=self.device)

    def generate(self, items, gen: GenerationConfig, version: int, generator) -> list:
        return generate_rollouts(self.model, self.tokenizer, items, gen, version, generator)

    def turns_generator(self, gen: GenerationConfig, generator) -> Callable:
        return hf_turns_generator(self.model, self.tokenizer, gen, generator)

    def named_parameters(self):
        return self.model.named_parameters()

    def begin_update(self, meta: Sequence[TensorMeta]) -> None:
        pass

    def receive(self, metas, tensors) -> None:
        copy_into_model(self.model, metas, tensors)

    def end_update(self) -> None:
        pass
