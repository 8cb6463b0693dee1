"""What a step trains on: the rollout batch (built, recorded, replayed, cut into minibatches), the
micro-batch plans (fixed or by token budget) and the per-token weight versions with their staleness
metrics. Pure torch."""
