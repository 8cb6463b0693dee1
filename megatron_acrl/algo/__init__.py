"""The RL algorithms: the policy losses (PPO clip, dual clip, KL, entropy, aggregation) and the
advantage estimators (GRPO, Dr. GRPO, DAPO's filters and shaping, GAE).
Pure torch: no Megatron, no torch.distributed."""
