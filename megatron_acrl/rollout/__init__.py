"""Where the loop's batches come from: the producer (sync or async), the async generation engine and
its group queue, the sync rollout phase, and evaluation's generation."""
