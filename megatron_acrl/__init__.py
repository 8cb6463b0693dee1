"""megatron-acrl: RL post-training with a Megatron-Core trainer, SGLang rollouts and ACRL correction."""

__version__ = "0.1.0"
