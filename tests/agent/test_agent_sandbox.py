"""The bubblewrap sandbox: one test per limit, and nothing left running afterwards."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid

import pytest

from megatron_acrl.rollout.agent import sandbox as sb
from megatron_acrl.rollout.agent.envs import PythonTool
from megatron_acrl.rollout.agent.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from megatron_acrl.rollout.agent.tools import call_tool

LIMITS = SandboxLimits(
    cpu_time_s=1, memory_mb=256, file_size_mb=1, max_processes=16, wall_time_s=10, max_output_bytes=4096
)


@pytest.fixture(scope="module")
def box() -> Sandbox:
    return Sandbox(LIMITS)


def run(box: Sandbox, code: str):
    return asyncio.run(box.run_python(code))


def sleeper(marker: str, **popen: object) -> str:
    """Python source that starts a child sleeping 60 s, ``marker`` in its command line."""
    args = "".join(f", {k}={v!r}" for k, v in popen.items())
    return f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  # {marker}']{args})"


def alive_with(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line holds ``marker``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b") ", 1)[-1][:1]
        except OSError:
            continue
        if marker.encode() in cmd and state != b"Z":
            pids.append(int(pid))
    return pids


def test_runs_code_and_reads_stdin(box):
    res = asyncio.run(box.run_python("import sys; print(sys.stdin.read().upper())", stdin="hi"))
    assert (res.outcome, res.exit_code, res.stdout) == ("ok", 0, "HI\n")


def test_cpu_time(box):
    assert run(box, "while True: pass").outcome == "cpu_time"


def test_memory(box):
    res = run(box, "x = bytearray(1024 * 1024 * 1024)")
    assert res.outcome == "memory" and "MemoryError" in res.stderr


def test_output_size(box):
    res = run(box, "import sys\nfor _ in range(1000): sys.stdout.write('x' * 10000)")
    assert res.outcome == "output_too_large" and res.exit_code is None
    assert len(res.stdout.encode()) <= LIMITS.max_output_bytes


def test_wall_time():
    res = asyncio.run(Sandbox(SandboxLimits(wall_time_s=0.5)).run_python("import time; time.sleep(60)"))
    assert res.outcome == "wall_time" and res.exit_code is None


def test_file_size(box):
    res = run(box, "open('big', 'wb').write(b'x' * 4 * 1024 * 1024)")
    assert res.outcome != "ok"


def test_network_refused(box):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.setblocking(False)
        port = srv.getsockname()[1]
        code = f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))"
        res = run(box, code + "\nprint('connected')")
        assert res.outcome == "error" and "connected" not in res.stdout
        with pytest.raises(BlockingIOError):
            srv.accept()  # nothing reached the host's listener


def test_writes_outside_its_directory_refused(box, tmp_path):
    target = tmp_path / "escaped"
    outside = ["/usr/evil", "/etc/evil", "/evil", "/dev/evil", "/dev/shm/evil", "/var/tmp/evil", "/proc/evil"]
    code = (
        f"ok = []\nfor p in {[*outside, str(target)]!r}:\n"
        "    try:\n        open(p, 'w').write('x'); ok.append(p)\n    except OSError:\n        pass\n"
        "open('/tmp/mine', 'w').write('fine')\nopen('/dev/null', 'w').write('x')\n"
        "print(ok, open('mine').read())"
    )
    res = run(box, code)
    assert res.outcome == "ok", res.stderr
    assert res.stdout == "[] fine\n"
    assert not target.exists() and not os.path.exists("/usr/evil")


def test_fork_bomb_contained(box):
    marker = f"forkbomb-{uuid.uuid4().hex}"
    code = (
        "import subprocess, sys\nn = 0\ntry:\n    for _ in range(500):\n"
        f"        {sleeper(marker)}\n"
        "        n += 1\nexcept OSError:\n    pass\nprint(n)"
    )
    res = run(box, code)
    assert res.outcome == "ok", res.stderr
    assert int(res.stdout) < LIMITS.max_processes  # refused at the limit, not after 500
    assert alive_with(marker) == []


def test_nothing_left_running(box):
    marker = f"daemon-{uuid.uuid4().hex}"
    code = (
        "import os, subprocess, sys\n"  # a double-forked daemon in its own session outlives its parent
        f"{sleeper(marker, start_new_session=True)}\n"
        "print('left')"
    )
    res = run(box, code)
    assert res.stdout == "left\n"
    assert alive_with(marker) == []
    # killed at its wall time, with a child still running: the child goes too
    short = Sandbox(SandboxLimits(wall_time_s=1.0))
    code = f"import subprocess, sys, time\n{sleeper(marker)}\ntime.sleep(60)"
    assert asyncio.run(short.run_python(code)).outcome == "wall_time"
    assert alive_with(marker) == []


def test_a_tool_timeout_ends_the_run_and_its_children():
    """The tool's own timeout (call_tool) cancels a run inside its sandbox limits: nothing is left."""
    marker = f"cancelled-{uuid.uuid4().hex}"
    tool = PythonTool(Sandbox(SandboxLimits(wall_time_s=30)))
    code = f"import subprocess, sys, time\n{sleeper(marker)}\ntime.sleep(60)"
    res = asyncio.run(call_tool(tool, {"code": code}, timeout_s=1.0, max_output_bytes=100))
    assert res.failure == "timeout"
    assert alive_with(marker) == []


def test_missing_bwrap_is_named(monkeypatch):
    sb.check_sandbox.cache_clear()
    monkeypatch.setattr(sb.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        Sandbox(LIMITS)
    sb.check_sandbox.cache_clear()


def test_refused_namespaces_are_named(monkeypatch):
    """A bwrap that cannot make its namespaces (stood in for by one that exits 1) is named, with the fix."""
    sb.check_sandbox.cache_clear()
    monkeypatch.setattr(
        sb, "_bwrap_argv", lambda *a: ["/bin/sh", "-c", "echo 'bwrap: No permissions' >&2; exit 1"]
    )
    with pytest.raises(SandboxUnavailable, match="user namespaces") as err:
        Sandbox(LIMITS)
    assert "No permissions" in str(err.value)
    sb.check_sandbox.cache_clear()


def test_limits_are_checked():
    with pytest.raises(ValueError, match="cpu_time_s"):
        SandboxLimits(cpu_time_s=0)
