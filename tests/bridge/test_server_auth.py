"""A keyed SGLang server: the key is in no command line, no environment, no file, no log line; every
endpoint but /health refuses a request without it; every listener of its process tree is on
loopback; a second server asked for its port is refused, naming it. One real CPU server, shared."""

from __future__ import annotations

import datetime
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from security_helpers import cmdlines_holding, environs_holding, not_on_loopback, process_tree

from sglang_bridge.listeners import BoundTCPStore, address_towards, bind_address, is_loopback, port_holder
from sglang_bridge.server import PortInUse, ServerSpec, SGLangServer, answers_anonymous, probe
from sglang_bridge.server_key import REDACTED, KeyFile, Redactor, new_api_key

# ---- pieces, no server ---------------------------------------------------------------------------


def test_redactor_hides_a_secret_split_at_every_boundary() -> None:
    key = "s3cr3t-KEY_abc"
    text = f"server_args={{'api_key': '{key}', 'x': 1}} again {key}{key} and k".encode()
    for cut in range(len(text) + 1):
        r = Redactor([key])
        out = r.feed(text[:cut]) + r.feed(text[cut:]) + r.flush()
        assert key.encode() not in out and out.count(REDACTED) == 3, cut
    r = Redactor([key])  # byte by byte: nothing of the key ever leaves the filter
    out = b"".join(r.feed(bytes([b])) for b in text) + r.flush()
    assert out == text.replace(key.encode(), REDACTED)
    assert Redactor([""]).feed(b"plain") == b"plain"


@pytest.mark.parametrize("key", [new_api_key(), "true", "1e3", "a: b # c", "ключ"])
def test_key_file_is_private_and_reads_back_as_the_exact_key(key: str) -> None:
    kf = KeyFile(key)
    path = kf.write()
    assert path.suffix == ".yaml" and os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(path.parent).st_mode & 0o777 == 0o700
    assert yaml.safe_load(path.read_text()) == {"api-key": key}  # what SGLang's --config reads
    kf.remove()
    assert not path.parent.exists()
    kf.remove()  # idempotent


def test_spec_puts_the_key_in_its_file_only_and_refuses_an_unkeyed_open_bind() -> None:
    key = new_api_key()
    os.environ["ACRL_TEST_SPEC_KEY"] = key
    try:
        spec = ServerSpec(model_path="m", api_key=key)
        with pytest.raises(ValueError, match="key_file"):
            spec.command(1)
        cmd = spec.command(1, "/k.yaml")
        assert key not in " ".join(cmd) and cmd[cmd.index("--config") + 1] == "/k.yaml"
        assert "--api-key" not in cmd and key not in spec.env().values()
    finally:
        del os.environ["ACRL_TEST_SPEC_KEY"]
    with pytest.raises(ValueError, match="api_key"):
        ServerSpec(model_path="m", host="0.0.0.0")
    ServerSpec(model_path="m", host="0.0.0.0", api_key=key)  # keyed: allowed


def test_bound_store_listens_on_its_address_only() -> None:
    store = BoundTCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert not not_on_loopback([os.getpid()])
    assert f"pid {os.getpid()}" in port_holder(store.port)
    assert is_loopback("localhost") and is_loopback("::1") and not is_loopback("10.0.0.1")
    assert bind_address("0.0.0.0")[1] == "0.0.0.0" and bind_address("localhost")[1] == "127.0.0.1"
    assert address_towards("http://127.0.0.1:30000") == "127.0.0.1"


# ---- one keyed server ---------------------------------------------------------------------------

KEY = new_api_key()


@pytest.fixture(scope="module")
def keyed(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    logs = tmp_path_factory.mktemp("keyed") / "logs"
    old = os.umask(0o022)  # the modes below must not depend on the caller's umask
    try:
        srv = SGLangServer(ServerSpec(model_path=str(tiny_ckpt), api_key=KEY), logs / "sglang.log", 300)
        with srv:
            yield srv
    finally:
        os.umask(old)


def _call(url: str, path: str, key: str | None, body: dict | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    method = "GET" if body is None else "POST"
    req = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_key_is_in_no_command_line_environment_or_file(keyed: SGLangServer) -> None:
    tree = process_tree(keyed.pid or 0)
    assert len(tree) >= 3  # the launcher, the scheduler, the detokenizer (and a resource tracker)
    assert not cmdlines_holding(KEY, tree) and not environs_holding(KEY, tree)
    assert keyed._key_file is not None and keyed._key_file.path is None  # removed once it answered
    log = keyed.log_path.read_bytes()
    assert KEY.encode() not in log and REDACTED in log  # SGLang printed its args; we redacted them
    assert os.stat(keyed.log_path).st_mode & 0o777 == 0o600
    assert os.stat(keyed.log_path.parent).st_mode & 0o777 == 0o700


def test_every_listener_of_the_server_is_on_loopback(keyed: SGLangServer) -> None:
    # HTTP, the scheduler's ZMQ ports and its TP group's TCP store (the bound_stores hook)
    assert not not_on_loopback(process_tree(keyed.pid or 0))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}),
        ("/update_weights_from_disk", {"model_path": "/tmp/elsewhere"}),
        ("/pause_generation", {"mode": "abort"}),
        (
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": 1,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "g",
                "backend": "gloo",
            },
        ),
        ("/model_info", None),
    ],
)
def test_requests_without_the_key_are_refused(keyed: SGLangServer, path: str, body: dict | None) -> None:
    assert _call(keyed.url, path, None, body) == 401
    assert _call(keyed.url, path, "not-" + KEY, body) == 401


def test_the_key_opens_it_and_health_needs_none(keyed: SGLangServer) -> None:
    assert _call(keyed.url, "/health", None) == 200
    assert not answers_anonymous(keyed.url)
    assert probe(keyed.url, KEY)[0]
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    assert _call(keyed.url, "/generate", KEY, body) == 200


def test_a_second_server_on_its_port_is_refused_naming_it(keyed: SGLangServer, tmp_path: Path) -> None:
    # Same model, same key even: the port is not free, so it is not this server's to take.
    spec = ServerSpec(model_path=keyed.spec.model_path, port=keyed.port, api_key=KEY)
    other = SGLangServer(spec, tmp_path / "other.log", startup_timeout_s=60)
    with pytest.raises(PortInUse, match=f"port {keyed.port} is held by pid {keyed.pid}") as err:
        other.launch()
    assert err.value.port == keyed.port and other.pid is None  # nothing was started
    assert probe(keyed.url, KEY)[0]  # and the first one is undisturbed


def test_a_key_that_begins_with_a_dash_is_refused_and_none_is_made():
    """SGLang turns its --config file into arguments, so a key "-x..." would read as an option (a
    server exited with "argument --api-key: expected one argument" when a random key began so)."""
    with pytest.raises(ValueError, match="begins with '-'"):
        ServerSpec(model_path="m", api_key="-leading")
    assert not any(new_api_key().startswith("-") for _ in range(2000))
