"""Online reinforcement learning (recipes/grpo.py): prompts, sampling, rewards, the GRPO
loss and the rollouts that feed the shared training loop."""
