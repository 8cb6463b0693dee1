"""The test launcher retries a launch whose rendezvous port was taken before rank 0 bound it."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_launch import PORT_RETRIES, launch

# A stand-in worker: the first launch fails the way a lost rendezvous port does; later ones report
# their rank and port. A real port loss needs another process to win a bind race, which no test can
# arrange reliably.
WORKER = """
import json, os, sys, torch
from pathlib import Path
scenario, args, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
marker = Path(args["marker"])
if os.environ["RANK"] == "0" and int(marker.read_text() if marker.exists() else 0) < args["fail"]:
    marker.write_text(str(int(marker.read_text() if marker.exists() else 0) + 1))
    print("RuntimeError: The server socket has failed to listen on any local network address. "
          "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
    sys.exit(1)
rank = os.environ["RANK"]
torch.save({"rank": int(rank), "port": os.environ["MASTER_PORT"]}, Path(out) / f"rank_{rank}.pt")
"""


def test_lost_rendezvous_port_is_retried(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    marker = tmp_path / "fails"
    got = launch("x", 2, {"marker": str(marker), "fail": 2}, timeout=120, worker=worker)
    assert [g["rank"] for g in got] == [0, 1] and got[0]["port"] == got[1]["port"]
    assert marker.read_text() == "2"


def test_other_failures_and_endless_port_loss_are_reported(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    marker = tmp_path / "fails"
    with pytest.raises(RuntimeError, match="address already in use"):
        launch("x", 2, {"marker": str(marker), "fail": 99}, timeout=120, worker=worker)
    assert marker.read_text() == str(PORT_RETRIES + 1)
    bad = tmp_path / "bad.py"
    bad.write_text("import sys; print('boom'); sys.exit(3)\n")
    with pytest.raises(RuntimeError, match="boom"):
        launch("x", 1, {}, timeout=120, worker=bad)
