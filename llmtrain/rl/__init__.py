"""Online reinforcement learning (recipes/grpo.py): method.py (the grpo method) and config.py
(its config tree); prompts.py (prompt rows), sampling.py (seeded generation behind the
Generator interface), rewards.py (reward functions), advantages.py (the advantage
estimators), loss.py (the GRPO objective and its loss types), rollout.py (the generation
rounds that feed the shared training loop)."""
