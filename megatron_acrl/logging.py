"""Run monitoring: Weights & Biases (offline in tests and CI), a metrics JSONL file, and the console.

Only the driver's rank 0 logs. Every step's metrics go to all sinks; W&B additionally gets
histograms (per-token log-ratio) and sample tables. ``metrics.jsonl`` in the run directory is the
plain-text twin of the W&B history that the study's plots and people without W&B read.

Offline W&B runs are read back with :func:`read_wandb_history` (the ``.wandb`` file is a
LevelDB-log framed stream of ``wandb.proto`` records), which is what the tests assert on.

Every step exactly once. A run resumed from the checkpoint of step S (after a crash past it, or a
fresh start at S = 0) logs steps S+1 on again, so the logger first *supersedes* what the earlier
attempt logged after S: ``metrics.jsonl`` is rewritten atomically with the rows of steps 0..S (one
per step, the last one logged, which is the checkpoint's own lineage; at S = 0 none: a fresh start
logs its step 0 again), and every row it drops is appended first to ``metrics.superseded.jsonl``
beside it, tagged with ``superseded_at_resume`` = S: nothing is lost. W&B keeps one offline run
file per attempt (same run id); :func:`read_wandb_history` reads them in order, each attempt
superseding the rows from its first step on; a resumed attempt first logs again, from
``metrics.jsonl``, the kept rows W&B never wrote (an attempt whose service was killed, see
``RunLogger._backfill_wandb``). Online, W&B itself drops a row whose step is below the
run's current step, so after such a resume its steps S+1..(the crash) keep the crashed attempt's
values (each step once, but not the checkpoint's lineage); ``metrics.jsonl`` is the exact record.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_acrl.config import LoggingConfig

# Keys shown on the console line, in this order, when present.
CONSOLE_KEYS = (
    ("reward/mean", "reward"),
    ("eval/accuracy", "eval_acc"),
    ("eval/exact_j", "J"),
    ("eval/exact_j_served", "J_served"),
    ("mismatch/k3_kl", "k3"),
    ("mismatch/log_ppl_abs_diff", "lppl"),
    ("acrl/y_over_x", "Y/X"),
    ("loss/entropy", "ent"),
    ("time/step", "s/step"),
)


def _clean(value: Any) -> Any:
    """JSON-safe scalar: nan/inf become strings so the JSONL stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class RunLogger:
    """Logs metrics to W&B, ``<run_dir>/metrics.jsonl`` and the console.

    Args:
        cfg: logging settings.
        run_dir: directory of this run (metrics.jsonl lives here; W&B files under cfg.wandb_dir).
        config: the resolved run config (plain dict), stored with the W&B run.
        resume_id: W&B run id to continue after a restart (from the checkpoint), or None.
        enabled: False on every rank but the driver's.
        resume_step: the step this run continues from (0: a fresh start); the rows an earlier
            attempt logged after it are superseded (see module doc).
    """

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: str | Path,
        config: dict | None = None,
        resume_id: str | None = None,
        enabled: bool = True,
        resume_step: int = 0,
    ):
        self.cfg = cfg
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._wandb = None
        self.run_id: str | None = resume_id
        self._t0 = time.time()
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.superseded = supersede_rows_after(self.run_dir / "metrics.jsonl", resume_step)
        if self.superseded:
            print(
                f"metrics.jsonl: {self.superseded} row(s) logged after step {resume_step} by an earlier "
                f"attempt moved to {SUPERSEDED}; this run logs those steps again",
                file=sys.stderr,
                flush=True,
            )
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
        self.backfilled: list[int] = []
        if cfg.wandb_mode != "disabled":
            import wandb

            wandb_dir = Path(cfg.wandb_dir)
            if not wandb_dir.is_absolute():
                wandb_dir = self.run_dir / wandb_dir
            wandb_dir.mkdir(parents=True, exist_ok=True)
            # Read before this attempt's own (same-named, empty) run file exists.
            offline_steps = None
            if resume_id is not None and cfg.wandb_mode == "offline":
                offline_steps = wandb_steps(wandb_dir, resume_id)
            self._wandb = wandb.init(
                project=cfg.wandb_project,
                name=cfg.run_name,
                dir=str(wandb_dir),
                mode=cfg.wandb_mode,
                config=config or {},
                id=resume_id,
                resume="allow" if resume_id else None,
                settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
            )
            self.run_id = self._wandb.id
            self.wandb_dir = wandb_dir
            if resume_id and resume_step > 0:
                have = offline_steps if offline_steps is not None else set(range(self._wandb.step))
                self._backfill_wandb(have)

    def _backfill_wandb(self, have: set[int]) -> None:
        """Give W&B the kept rows (steps 0..S of ``metrics.jsonl``) that an earlier attempt logged
        but W&B never wrote (SLURM's signal killed W&B's service with the step: that attempt's
        unwritten rows are lost to W&B). From the first such step on, every kept row is logged again
        (scalars only; an attempt supersedes from its first step, see module doc), so W&B too
        holds each step once with the values of ``metrics.jsonl``."""
        rows = read_jsonl_metrics(self.run_dir / "metrics.jsonl")
        missing = [int(r["step"]) for r in rows if int(r["step"]) not in have]
        if not missing:
            return
        first = min(missing)
        for row in rows:
            if int(row["step"]) >= first and self._wandb is not None:
                metrics = {k: float(v) for k, v in row.items() if k != "step"}
                try:
                    self._wandb.log(_wandb_data(metrics, None, None), step=int(row["step"]))
                except Exception as e:  # noqa: BLE001 - as in log(): the service died
                    self._wandb_lost(e, f"backfilling step {row['step']}")
                    return
                self.backfilled.append(int(row["step"]))
        print(
            f"W&B: {len(missing)} step(s) of an earlier attempt were missing from the W&B run; logged "
            f"steps {first}..{self.backfilled[-1]} again from metrics.jsonl",
            file=sys.stderr,
            flush=True,
        )

    def log(
        self,
        step: int,
        metrics: dict[str, float],
        *,
        histograms: dict[str, Any] | None = None,
        table: tuple[list[str], list[list[Any]]] | None = None,
    ) -> None:
        """Log one step.

        Args:
            step: RL step (x axis everywhere).
            metrics: scalar metrics.
            histograms: name -> 1-D array-like of samples (e.g. per-token log-ratio).
            table: (columns, rows) of sample completions.
        """
        if not self.enabled:
            return
        row = {"step": step, **{k: _clean(float(v)) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._wandb is not None:
            try:
                self._wandb.log(_wandb_data(metrics, histograms, table), step=step)
            except Exception as e:  # noqa: BLE001 - W&B's service died; the run and metrics.jsonl go on
                self._wandb_lost(e, f"at step {step}")
        if self.cfg.console and step % self.cfg.log_interval == 0:
            parts = [f"step {step:>5d}"]
            for key, short in CONSOLE_KEYS:
                if key in metrics:
                    parts.append(f"{short} {metrics[key]:.4g}")
            print(" | ".join(parts), file=sys.stderr, flush=True)

    def _wandb_lost(self, err: Exception, where: str) -> None:
        """W&B's service process (``wandb-core``, a child of this rank) is gone: a scheduler that
        signals every process of the job step (SLURM preemption, ``scancel``) ends it with the
        rank's SIGTERM, and it cannot be told to ignore it (a Go binary). The run must still finish
        its step and checkpoint: log a warning once and go on without W&B for this attempt (rows
        it had not written are lost to W&B; ``metrics.jsonl`` keeps every step; a resume continues
        the W&B run)."""
        print(
            f"W&B stopped working {where} ({type(err).__name__}: {err}); this attempt logs "
            f"the rest to {self.run_dir / 'metrics.jsonl'} only",
            file=sys.stderr,
            flush=True,
        )
        self._wandb = None
        # Forget the dead service process-wide. Its run's telemetry hooks fire on every later import
        # of a module W&B watches (torch.distributed.checkpoint, at the step's save), each raising
        # the lost connection (teardown drops them first, then fails to reach the service); and
        # WANDB_SERVICE, inherited by every child this process starts, names its dead socket.
        import wandb
        from wandb.sdk.lib.service import service_token

        with contextlib.suppress(Exception):
            wandb.teardown()
        service_token.clear_service_in_env()

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        if self._wandb is not None:
            # This attempt's own run directory: a resumed run's earlier attempts hold files of the
            # same name, already finished, which a wait over the whole W&B dir would accept.
            attempt_dir = Path(self._wandb.settings.sync_file).parent
            try:
                self._wandb.finish()
            except Exception as e:  # noqa: BLE001 - as in log(): the service died
                self._wandb_lost(e, "at the end of the run")
                return
            self._wandb = None
            # wandb.finish() can return before the offline writer has flushed the run file; wait
            # for its closing record so whoever reads the run next sees every step.
            wait_for_wandb_exit(attempt_dir, self.run_id)


def _wandb_data(
    metrics: dict[str, float],
    histograms: dict[str, Any] | None,
    table: tuple[list[str], list[list[Any]]] | None,
) -> dict[str, Any]:
    """One step's W&B payload: the scalars, histograms of the finite samples, the sample table."""
    import numpy as np
    import wandb

    data: dict[str, Any] = dict(metrics)
    for name, values in (histograms or {}).items():
        arr = np.asarray(values, dtype=np.float64).ravel()
        arr = arr[np.isfinite(arr)]
        if arr.size:
            data[name] = wandb.Histogram(arr, num_bins=64)
    if table is not None:
        data["samples"] = wandb.Table(columns=table[0], data=table[1])
    return data


def wait_for_wandb_exit(wandb_dir: str | Path, run_id: str | None, timeout_s: float = 60.0) -> bool:
    """Poll until the offline run file of ``run_id`` holds its ``exit`` record; False on timeout."""
    deadline = time.time() + timeout_s
    pattern = f"run-{run_id}.wandb" if run_id else "run-*.wandb"
    while time.time() < deadline:
        for path in Path(wandb_dir).rglob(pattern):
            try:
                if any(r.WhichOneof("record_type") == "exit" for r in _iter_wandb_records(path)):
                    return True
            except Exception:  # noqa: BLE001 - a half-written file; try again
                pass
        time.sleep(0.2)
    return False


SUPERSEDED = "metrics.superseded.jsonl"
"""Beside ``metrics.jsonl``: the rows a resume superseded (see module doc)."""


def _fsync_write(path: Path, text: str, mode: str) -> None:
    with open(path, mode) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def supersede_rows_after(path: Path, step: int) -> int:
    """Make ``path`` (a ``metrics.jsonl``) hold one row per step 0..``step`` and nothing after, the
    rows it drops appended to :data:`SUPERSEDED` first (so a crash in between duplicates, never
    loses); returns how many rows were moved. A row that is not JSON is moved too, as it was."""
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep: dict[int, str] = {}
    dropped: list[str] = []
    for line in lines:
        try:
            row_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            dropped.append(line)
            continue
        if step > 0 and row_step <= step:  # a fresh start (0) logs its step 0 again
            if row_step in keep:  # logged twice (before this fix): the later one is the lineage
                dropped.append(keep[row_step])
            keep[row_step] = line
        else:
            dropped.append(line)
    if not dropped:
        return 0
    tagged = []
    for line in dropped:
        try:
            tagged.append(json.dumps({"superseded_at_resume": step, **json.loads(line)}))
        except (ValueError, TypeError):
            tagged.append(line)
    _fsync_write(path.with_name(SUPERSEDED), "".join(t + "\n" for t in tagged), "a")
    tmp = path.with_name(path.name + ".tmp")
    _fsync_write(tmp, "".join(keep[k] + "\n" for k in sorted(keep)), "w")
    tmp.replace(path)
    return len(dropped)


# ----------------------------------------------------------------------------------------------
# Reading runs back
# ----------------------------------------------------------------------------------------------


def read_jsonl_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of ``metrics.jsonl`` (one dict per logged step)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def find_wandb_file(wandb_dir: str | Path) -> Path:
    """The newest ``run-*.wandb`` file below ``wandb_dir``."""
    files = sorted(Path(wandb_dir).rglob("run-*.wandb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no offline W&B run (run-*.wandb) below {wandb_dir}")
    return files[-1]


_BLOCK = 32768
_HEADER = 7  # b":W&B" + uint16 magic + uint8 version


def _iter_wandb_records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, pending = _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - (pos % _BLOCK)
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, rtype = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        chunk = data[pos : pos + length]
        pos += length
        if rtype == 0 and length == 0:
            continue
        if rtype == 1:  # FULL
            payload = chunk
        elif rtype == 2:  # FIRST
            pending = chunk
            continue
        elif rtype == 3:  # MIDDLE
            pending += chunk
            continue
        elif rtype == 4:  # LAST
            payload, pending = pending + chunk, b""
        else:
            raise ValueError(f"{path}: bad record type {rtype} at byte {pos}")
        rec = pb.Record()
        rec.ParseFromString(payload)
        yield rec


def _history_of(path: Path) -> tuple[int, list[dict[str, Any]]]:
    """One run file's start time (ns since the epoch; its mtime if it has no run record) and its
    history rows. A file its writer did not finish (the process was killed) ends mid-record: the
    rows before that are read."""
    start, rows = 0, []
    try:
        for rec in _iter_wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run" and not start:
                start = rec.run.start_time.ToNanoseconds()
            elif kind == "history":
                rows.append(
                    {("/".join(i.nested_key) or i.key): json.loads(i.value_json) for i in rec.history.item}
                )
    except Exception:  # noqa: BLE001 - a torn last record (DecodeError, a short frame): keep the rest
        if not rows and not start:
            raise
    return start or path.stat().st_mtime_ns, rows


def _supersede_attempts(files: Iterator[Path] | list[Path]) -> list[dict[str, Any]]:
    """The rows of one run's attempt files, in the order the attempts started, each attempt
    superseding the rows from its first step on."""
    attempts = sorted((_history_of(f) for f in files), key=lambda a: a[0])
    rows: list[dict[str, Any]] = []
    for _start, attempt in attempts:
        if attempt:
            first = attempt[0].get("_step", 0)
            rows = [r for r in rows if r.get("_step", 0) < first] + attempt
    return rows


def wandb_steps(wandb_dir: str | Path, run_id: str) -> set[int]:
    """The steps the offline W&B run ``run_id`` below ``wandb_dir`` holds (every attempt read as
    :func:`read_wandb_history` does); empty when it has no run file there."""
    rows = _supersede_attempts(list(Path(wandb_dir).rglob(f"run-{run_id}.wandb")))
    return {int(r["_step"]) for r in rows if "_step" in r}


def read_wandb_history(path: str | Path) -> list[dict[str, Any]]:
    """History rows of an offline W&B run: a ``run-*.wandb`` file, or a directory holding the run
    files of one or more attempts. For a directory, every file of the newest run's id is read in
    the order the attempts started, each attempt superseding the rows from its first step on (a
    resume from an earlier checkpoint logs those steps again), so each step appears once."""
    p = Path(path)
    if not p.is_dir():
        return _history_of(p)[1]
    return _supersede_attempts(list(p.rglob(find_wandb_file(p).name)))


def thread_clock() -> tuple[float, float]:
    """``(cpu_s, runq_s)`` of the calling thread so far: the seconds it ran on a CPU and the seconds
    it was ready but waited for one (another thread or process held its core; Linux
    ``/proc/thread-self/schedstat``, nan elsewhere). Between two readings, a phase's wall time
    minus both is what it spent blocked (I/O, locks, the GIL)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns, _ = f.read().split()
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return time.thread_time(), math.nan
