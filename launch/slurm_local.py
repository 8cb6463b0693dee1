"""A real single-node SLURM cluster on loopback, for tests, CI and trying the launch scripts.

    python -m launch.slurm_local up        # install slurm-wlm if missing (root + apt), start, wait idle
    python -m launch.slurm_local status
    python -m launch.slurm_local down
    export SLURM_CONF=/tmp/acrl-slurm-ci/slurm.conf   # what `up` prints; sbatch/squeue/sinfo need it

It is SLURM 22.05 from Debian (``slurm-wlm``): slurmctld and slurmd as root, munge authentication,
no systemd, no cgroups, no accounting daemon (so no ``sacct``: read ``scontrol show job`` while the
job is still known, MinJobAge keeps finished jobs for 5 minutes). The node advertises two fake GPUs
(``Gres=gpu:2`` without device files) so submit-time GPU checks and ``--gpus-per-node`` requests are
exercised for real; nothing on the node can use them.

``up`` is idempotent: a cluster already running from the same directory is reused. Follows
``shared/recipes/slurm/slurm-up.sh``; see ``shared/docs/research/infra.md`` for the pitfalls.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("ACRL_SLURM_DIR", "/tmp/acrl-slurm-ci"))
FAKE_GPUS = 2
"""GPUs the local node advertises (GRES without devices): enough to test GPU requests and limits."""

# sinfo/scontrol hang for a long time when slurmctld is down or mid-start; every query is bounded.
_QUERY_TIMEOUT_S = 5.0


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be installed or started here; the message says why (tests skip with it)."""


@dataclass(frozen=True)
class LocalCluster:
    """A running local cluster; ``env`` is what a client (sbatch, squeue) needs on top of os.environ."""

    dir: Path
    started: bool
    """True when this call started the daemons (so the caller should stop them); False if reused."""

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    partition: str = "debug"


def _is_root() -> bool:
    return os.geteuid() == 0


def ensure_installed(allow_apt: bool = True) -> None:
    """Make sure slurmctld/slurmd/munged exist; apt-get install ``slurm-wlm`` if allowed (CI is root)."""
    if shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("munge"):
        return
    if not allow_apt:
        raise SlurmUnavailable("slurmctld not installed (apt-get install slurm-wlm)")
    if not _is_root() or not shutil.which("apt-get"):
        raise SlurmUnavailable(
            "slurmctld not installed and cannot apt-get install slurm-wlm (needs root + apt)"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "slurm-wlm"]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed (rc={proc.returncode}): {proc.stderr[-2000:]}")


def _mem_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                # RealMemory above the real amount puts the node into INVAL state: stay at 80 %.
                return int(line.split()[1]) // 1024 * 8 // 10
    return 1024


def write_conf(d: Path, gpus: int = FAKE_GPUS) -> Path:
    """Write slurm.conf (+ gres.conf) for one node ``localhost`` on 127.0.0.1, partition ``debug``."""
    for sub in ("state", "spool", "log"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    gres = f" Gres=gpu:{gpus}" if gpus else ""
    conf = f"""\
ClusterName=acrlci
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire also delays a requeued job's restart (default 120 s; 5 is the minimum).
AuthInfo=cred_expire=5
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
# The main scheduler otherwise looks at pending (e.g. requeued) jobs only every 60 s.
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
KillWait=10
Waittime=0
MinJobAge=300
{"GresTypes=gpu" if gpus else ""}
NodeName=localhost NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} RealMemory={_mem_mb()}{gres} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""
    (d / "slurm.conf").write_text(conf)
    # slurmd insists on one character device per GPU (a GRES count alone registers as 0 GPUs and
    # drains the node): give it /dev/null look-alikes. Nothing can run on them; jobs just get counted.
    lines = ["AutoDetect=off"]
    if gpus:
        for i in range(gpus):
            dev = d / f"fakegpu{i}"
            if not dev.exists():
                os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        lines.append(f"NodeName=localhost Name=gpu File={d}/fakegpu[0-{gpus - 1}]")
    (d / "gres.conf").write_text("\n".join(lines) + "\n")
    return d / "slurm.conf"


def _start_munge() -> None:
    if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
        return
    key = Path("/etc/munge/munge.key")
    if not key.exists() or key.stat().st_size == 0:
        # The Debian postinst normally creates it; a minimal image may not have run it.
        subprocess.run(["mungekey", "--create", "--force"], check=False, capture_output=True)
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
    for d in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
        Path(d).mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "munge", "munge")
    # --force: tolerate a stale socket/pid file left behind by a killed munged.
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged", "--force"], check=True)
    for _ in range(40):
        if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return
        time.sleep(0.25)
    raise SlurmUnavailable("munged did not start (see /var/log/munge/munged.log)")


def _pid(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    # A zombie still answers kill(0); it is not a running daemon.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            return None
    return pid


def node_state(d: Path = DEFAULT_DIR) -> str | None:
    """State of the local node (``idle``, ``mixed``, ...) or None when the controller does not answer."""
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-o", "%T"],
            env=dict(os.environ, SLURM_CONF=str(d / "slurm.conf")),
            capture_output=True,
            text=True,
            timeout=_QUERY_TIMEOUT_S,
        )
    except (subprocess.TimeoutExpired, FileNotFoundError):
        return None
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else None


def is_up(d: Path = DEFAULT_DIR) -> bool:
    """Both daemons of the cluster in ``d`` run and the node is usable."""
    if _pid(d / "slurmctld.pid") is None or _pid(d / "slurmd.pid") is None:
        return False
    state = node_state(d)
    return state is not None and state.rstrip("*~#") in ("idle", "mixed", "allocated", "completing")


def up(
    d: Path = DEFAULT_DIR, gpus: int = FAKE_GPUS, timeout_s: float = 30.0, allow_apt: bool = True
) -> LocalCluster:
    """Start the cluster in ``d`` (or reuse the running one) and wait until the node is idle."""
    if is_up(d):
        return LocalCluster(d, started=False)
    ensure_installed(allow_apt)
    down(d)  # stale daemons of a half-dead cluster would hold the ports
    if not _is_root():
        raise SlurmUnavailable("the local cluster runs its daemons as root; run as root (CI is)")
    _start_munge()
    conf = write_conf(d, gpus)
    env = dict(os.environ, SLURM_CONF=str(conf))
    # -c: start from empty state so jobs of an earlier run do not come back.
    for cmd in (["slurmctld", "-c", "-f", str(conf)], ["slurmd", "-f", str(conf), "-N", "localhost"]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise SlurmUnavailable(f"{cmd[0]} failed to start (rc={proc.returncode}): {proc.stderr.strip()}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (node_state(d) or "").rstrip("*~#") == "idle":
            return LocalCluster(d, started=True)
        time.sleep(0.25)
    logs = "\n".join(p.read_text()[-1500:] for p in sorted((d / "log").glob("*.log")))
    down(d)
    raise SlurmUnavailable(f"SLURM did not come up within {timeout_s:.0f}s; logs:\n{logs}")


def down(d: Path = DEFAULT_DIR) -> None:
    """Stop the daemons of the cluster in ``d`` (munged stays: other clusters may share it)."""
    pids = [p for p in (_pid(d / "slurmctld.pid"), _pid(d / "slurmd.pid")) if p]
    if not pids:
        return
    with contextlib.suppress(subprocess.TimeoutExpired, FileNotFoundError):
        subprocess.run(
            ["scontrol", "shutdown"],
            env=dict(os.environ, SLURM_CONF=str(d / "slurm.conf")),
            capture_output=True,
            timeout=_QUERY_TIMEOUT_S,
        )
    deadline = time.monotonic() + 10
    for pid in pids:
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)
        if _alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    with contextlib.suppress(OSError):
        return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.slurm_local", description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["up", "down", "status"])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="state, spool, logs and slurm.conf")
    ap.add_argument("--gpus", type=int, default=FAKE_GPUS, help="fake GPUs the node advertises")
    ap.add_argument("--no-apt", action="store_true", help="do not apt-get install slurm-wlm when missing")
    args = ap.parse_args(argv)
    try:
        if args.action == "up":
            cluster = up(args.dir, args.gpus, allow_apt=not args.no_apt)
            print(f"slurm {'started' if cluster.started else 'already up'}: export SLURM_CONF={cluster.conf}")
        elif args.action == "down":
            down(args.dir)
            print("slurm stopped")
        else:
            ok = is_up(args.dir)
            print(f"slurm {'up' if ok else 'down'} (SLURM_CONF={args.dir / 'slurm.conf'})")
            return 0 if ok else 1
    except SlurmUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
