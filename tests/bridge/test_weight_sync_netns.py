"""Multi-node weight sync: a server on another "node" joins the trainer's update group at the trainer's
routable address, and a real weight sync arrives.

The other node is a second network namespace joined to this one by a veth pair: its loopback is not
the trainer's, so a server told to dial 127.0.0.1 (what the engine did before it passed
``master_address``) reaches nothing there; only the address of the trainer's interface towards the
server works. One real SGLang CPU server runs inside the namespace (``ip netns exec``), keyed and
bound to its veth address; the driver's own :class:`RolloutServers` meets it through
``rollout.server_urls``, as a multi-node launch does, and pushes perturbed weights, which the
server's log-probs must then follow.

Needs root and iproute2 (``ip netns``, ``veth``); skips with the reason where a namespace cannot be
made. The server, the veth pair and the namespace are removed whatever happens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from bridge_helpers import PROMPTS, hf_logprobs, hf_named_tensors, load_hf

from megatron_acrl.config import Config
from megatron_acrl.servers.handle import RolloutServers
from sglang_bridge.server_key import KeyFile, new_api_key
from sglang_bridge.server_spec import ServerSpec
from sglang_bridge.weight_sync import Manifest

pytestmark = pytest.mark.timeout(900)

KEY_ENV = "ACRL_NETNS_TEST_KEY"
PORT = 31000  # the namespace is fresh: every port in it is free


@dataclasses.dataclass(frozen=True)
class Netns:
    name: str
    host_ip: str  # this namespace's end of the veth pair: the trainer's routable address
    ns_ip: str  # the other node's address
    ns_if: str  # and its interface


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


@pytest.fixture()
def netns() -> Iterator[Netns]:
    """A network namespace joined to this one by a veth pair (10.213.N.1 here, .2 there)."""
    if shutil.which("ip") is None:
        pytest.skip(
            "iproute2 is not installed (apt-get install iproute2): no `ip netns` to make a second node"
        )
    if os.geteuid() != 0:
        pytest.skip("creating a network namespace needs root")
    tag = os.getpid() % 100000
    name, host_if, ns_if = f"acrl-ns{tag}", f"acrlh{tag}", f"acrln{tag}"  # interface names <= 15 chars
    net = f"10.213.{tag % 250}"
    made = _ip("netns", "add", name)
    if made.returncode:
        pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
    try:
        for cmd in (
            ("link", "add", host_if, "type", "veth", "peer", "name", ns_if),
            ("link", "set", ns_if, "netns", name),
            ("addr", "add", f"{net}.1/24", "dev", host_if),
            ("link", "set", host_if, "up"),
            ("-n", name, "addr", "add", f"{net}.2/24", "dev", ns_if),
            ("-n", name, "link", "set", ns_if, "up"),
            ("-n", name, "link", "set", "lo", "up"),  # SGLang's own processes talk over loopback
        ):
            res = _ip(*cmd)
            if res.returncode:
                pytest.skip(
                    f"cannot wire a veth pair into the namespace (ip {' '.join(cmd)}): {res.stderr.strip()}"
                )
        yield Netns(name, f"{net}.1", f"{net}.2", ns_if)
    finally:
        _ip("link", "del", host_if)  # removes both ends (gone already if the namespace took the pair)
        _ip("netns", "del", name)


@contextlib.contextmanager
def server_in(ns: Netns, model: Path, key: str, log: Path) -> Iterator[str]:
    """One keyed SGLang CPU server inside ``ns``, bound to its veth address; yields its URL."""
    spec = ServerSpec(model_path=str(model), device="cpu", host=ns.ns_ip, port=PORT, api_key=key)
    key_file = KeyFile(key)
    cmd = ["ip", "netns", "exec", ns.name, *spec.command(PORT, key_file.write())]
    # A CPU server's gloo end binds the interface GLOO_SOCKET_IFNAME names, else its host name's
    # address (127.0.0.1 here, in either namespace): a CPU node of a multi-node job names its own
    # (NCCL, on GPUs, picks a routable interface itself). The trainer's end needs nothing: it binds
    # the interface of the address the servers dial (update_group.gloo_device_on).
    env = {**spec.env(), "GLOO_SOCKET_IFNAME": ns.ns_if}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        url = f"http://{ns.ns_ip}:{PORT}"
        _wait_healthy(proc, url, key, log)
        yield url
    finally:
        key_file.remove()
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):  # the group: scheduler, detokenizer
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)


def _wait_healthy(
    proc: subprocess.Popen[bytes], url: str, key: str, log: Path, timeout_s: float = 600
) -> None:
    deadline = time.monotonic() + timeout_s
    req = urllib.request.Request(url + "/model_info", headers={"Authorization": f"Bearer {key}"})
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"the server in the namespace exited (rc={proc.returncode}):\n{log.read_text()[-3000:]}"
            )
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(req, timeout=2.0) as r:
                if r.status == 200:
                    return
        time.sleep(1.0)
    pytest.fail(
        f"the server in the namespace was not healthy after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}"
    )


def test_a_server_on_another_node_joins_at_the_trainers_routable_address(
    netns: Netns, tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = new_api_key()
    monkeypatch.setenv(KEY_ENV, key)
    with server_in(netns, tiny_ckpt, key, tmp_path / "sglang-netns.log") as url:
        cfg = Config()
        cfg = dataclasses.replace(
            cfg,
            rollout=dataclasses.replace(
                cfg.rollout, server_urls=(url,), api_key_env=KEY_ENV, quantization="none", device="cpu",
                startup_timeout_s=120.0, request_timeout_s=120.0,
            ),
        )  # fmt: skip
        servers = RolloutServers(cfg, tiny_ckpt, tmp_path / "logs", single_node=False)
        try:
            # the update group's store is hosted (and bound) at the trainer's interface towards the
            # server, and that is the address the server was told to dial
            assert servers.address == netns.host_ip
            assert servers.synchronizer is not None and servers.synchronizer.master_address == netns.host_ip
            manifest = Manifest.from_checkpoint(tiny_ckpt)
            g = torch.Generator().manual_seed(11)
            v1 = hf_named_tensors(load_hf(tiny_ckpt, dtype=torch.bfloat16), manifest)
            v2 = {
                k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in v1.items()
            }
            metrics = servers.update_weights(v2.items(), "v2-over-veth")
            assert metrics["sync/tensors"] == len(manifest) and metrics["sync/bytes"] > 0
            new_model, old_model = load_hf(tiny_ckpt, v2), load_hf(tiny_ckpt)
            sync = servers.synchronizer
            rep = sync.verify(PROMPTS, lambda p, o, t: hf_logprobs(new_model, p, o, t))
            assert rep.version == "v2-over-veth" and rep.ok(1e-2), rep
            # the served weights really changed: the old model's log-probs no longer match
            assert not sync.verify(PROMPTS, lambda p, o, t: hf_logprobs(old_model, p, o, t)).ok(1e-2)
        finally:
            servers.close()
