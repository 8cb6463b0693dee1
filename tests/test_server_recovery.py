"""What rank 0 does with a failed weight sync (issue #25): which failure calls for which recovery, and
how hung servers are told from live ones and replaced. Stand-in servers (no process); the real
server SIGSTOPped mid-sync is ``tests/test_hung_server.py`` (slow)."""

from __future__ import annotations

import pytest

import megatron_acrl.servers.recovery as recovery_mod
from megatron_acrl.config import load_config
from megatron_acrl.servers.recovery import ServerRecovery
from megatron_acrl.servers.transfer import HUNG, RECONNECT, RESTART, recovery
from sglang_bridge.client import ServerGoneError
from sglang_bridge.weight_sync import ManifestMismatchError, WeightSyncError, WeightSyncTimeoutError


@pytest.mark.parametrize(
    ("error", "dead", "action"),
    [
        (WeightSyncTimeoutError("bucket not received after 5s"), False, HUNG),
        (TimeoutError("SGLang server .../pause_generation did not answer within the timeout"), False, HUNG),
        (WeightSyncTimeoutError("bucket not received"), True, RESTART),  # a dead one: restart it
        (ServerGoneError("gone"), False, RESTART),
        (WeightSyncError("a server failed the bucket"), False, RECONNECT),
        (ManifestMismatchError("wrong shape"), False, None),  # bad input: a retry fails the same way
        (ValueError("bug"), False, None),
    ],
)
def test_each_failure_calls_for_its_recovery(error: BaseException, dead: bool, action: str | None) -> None:
    assert recovery(error, dead) == action


class StandIn:
    """A server process: ``state`` is "up", "stopped" (SIGSTOP), "deaf" (runs, answers nothing) or
    "dead"; counts its stops and starts."""

    def __init__(self, i: int, state: str = "up", log: list | None = None) -> None:
        self.i, self.state, self.log = i, state, log if log is not None else []
        self.url, self.name, self.pid = f"http://s{i}", f"sglang[{i}]", 100 + i

    def alive(self) -> bool:
        return self.state != "dead"

    def frozen(self) -> list[int]:
        return [self.pid] if self.state == "stopped" else []

    def stop(self, grace_s: float = 10.0) -> None:
        self.log.append(("stop", self.i, self.state))
        self.state = "dead"

    def start(self) -> StandIn:
        self.log.append(("start", self.i))
        return self


class Servers(ServerRecovery):
    """:class:`ServerRecovery` over stand-ins, recording what it did."""

    def __init__(self, states: list[str]) -> None:
        self.cfg = load_config(None, [])
        self.log: list = []
        self.servers = [StandIn(i, s, self.log) for i, s in enumerate(states)]  # type: ignore[misc]
        self.urls = [s.url for s in self.servers]
        self.router, self.synchronizer = None, None
        self.restarts = self.hung_restarts = 0
        self._routed: set[str] = set()
        self._load = type("Load", (), {"index": {}})()

    @property
    def api_key(self) -> str:
        return "key"

    def _server(self, i: int) -> StandIn:  # type: ignore[override]
        return StandIn(i, "up", self.log)

    def _connect(self) -> None:
        self.log.append(("connect",))


@pytest.fixture(autouse=True)
def _probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Health requests answered by the stand-ins' states (a deaf or stopped one does not answer)."""

    def probe(url: str, key: str, timeout_s: float) -> tuple[bool, str, bool]:
        return False, "timed out", False

    monkeypatch.setattr(recovery_mod, "probe", probe)


def _answering(monkeypatch: pytest.MonkeyPatch, servers: Servers) -> None:
    states = {s.url: s for s in servers.servers}

    def probe(url: str, key: str, timeout_s: float) -> tuple[bool, str, bool]:
        up = states[url].state == "up"
        return up, "HTTP 200" if up else "not reachable (timed out)", False

    monkeypatch.setattr(recovery_mod, "probe", probe)


def test_a_stopped_server_and_a_deaf_one_are_killed_and_replaced_the_others_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    servers = Servers(["up", "stopped", "deaf"])
    _answering(monkeypatch, servers)
    assert servers.hung_servers() == {
        1: "processes [101] are stopped",
        2: "no answer to a health request within 5 s (not reachable (timed out))",
    }
    assert servers.replace_hung() == [1, 2]
    stops = [e for e in servers.log if e[0] == "stop"]
    assert stops[:2] == [("stop", 1, "stopped"), ("stop", 2, "deaf")]  # killed as they were
    assert ("start", 1) in servers.log and ("start", 2) in servers.log and ("start", 0) not in servers.log
    assert servers.log[-1] == ("connect",)  # a new synchronizer, after the fresh servers
    assert servers.hung_restarts == 2 and servers.restarts == 1
    assert all(s.state == "up" for s in servers.servers)


def test_a_timeout_with_every_server_answering_reconnects_then_restarts_them_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    servers = Servers(["up", "up"])
    _answering(monkeypatch, servers)
    servers.recover(HUNG, attempt=0)
    assert servers.log == [("connect",)] and servers.hung_restarts == 0  # first: a new group only
    servers.recover(HUNG, attempt=1)  # the same sync timed out again: every server is replaced
    assert {e[1] for e in servers.log if e[0] == "start"} == {0, 1}
    assert servers.hung_restarts == 2


def test_a_hung_external_server_is_named_not_killed() -> None:
    servers = Servers([])
    servers.urls = ["http://gpu-node-3:30000"]
    with pytest.raises(ServerGoneError, match=r"gpu-node-3.*launch scripts own those.*weight_sync_timeout_s"):
        servers.replace_hung(escalate=True)


def test_close_kills_hung_servers_before_the_update_group_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung server would hold ``destroy_weights_update_group`` for a full request timeout on the way
    out (issue #36 item 8): close kills it first, so the teardown's request to it is refused at once."""
    from megatron_acrl.servers.handle import RolloutServers

    standins = Servers(["up", "stopped", "deaf"])
    _answering(monkeypatch, standins)
    log = standins.log

    class Sync:
        def close(self) -> None:  # the group teardown: by now no hung server is left running
            log.append(("teardown", [s.state for s in standins.servers]))

    handle = object.__new__(RolloutServers)
    handle.router, handle.synchronizer, handle.servers = None, Sync(), standins.servers  # type: ignore[assignment]
    handle._api_key, handle.adapters = "key", None  # (no LoRA adapter sync)
    handle.close()
    assert log[:3] == [("stop", 1, "stopped"), ("stop", 2, "deaf"), ("teardown", ["up", "dead", "dead"])]
    assert log[3] == ("stop", 0, "up") and handle.servers == []  # then every server, as before


def test_an_external_url_nothing_listens_on_is_refused_without_waiting_the_startup_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue #36 item 7: a ``rollout.server_urls`` entry whose connection is refused at once used to be
    polled for the whole ``startup_timeout_s``; refused for ``EXTERNAL_REFUSED_S`` it is reported."""
    import dataclasses
    import socket

    import megatron_acrl.servers.handle as handle_mod
    from sglang_bridge.server import ServersNotReady

    with socket.socket() as sock:  # a loopback port nothing listens on once the socket is closed
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setattr(handle_mod, "EXTERNAL_REFUSED_S", 0.5, raising=False)
    monkeypatch.setenv("ACRL_TEST_KEY", "key")
    cfg = load_config(None, [])
    cfg = dataclasses.replace(
        cfg,
        rollout=dataclasses.replace(
            cfg.rollout, server_urls=[url], startup_timeout_s=20, api_key_env="ACRL_TEST_KEY"
        ),
    )
    handle = object.__new__(handle_mod.RolloutServers)
    handle.cfg, handle._api_key = cfg, "key"
    with pytest.raises(ServersNotReady, match="no server listens there") as err:
        handle._start()
    assert url in str(err.value)
