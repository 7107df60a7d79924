"""Stateless primitives for RL post-training, imported by sub-package:

* ``types`` (the records), ``hooks`` (checking and calling user functions);
* ``maths`` - advantages, KL, losses, objectives, algorithms, filters, batching, metrics;
* ``model`` - prompts, padding, generation, logprobs, packing, training, value model, rollouts;
* ``io`` - data files, checkpoints, loggers, evaluation samples;
* ``env`` - rewards, tools, sandbox;
* ``fixtures`` - the tiny model, the arithmetic tasks, the embedded SmolLM2.

Imports torch, numpy and transformers only - never Ray - so every function is testable in
one process on CPU (``from primitives.maths.losses import ...``).
"""
