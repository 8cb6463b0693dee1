"""sglang-router in front of the rollout servers: start, health, stop, add and remove workers.

    spec = RouterSpec(worker_urls=("http://127.0.0.1:30001", "http://127.0.0.1:30002"),
                      policy="cache_aware", api_key=key)
    with SGLangRouter(spec, log_path="logs/router.log") as router:   # waits until every worker is in
        router.url                                                     # send /generate here
        router.remove_worker(dead_url); router.add_worker(new_url)

The router (PyPI ``sglang-router`` 0.3.2, Rust) takes ``/generate`` requests and picks a worker by
its policy (``cache_aware``: the worker whose prefix tree matches the prompt best, unless the
workers' loads drift apart; ``power_of_two``; ``round_robin``; ``random``). A request that fails on
a worker (the worker died mid-request) is retried on another one by the router itself; a dead
worker is marked unhealthy by its health checks (every ``health_check_interval_s``) and skipped.
It does *not* carry the weight-update endpoints or pause / continue: those go to each server
directly.

Its single-process API (``RouterArgs``, ``Router.from_args(...).start()``) runs in a child started
as ``python -m sglang_bridge.router <json>``: the API key is written to the child's stdin, never to
its command line (``launch_router --api-key`` would put it in every ``ps`` listing) or its
environment. With a key the router demands it of its clients (every endpoint but the health probes)
and sends it to the workers. The child runs in its own session with ``PR_SET_PDEATHSIG`` and is in
the registry :func:`sglang_bridge.server.stop_all_servers` stops, like a server.

0.3.2 facts (checked on this machine): ``/generate`` accepts one prompt or a batch of prompts with a
single ``sampling_params`` object (per-prompt lists are refused, 422), so a group goes as one prompt
with SGLang's ``n``; ``GET /workers`` lists ``{id, url, is_healthy, load}``; ``POST /workers
{"url"}`` and ``DELETE /workers/{id}`` add and remove one in the background (202); ``/readiness``
counts healthy workers; the Prometheus exporter binds a port of its own (29000 unless told: two
routers on one host would collide, so each gets a free one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_bridge.server import ChildProcess, _preexec, free_port, register_child, unregister_child

log = logging.getLogger(__name__)

POLICIES = ("cache_aware", "power_of_two", "round_robin", "random", "consistent_hashing")
"""Policies of a regular (not prefill/decode-split) router. ``consistent_hashing`` routes by the
request's ``X-SMG-Routing-Key`` header (:data:`sglang_bridge.client.ROUTING_KEY_HEADER`: an agent
trajectory's id, so its turns find their prefix cache), a request without one at random. 0.3.2's
``launch_router`` CLI does not offer it (its argparse choices stop at ``manual``), but the Rust
router takes it through ``RouterArgs`` (``policy_from_str`` maps it), which is how :func:`main` starts
the router."""


class RouterError(RuntimeError):
    """The router did not start, or did not take a worker change (message has its log tail)."""


@dataclass(frozen=True)
class RouterSpec:
    """How to run one sglang-router."""

    worker_urls: tuple[str, ...]
    """The servers it routes to at start (all must be healthy)."""
    policy: str = "cache_aware"
    """One of :data:`POLICIES`."""
    host: str = "127.0.0.1"
    """Bind address; the driver alone talks to it, so loopback."""
    port: int | None = None
    """HTTP port; None picks a free one."""
    api_key: str | None = None
    """The servers' key: demanded of clients, sent to the workers (stdin of the child, never argv)."""
    health_check_interval_s: int = 2
    """Seconds between the router's health checks of each worker (its default, 60, would leave a dead
    worker in rotation for minutes)."""
    health_failure_threshold: int = 2
    """Failed checks in a row before a worker is skipped."""
    request_timeout_s: int = 1800
    """A /generate request's limit inside the router."""
    balance_abs_threshold: int = 1
    balance_rel_threshold: float = 1.25
    """cache_aware balances by load once the busiest worker has more than ``abs`` requests and
    ``rel`` times as many in flight as the idlest. Its defaults (64, 1.5) suit many independent
    clients; with one client that holds back work (at most ``max_concurrency`` per server) they are
    never reached, and prompts sharing a chat template would all stay on one worker."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"RouterSpec.policy={self.policy!r}: sglang-router policies are {POLICIES}")
        if not self.worker_urls:
            raise ValueError("RouterSpec.worker_urls: a router needs at least one worker")

    def router_args(self, port: int, prometheus_port: int) -> dict[str, Any]:
        """Keyword arguments of ``sglang_router.router_args.RouterArgs`` (no API key)."""
        return dict(
            worker_urls=list(self.worker_urls),
            host=self.host,
            port=port,
            policy=self.policy,
            prometheus_host="127.0.0.1",
            prometheus_port=prometheus_port,
            health_check_interval_secs=self.health_check_interval_s,
            health_failure_threshold=self.health_failure_threshold,
            balance_abs_threshold=self.balance_abs_threshold,
            balance_rel_threshold=self.balance_rel_threshold,
            request_timeout_secs=self.request_timeout_s,
            worker_startup_timeout_secs=120,
            worker_startup_check_interval=1,
            shutdown_grace_period_secs=2,  # its 180 s default would hold every stop for minutes
            log_level="warn",
        )


class SGLangRouter(ChildProcess):
    """One sglang-router child process; a context manager that starts it and always stops it."""

    PORT_RETRIES = 3

    def __init__(self, spec: RouterSpec, log_path: str | Path, startup_timeout_s: float = 120.0):
        self.spec = spec
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.port = spec.port or 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    @property
    def url(self) -> str:
        return f"http://{'127.0.0.1' if self.spec.host in ('0.0.0.0', '') else self.spec.host}:{self.port}"

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle --------------------------------------------------------------------------------
    def launch(self) -> SGLangRouter:
        """Spawn the child (returns at once; see :meth:`wait_ready`)."""
        if self._proc is not None:
            raise RuntimeError(f"router already launched (pid {self._proc.pid})")
        self.port = self.spec.port or free_port(
            self.spec.host if self.spec.host != "0.0.0.0" else "127.0.0.1"
        )
        args = self.spec.router_args(self.port, free_port("127.0.0.1"))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 - closed in stop()
        self._log_file.write(f"# sglang-router {json.dumps(args)}\n".encode())
        preexec = _preexec(
            sys.platform == "linux" and threading.current_thread() is threading.main_thread(), None
        )
        # The driver's environment holds the key (rollout.api_key_env): the child gets it without.
        key = self.spec.api_key
        env = {k: v for k, v in os.environ.items() if not (key and v == key)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_bridge.router", json.dumps(args)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec,
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write(((self.spec.api_key or "") + "\n").encode())
        self._proc.stdin.close()
        register_child(self)
        return self

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until the router answers and holds every worker of the spec as healthy."""
        deadline = time.monotonic() + (self.startup_timeout_s if timeout_s is None else timeout_s)
        retries = self.PORT_RETRIES
        want = len(self.spec.worker_urls)
        while True:
            if not self.alive():
                tail = self.log_tail()
                self.stop()
                if self.spec.port is None and retries > 0 and "in use" in tail:
                    retries -= 1
                    self._proc = None
                    self.launch()
                    continue
                raise RouterError(f"sglang-router exited during start-up; log {self.log_path}:\n{tail}")
            with contextlib.suppress(OSError, ValueError, RouterError):
                ready = self._call("GET", "/readiness", timeout_s=2.0)
                if int(ready.get("healthy_workers", 0)) >= want:
                    return
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise RouterError(
                    f"sglang-router not ready with {want} healthy worker(s) after "
                    f"{self.startup_timeout_s:.0f} s; log {self.log_path}:\n{tail}"
                )
            time.sleep(0.2)

    def start(self) -> SGLangRouter:
        self.launch()
        self.wait_ready()
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the child's process group, SIGKILL after ``grace_s``. Idempotent."""
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace_s)
        unregister_child(self)
        if self._log_file is not None:
            with contextlib.suppress(Exception):
                self._log_file.close()
            self._log_file = None

    # -- workers ----------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict | None = None, timeout_s: float = 10.0) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.spec.api_key:
            req.add_header("Authorization", f"Bearer {self.spec.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise RouterError(f"sglang-router {method} {path} -> HTTP {e.code}: {e.read()[:300]!r}") from e
        return json.loads(raw) if raw else {}

    def workers(self) -> dict[str, dict[str, Any]]:
        """``{url: {"id", "is_healthy", "load", ...}}`` of the workers the router holds."""
        return {w["url"]: w for w in self._call("GET", "/workers").get("workers", [])}

    def loads(self) -> dict[str, int]:
        """Requests the router has in flight on each worker."""
        return {url: int(w.get("load", 0)) for url, w in self.workers().items()}

    def add_worker(self, url: str, timeout_s: float = 60.0) -> None:
        """Add ``url`` (a healthy server) and wait until the router routes to it."""
        if url not in self.workers():
            body: dict[str, Any] = {"url": url}
            if self.spec.api_key:  # else the router reaches this worker without the key (it warns)
                body["api_key"] = self.spec.api_key
            self._call("POST", "/workers", body)
        self._wait(lambda w: url in w and bool(w[url].get("is_healthy")), f"add worker {url}", timeout_s)

    def remove_worker(self, url: str, timeout_s: float = 30.0) -> None:
        """Take ``url`` out of rotation (a no-op if the router does not hold it) and wait until it is gone."""
        held = self.workers().get(url)
        if held is None:
            return
        self._call("DELETE", f"/workers/{urllib.parse.quote(str(held['id']), safe='')}")
        self._wait(lambda w: url not in w, f"remove worker {url}", timeout_s)

    def _wait(self, done: Any, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done(self.workers()):
            if time.monotonic() > deadline or not self.alive():
                raise RouterError(
                    f"sglang-router did not {what} within {timeout_s:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.1)


class LoadSampler:
    """Samples the router's per-worker loads while a rollout runs (an ``async with`` block):
    :meth:`means` is each worker's mean number of requests in flight over the samples. ``on_tick``
    (an async callable) runs after each sample, e.g. to take a dead server out of rotation."""

    def __init__(self, router: SGLangRouter, interval_s: float = 0.25, on_tick: Any = None):
        self.router, self.interval_s, self.on_tick = router, interval_s, on_tick
        self._sums: dict[str, float] = {}
        self._count = 0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            try:
                loads = await asyncio.to_thread(self.router.loads)
            except (OSError, ValueError, RouterError):
                loads = {}
            for url, n in loads.items():
                self._sums[url] = self._sums.get(url, 0.0) + n
            self._count += 1 if loads else 0
            if self.on_tick is not None:
                await self.on_tick()
            await asyncio.sleep(self.interval_s)

    async def __aenter__(self) -> LoadSampler:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def means(self) -> dict[str, float]:
        return {u: s / self._count for u, s in self._sums.items()} if self._count else {}


def main(argv: list[str] | None = None) -> None:
    """The child: run one router with the JSON ``RouterArgs`` of argv[1] and the key on stdin."""
    argv = sys.argv[1:] if argv is None else argv
    kwargs = json.loads(argv[0])
    key = sys.stdin.readline().rstrip("\n") or None
    # Not sglang_router.launch_router: it imports the Python mini load balancer and with it much of
    # SGLang (~50 s on a busy 2-core machine, against ~1 s for the Rust router alone).
    from sglang_router.router import Router
    from sglang_router.router_args import RouterArgs

    Router.from_args(RouterArgs(**kwargs, api_key=key)).start()


if __name__ == "__main__":
    main()


__all__ = ["POLICIES", "LoadSampler", "RouterError", "RouterSpec", "SGLangRouter"]
