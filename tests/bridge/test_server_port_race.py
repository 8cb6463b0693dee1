"""A picked port taken before the server binds it: the server is relaunched on another port.

``free_port`` can only say a port is free *now*; a server starting next to ours (SGLang takes more
ports for its own IPC) can bind it first. SGLang then logs ``[Errno 98] ... address already in use``
and lingers before exiting. A stand-in server process with SGLang's behaviour keeps this test fast;
``SGLangServer``'s launch/wait logic is the real one.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from sglang_bridge import server as server_mod
from sglang_bridge.server import ServerSpec, ServerStartError, SGLangServer

STAND_IN = r"""
import http.server, json, socketserver, sys, time
port, model = int(sys.argv[1]), sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"model_path": model}).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a):
        pass
try:
    srv = socketserver.TCPServer(("127.0.0.1", port), H)
except OSError as e:
    print(f"ERROR:    [Errno {e.errno}] error while attempting to bind on address "
          f"('127.0.0.1', {port}): address already in use", flush=True)
    time.sleep(5)  # SGLang lingers (~10 s) before it exits
    sys.exit(3)
srv.serve_forever()
"""


@dataclass(frozen=True)
class StandInSpec(ServerSpec):
    def command(self, port: int, key_file: str | Path | None = None) -> list[str]:
        return [sys.executable, "-c", STAND_IN, str(port), self.model_path]

    def env(self) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin"}


def _model_dir(tmp_path: Path) -> Path:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    return tmp_path / "m"


def test_relaunch_on_a_new_port_when_the_picked_one_is_taken(tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    picks = iter([busy, server_mod.free_port()])
    monkeypatch.setattr(server_mod, "free_port", lambda host="127.0.0.1": next(picks))
    spec = StandInSpec(model_path=str(_model_dir(tmp_path)))
    try:
        with SGLangServer(spec, tmp_path / "s.log", startup_timeout_s=60) as srv:
            assert srv.port != busy and srv.alive()
        log = (tmp_path / "s.log").read_text()
        launches = [line for line in log.splitlines() if line.startswith("# ")]
        assert len(launches) == 2 and "address already in use" in log  # both launches are logged
    finally:
        taken.close()


def test_a_fixed_port_is_never_changed(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    spec = StandInSpec(model_path=str(_model_dir(tmp_path)), port=busy)
    try:
        srv = SGLangServer(spec, tmp_path / "s.log", startup_timeout_s=60)
        # Refused before any launch, naming the holder (a run never adopts or moves off a fixed port).
        with pytest.raises(ServerStartError, match="is held by pid .* which this process did not start"):
            srv.start()
        assert srv.port == busy and not (tmp_path / "s.log").exists()
    finally:
        taken.close()
