"""What rank 0 does when its rollout servers fail: restart dead ones, kill and replace hung ones,
restart a dead router, reconnect the update group (:class:`ServerRecovery`, the failure half of
:class:`megatron_acrl.servers.handle.RolloutServers`).

A failed weight sync names what it calls for (:func:`megatron_acrl.servers.transfer.recovery`), and
:meth:`ServerRecovery.recover` does it; the driver then re-sends the full weights
(:meth:`megatron_acrl.servers.publisher.WeightPublisher.push`). Three kinds:

* a server died (:data:`RESTART`): a fresh one from the served model directory, a new update group;
* a server timed out (:data:`HUNG`): one whose process runs but that answers no health request, or
  one that is stopped (SIGSTOP), is *hung*. Its requests may still be pending in it, so it is not
  reused: its whole process tree is killed with SIGKILL (which a stopped process cannot ignore; the
  bridge's registry forgets it), a fresh server takes its place and a new synchronizer connects,
  as :class:`sglang_bridge.weight_sync.WeightSyncTimeoutError` advises. A timeout with every server
  answering reconnects first; a second one in the same sync (a scheduler deadlocked behind a live
  HTTP front end looks like that) restarts every local server. Each killed server is counted
  (``sync/hung_restarts``) and logged with its pid;
* a failed source or a broken group (:data:`RECONNECT`): a new synchronizer on the same servers.

A failed rollout (sync mode's fan-out, the async engine's requests) is diagnosed the same way by
:meth:`ServerRecovery.recover_rollout`, whatever the error it surfaced as (a lost connection, a
request timeout, or the router's HTTP error for a worker that stopped answering): a dead server is
restarted, a hung one (stopped, or silent to health requests) killed and replaced and counted in
``hung_restarts`` (logged "is hung during a rollout"), a dead sglang-router started again on its
port with the same workers (``router_restarts``). Only when nothing is found wrong is the error the
request's own, and fatal; the driver re-sends the served weights and retries the rollout
(:func:`megatron_acrl.rollout.phase.collect_rollouts`, :class:`megatron_acrl.rollout.producer.AsyncProducer`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from megatron_acrl.config import Config
from megatron_acrl.servers.transfer import HUNG, RESTART
from sglang_bridge.client import ServerGoneError
from sglang_bridge.router import RouterError, SGLangRouter
from sglang_bridge.server import SGLangServer, probe

if TYPE_CHECKING:
    from sglang_bridge.weight_sync import DistributedWeightSynchronizer

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
"""A health request (``/model_info``, answered by the server's HTTP front end even while its
scheduler is busy) unanswered this long, twice, marks a running server as hung."""


class ServerRecovery:
    """Restarts, hung-server replacement and reconnects (module doc); mixed into ``RolloutServers``,
    which provides the attributes below and ``_server``, ``_connect``, ``_restart_router``."""

    cfg: Config
    servers: list[SGLangServer]
    urls: list[str]
    router: SGLangRouter | None
    synchronizer: DistributedWeightSynchronizer | None
    restarts: int
    hung_restarts: int
    router_restarts: int = 0
    """Times a dead sglang-router was started again (``rollout/router_restarts``); a class default
    so that the handle's constructor need not know it."""
    _routed: set[str]
    _load: Any

    @property
    def api_key(self) -> str:
        raise NotImplementedError

    def _server(self, i: int) -> SGLangServer:
        raise NotImplementedError

    def _connect(self) -> None:
        raise NotImplementedError

    def dead_servers(self) -> list[int]:
        """The local servers whose main process has exited."""
        return [i for i, s in enumerate(self.servers) if not s.alive()]

    def hung_servers(self, probe_timeout_s: float = PROBE_TIMEOUT_S) -> dict[int, str]:
        """The local servers that run but are hung, each with why: a process of its tree is stopped,
        or it answered no health request within ``probe_timeout_s``, twice."""
        hung = {}
        for i, s in enumerate(self.servers):
            if not s.alive():
                continue
            if frozen := s.frozen():
                hung[i] = f"processes {frozen} are stopped"
                continue
            for _ in range(2):
                ok, what, _fatal = probe(s.url, self.api_key, probe_timeout_s)
                if ok:
                    break
            else:
                hung[i] = f"no answer to a health request within {probe_timeout_s:g} s ({what})"
        return hung

    def recover(self, action: str, attempt: int = 0) -> None:
        """Do what a failed weight sync called for (:data:`RESTART`, :data:`HUNG`, else reconnect);
        ``attempt`` counts the sync's failures before this one (a repeated timeout escalates)."""
        if action == RESTART:
            self.restart()
        elif action == HUNG:
            self.replace_hung(escalate=attempt > 0)
        else:
            self.reconnect()

    def replace_hung(self, *, escalate: bool = False) -> list[int]:
        """Kill every hung local server's process tree and start fresh ones (module doc); with none
        hung, reconnect, or with ``escalate`` restart every local server. Returns the servers killed."""
        hung = self.hung_servers()
        if not hung and not escalate:
            log.warning("a weight sync timed out but every server answers; reconnecting the update group")
            self.reconnect()
            return []
        if not self.servers:
            raise ServerGoneError(
                f"an external SGLang server ({', '.join(self.urls)}) did not answer a weight sync in time; "
                "launch scripts own those: restart it (or raise rollout.weight_sync_timeout_s if it is slow)"
            )
        if not hung:
            again = "a weight sync timed out again with every server answering"
            hung = dict.fromkeys(range(len(self.servers)), again)
        self._kill_hung(hung, "during a weight sync")
        return sorted(hung)

    def _kill_hung(self, hung: dict[int, str], during: str) -> None:
        """Kill the process tree of each hung local server in ``hung`` (index -> why), log it with
        its pid, count it, and start fresh ones (a new synchronizer: the weights must be re-sent)."""
        for i, why in hung.items():
            s = self.servers[i]
            log.warning(
                "rollout server %s (pid %s, %s) is hung %s: %s; killing its process tree (SIGKILL) "
                "and starting a fresh one",
                s.name,
                s.pid,
                s.url,
                during,
                why,
            )
            s.stop(grace_s=0.0)  # SIGKILL at once: a stopped process never acts on SIGTERM
        self.hung_restarts += len(hung)
        self.restart()  # the killed ones are dead now: fresh servers, a new synchronizer

    def recover_rollout(self, error: BaseException) -> str | None:
        """Rank 0, after a rollout failed with ``error``: find what failed and repair it (module
        doc); the served weights must then be re-sent. Returns what was done, for the log, or None
        when every server and the router are found well and ``error`` is no lost connection or
        timeout: the request's own fault, which a retry would repeat."""
        if dead := self.dead_servers():
            names = ", ".join(self.servers[i].name for i in dead)
            self.restart()
            return f"server(s) {names} exited; restarted"
        if hung := self.hung_servers():
            self._kill_hung(hung, "during a rollout")
            names = "; ".join(f"{self.servers[i].name}: {why}" for i, why in hung.items())
            return f"server(s) hung ({names}); killed and replaced"
        if self.router is not None and not self.router.alive():
            self._restart_router()
            self.restarts += 1  # the async engine resubmits once the restart count moves
            return f"sglang-router exited; restarted on {self.router.url} with the same workers"
        if isinstance(error, ServerGoneError | TimeoutError) and self.servers:
            # Unreachable, or silent, with every process running and answering health requests now
            # (a scheduler deadlocked behind a live HTTP front end looks like this): start afresh.
            self.restart()
            return "no server found dead or hung; restarted every server"
        return None

    def _restart_router(self) -> None:
        """A fresh router in front of every server, on the dead one's port (its workers' weights are
        current: after a sync, or a router that died while the servers lived); on a fresh port only
        when that one is taken meanwhile."""
        old = self.router
        assert old is not None
        tail = old.log_tail(10)
        log.warning("sglang-router (%s) exited; starting a new one on its port. Its log: %s", old.url, tail)
        old.stop(grace_s=0.0)
        spec = replace(old.spec, worker_urls=tuple(self.urls), port=old.port)
        try:
            router = SGLangRouter(spec, old.log_path, startup_timeout_s=old.startup_timeout_s).start()
        except RouterError as e:
            log.warning("sglang-router could not bind port %s again (%s); using a free one", old.port, e)
            spec = replace(spec, port=None)
            router = SGLangRouter(spec, old.log_path, startup_timeout_s=old.startup_timeout_s).start()
        self.router = router
        self._routed = set(self.urls)
        self.router_restarts += 1

    def restart(self) -> None:
        """Restart dead local servers and reconnect the update group (weights must be re-sent); a
        router that died while every server lives is started again alone."""
        if self.router is not None and not self.router.alive() and not self.dead_servers():
            self._restart_router()
            self.restarts += 1
            return
        if not self.servers:
            raise ServerGoneError(
                f"an external SGLang server ({', '.join(self.urls)}) is gone (launch scripts own those)"
            )
        self._close_synchronizer()
        for i in self.dead_servers() or range(len(self.servers)):
            old = self.servers[i].url
            if self.router is not None and old in self._routed:
                if self.router.alive():  # a dead router is started afresh at the next sync
                    self.router.remove_worker(old)  # back in after the next weight sync
                self._routed.discard(old)
            self._load.index.pop(old, None)
            self.servers[i].stop()
            self.servers[i] = self._server(i)
            self.servers[i].start()
            self._load.index[self.servers[i].url] = i
        self.urls = [s.url for s in self.servers]
        self.restarts += 1
        self._connect()

    def reconnect(self) -> None:
        """A new synchronizer on the same servers (what a failed update with several sources asks
        for); the other sources join its groups at their next sync."""
        self._close_synchronizer()
        self._connect()

    def _close_synchronizer(self) -> None:
        if self.synchronizer is not None:
            try:
                self.synchronizer.close()
            except Exception:  # noqa: BLE001 - a peer is gone or hung; the group is torn down either way
                pass
