"""The RL algorithms: the policy losses (PPO clip, dual clip, KL, entropy, aggregation) and the
advantage estimators (GRPO, Dr. GRPO, DAPO's filters and shaping, GAE).
Pure torch: no Megatron, no torch.distributed. The algorithm table (each ``algorithm.name``'s
estimator, critic and values) is ``megatron_acrl.config.algorithm.ALGORITHMS``: the config loader
applies it, and config sits below algo."""
