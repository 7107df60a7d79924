"""The maths of RL post-training, on tensors and records: advantages, KL estimators, losses and
the objectives composed from them, algorithm presets, rollout filters, the batch a step
trains on, metrics. No model, no files."""
