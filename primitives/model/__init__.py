"""What runs a causal LM: prompt rendering, padding, sampling with behaviour logprobs,
logprob scoring (packed or padded), the training step's forward/backward, the value model."""
