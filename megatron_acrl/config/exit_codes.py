"""Exit codes of the launch layer and of the trainer, and how the job script explains them.

Contract with the trainer (``python -m megatron_acrl.train``), one process per rank:

* ``0`` -- training finished, **or** the rank received SIGTERM, the run wrote a checkpoint in
  ``training.checkpoint_dir`` and stopped. The job script knows which: it forwarded the SIGTERM
  itself, and then requeues the job, whose next run resumes (``training.resume=true``). A resumed
  run whose checkpoint already holds ``training.num_steps`` steps must exit 0 at once. Exiting 0
  (not a "preempted" code) keeps ``srun --kill-on-bad-exit=1`` from killing the other ranks while
  they are still writing their part of the checkpoint.
* ``2`` -- bad config or arguments (:class:`megatron_acrl.config.ConfigError`), nothing started.
* ``69`` -- rollout servers unavailable (:func:`sglang_bridge.server.wait_for_servers` timed out).
* ``128 + N`` -- a second SIGTERM / SIGINT (signal N) stopped the rank at once, without a checkpoint
  of the step (the shell's code for a process ended by that signal, so it reads the same as one).
* anything else -- a failure; the job ends FAILED with that code and the log says which rank.
"""

from __future__ import annotations

import signal

OK = 0
"""Finished, or checkpointed after SIGTERM (the job script tells the two apart)."""

CONFIG_ERROR = 2
"""Invalid config, arguments or submit-time check (nothing was started or queued)."""

SERVERS_UNAVAILABLE = 69
"""A rollout server did not come up in time (sysexits EX_UNAVAILABLE)."""

LAUNCH_ERROR = 70
"""The job script itself could not set the job up (node list, requeue; sysexits EX_SOFTWARE)."""

REQUEUE_LIMIT = 75
"""Checkpointed after SIGTERM but the job was already requeued --max-requeues times (EX_TEMPFAIL):
resubmit the same command to continue from the checkpoint."""

_MEANING = {
    OK: "success",
    1: "the process raised an exception (traceback above in the log)",
    CONFIG_ERROR: "bad config or arguments",
    SERVERS_UNAVAILABLE: "a rollout server did not come up",
    LAUNCH_ERROR: "the job script could not set up the job",
    REQUEUE_LIMIT: "checkpointed but the requeue limit is reached; resubmit to continue",
    127: "command not found (wrong --python or module not installed on the node)",
}


def describe(rc: int) -> str:
    """Human meaning of an exit code (shell convention: 128+N means killed by signal N)."""
    if rc in _MEANING:
        return _MEANING[rc]
    if rc > 128:
        try:
            name = signal.Signals(rc - 128).name
        except ValueError:
            return f"killed by signal {rc - 128}"
        extra = {
            "SIGKILL": " (out of memory, or SLURM killed it: time limit, or another rank failed)",
            "SIGTERM": " (stopped before it could checkpoint, or by SLURM after another rank failed)",
            "SIGSEGV": " (crash in native code)",
            "SIGABRT": " (abort in native code, e.g. a failed NCCL/CUDA check)",
        }.get(name, "")
        return f"killed by {name}{extra}"
    return "failed"


def bash_describe_function() -> str:
    """A bash function ``describe_rc RC`` with the same table, for the job script."""
    lines = ["describe_rc() {", '  case "$1" in']
    for rc, text in sorted(_MEANING.items()):
        lines.append(f"    {rc}) echo {_sh(text)} ;;")
    for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV, signal.SIGABRT, signal.SIGINT, signal.SIGBUS):
        lines.append(f"    {128 + sig.value}) echo {_sh(describe(128 + sig.value))} ;;")
    lines += ["    *) echo failed ;;", "  esac", "}"]
    return "\n".join(lines)


def _sh(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"
