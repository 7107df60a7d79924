"""Stateless primitives for RL post-training: records, generation, logprobs, rewards, KL,
advantages, losses, filters, tools, algorithms, data, logging, checkpoints.

Imports torch, numpy and transformers only - never Ray - so every function is testable in
one process on CPU. Import the submodules directly (``from primitives.losses import ...``).
"""
