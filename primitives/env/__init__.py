"""What scores and answers a model: reward functions and specs, tool calls and multi-turn
rollouts, the sandbox model-written code runs in."""
