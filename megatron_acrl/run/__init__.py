"""One run's set-up and lifetime: the run context (everything a run holds), the pre-flight checks,
and checkpoints and resume."""
