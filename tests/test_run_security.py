"""A run owns what it starts (issue #24), shown on real runs with real SGLang CPU servers.

One run trains on a fixed port. While it does: requests without its key get 401 at its server and it
trains on, its server still holding its own weights; a second run given the same port (and even the
same key) neither adopts nor disturbs that server but refuses, naming the port and the process
holding it; the key is on no command line of any process of the run, in no environment of its
server, and after the run in no file under its run directory, whose every path is its owner's alone
(0700 / 0600); no process of the run listens beyond loopback. The pieces around it (the job task's
output companion, the rules for listed servers, the key's origin) are checked without a server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from security_helpers import (
    cmdlines_holding,
    environs_holding,
    files_holding,
    not_on_loopback,
    open_to_others,
    process_tree,
)

from megatron_acrl.config import ConfigError, load_config
from megatron_acrl.config.exit_codes import CONFIG_ERROR, SERVERS_UNAVAILABLE
from megatron_acrl.servers.handle import RolloutServers, run_api_key
from megatron_acrl.warmstart.tiny_model import build_tokenizer
from sglang_bridge.listeners import port_holder
from sglang_bridge.server import ServersNotReady, free_port, probe
from sglang_bridge.server_key import new_api_key

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "tiny_dense.yaml")
KEY_ENV = "ACRL_TEST_RUN_KEY"

# ---- without a server -----------------------------------------------------------------------------


def test_a_run_makes_its_own_key_unless_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(CONFIG)
    keys = {run_api_key(cfg) for _ in range(3)}
    assert len(keys) == 3 and all(len(k) >= 40 for k in keys)
    named = load_config(CONFIG, [f"rollout.api_key_env={KEY_ENV}"])
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match="rollout.api_key_env"):
        run_api_key(named)
    monkeypatch.setenv(KEY_ENV, "mine")
    assert run_api_key(named) == "mine"


def test_listed_servers_need_a_named_key() -> None:
    with pytest.raises(ConfigError, match="rollout.api_key_env"):
        load_config(CONFIG, ["rollout.server_urls=[http://127.0.0.1:1]"])
    with pytest.raises(ConfigError, match="environment variable name"):
        load_config(CONFIG, ["rollout.api_key_env=not a name"])


@pytest.fixture()
def standin(request: pytest.FixtureRequest) -> Iterator[str]:
    """A stand-in server answering /model_info: without any key, or only with the key ``right``."""
    key = request.param

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server naming
            ok = key is None or self.headers.get("Authorization") == f"Bearer {key}"
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.parametrize(
    ("standin", "refusal"),
    [(None, "without an API key"), ("right", "API key rejected")],
    indirect=["standin"],
    ids=["unkeyed", "other-key"],
)
def test_a_listed_server_is_used_only_if_it_demands_the_runs_key(
    standin: str, refusal: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "wrong")
    cfg = load_config(
        CONFIG, [f"rollout.server_urls=[{standin}]", f"rollout.api_key_env={KEY_ENV}", "rollout.device=cpu"]
    )
    with pytest.raises(ServersNotReady, match=refusal):
        RolloutServers(cfg, tmp_path / "model", tmp_path / "logs")


COMPANION = """
import sys
from launch.serve import exec_server
from sglang_bridge.server_key import KeyFile
key = sys.argv[1]
kf = KeyFile(key)
path = kf.write()
print("KEYFILE", path, flush=True)
child = ("import sys, pathlib; p = sys.argv[1]; print('args', sys.argv, pathlib.Path(p).read_text());"
         "print('again', " + repr(key) + ", file=sys.stderr)")
exec_server([sys.executable, "-c", child, str(path)], {"PATH": "/usr/bin:/bin"}, key, kf, "http://127.0.0.1:9")
"""


def test_a_job_server_task_logs_through_the_key_filter_and_leaves_no_key_file() -> None:
    key = new_api_key()
    out = subprocess.run(
        [sys.executable, "-c", COMPANION, key], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert key not in out.stdout + out.stderr
    # The server read its key from the file (the log shows it redacted), on stdout and stderr alike.
    assert out.stdout.count("<redacted>") == 2, out.stdout
    keyfile = Path(out.stdout.split("KEYFILE ", 1)[1].split()[0])
    deadline = time.monotonic() + 30  # the companion removes it once the server's output ends
    while keyfile.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not keyfile.parent.exists()


def test_a_server_task_bound_beyond_loopback_needs_a_key(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model:\n  hf_path: {tmp_path}\n")
    res = subprocess.run(
        [sys.executable, "-m", "launch.serve", str(cfg), "--host", "0.0.0.0", "--print"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == CONFIG_ERROR and "rollout.api_key_env" in res.stderr, res.stderr


# ---- two real runs on one port --------------------------------------------------------------------

SMALL = [
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=6",
    "rollout.max_prompt_len=16",
    "training.micro_batch_size=8",
    "task.num_digits=1",
    "rollout.device=cpu",
]


ENV = {"WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}


def _train_cmd(run_dir: Path, port: int, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "megatron_acrl.train", "--config", CONFIG, "--run-dir", str(run_dir)]
    return [*cmd, *SMALL, f"rollout.base_port={port}", f"rollout.api_key_env={KEY_ENV}", *extra]


def _train(run_dir: Path, port: int, *extra: str, log: Path) -> subprocess.Popen[bytes]:
    # A permissive umask, as many users have: the run's modes must not depend on it.
    return subprocess.Popen(
        _train_cmd(run_dir, port, *extra), cwd=run_dir.parent, env={**os.environ, **ENV},
        stdout=log.open("wb"), stderr=subprocess.STDOUT, preexec_fn=lambda: os.umask(0o022),
    )  # fmt: skip


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait(cond, timeout_s: float, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what} (rc={proc.poll()}):\n{log.read_text()[-4000:]}")
        time.sleep(1.0)


def _post(url: str, path: str, body: dict, key: str | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _weight_version(url: str, key: str) -> str:
    req = urllib.request.Request(url + "/model_info", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return str(json.loads(r.read())["weight_version"])


ATTACKS = [
    ("/update_weights_from_disk", {"model_path": "/tmp/a-foreign-checkpoint"}),
    ("/pause_generation", {"mode": "abort"}),
    ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}),
    (
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
         "group_name": "foreign", "backend": "gloo"},
    ),
]  # fmt: skip


def test_a_run_owns_its_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = new_api_key()
    monkeypatch.setenv(KEY_ENV, key)  # named, so the test can look for it; the second run gets it too
    port = free_port()
    first, second = tmp_path / "first", tmp_path / "second"
    log_a = tmp_path / "first.log"
    a = _train(first, port, "training.num_steps=400", f"training.checkpoint_dir={first / 'ckpt'}", log=log_a)
    try:
        _wait(lambda: _steps(first) >= 1, 900, "the first run never trained", a, log_a)
        url = f"http://127.0.0.1:{port}"
        server_pid = int(re.search(r"pid (\d+)", port_holder(port)).group(1))  # type: ignore[union-attr]
        assert server_pid in process_tree(a.pid)

        for path, body in ATTACKS:  # no key: refused, and the run trains on
            assert _post(url, path, body) == 401, path
        assert _weight_version(url, key).startswith("step-")  # still the run's own weights

        b = subprocess.run(
            _train_cmd(second, port, "training.num_steps=2"), cwd=tmp_path, env={**os.environ, **ENV},
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert b.returncode == SERVERS_UNAVAILABLE, b.stderr[-3000:]
        assert "rollout.base_port" in b.stderr and f"port {port} is held by pid {server_pid}" in b.stderr
        assert not (second / "logs" / "sglang_0.log").exists()  # it started no server either

        before = _steps(first)
        _wait(lambda: _steps(first) >= before + 2, 600, "the first run stopped training", a, log_a)
        assert probe(url, key)[0] and a.poll() is None

        tree = process_tree(a.pid)
        assert not cmdlines_holding(key, tree)
        assert not environs_holding(key, process_tree(server_pid))  # the user's variable stays out
        assert not not_on_loopback(tree)
    finally:
        a.send_signal(signal.SIGTERM)  # checkpoint at the end of the step and stop (exit 0)
        rc = a.wait(timeout=600)
    assert rc == 0, log_a.read_text()[-4000:]
    assert (first / "ckpt" / "latest.json").exists()
    assert not files_holding(key, first) and key not in log_a.read_text()
    assert not open_to_others(first)


def test_dry_run_never_shows_the_key(tmp_path: Path) -> None:
    key = new_api_key()
    res = subprocess.run(
        [sys.executable, "-m", "launch.submit", CONFIG, "--nodes", "2", "--ranks-per-node", "1",
         "--server-nodes", "1", "--servers-per-node", "1", "--output-dir", str(tmp_path), "--dry-run",
         "--skip-cluster-checks", f"model.hf_path={build_tokenizer(320)}"],  # submit loads its tokenizer
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "ACRL_SGLANG_API_KEY": key},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "SERVER_MODE=dedicated" in res.stdout and "SERVER_HOST=0.0.0.0" in res.stdout
    assert "token_urlsafe" in res.stdout and key not in res.stdout + res.stderr


AGENT_LISTENERS = """
import os, sys
sys.path.insert(0, {tests!r})
from security_helpers import listeners, not_on_loopback
agent = os.getppid()
print("LISTENERS", len(listeners([agent])), "OPEN", not_on_loopback([agent]), os.environ["MASTER_ADDR"])
"""


def test_torchrun_stores_listen_on_loopback(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(AGENT_LISTENERS.format(tests=str(ROOT / "tests")))
    res = subprocess.run(
        [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node", "1", str(script)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    # The rendezvous store and the ranks' store, both bound to loopback and announced there.
    assert "LISTENERS 2 OPEN [] 127.0.0.1" in res.stdout, res.stdout
