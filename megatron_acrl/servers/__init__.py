"""The rollout servers as the driver sees them: the handle (SGLang processes, generation dispatch,
weight updates), its recovery (restart, hung-server replacement, reconnect), the weight publisher
(lag buffer, retries, the stop rule) and what a trainer rank sends (FP8 scheme, casts, sources)."""
