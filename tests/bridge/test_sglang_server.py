"""Real SGLang server on loopback: generation with log-probs, temperature semantics, faults, clean-up."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from bridge_helpers import PROMPTS, hf_logprobs, load_hf

from sglang_bridge.client import SamplingParams, ServerGoneError, SGLangClient
from sglang_bridge.server import ServerSpec, ServerStartError, SGLangServer
from sglang_bridge.server_spec import host_cores


def test_generate_logprobs_match_transformers(sglang_server: SGLangServer, tiny_ckpt: Path) -> None:
    # Tests that change the served weights restore the checkpoint's before they end.
    model = load_hf(tiny_ckpt)

    async def go(params: SamplingParams) -> list[list]:
        async with SGLangClient(sglang_server.url) as c:
            return await c.generate(PROMPTS, params, n=2)

    for temperature in (1.0, 0.6):
        groups = asyncio.run(go(SamplingParams(temperature=temperature, max_new_tokens=8, ignore_eos=True)))
        assert [len(g) for g in groups] == [2, 2, 2]
        for p, g in zip(PROMPTS, groups, strict=True):
            for s in g:
                assert s.prompt_ids == p and len(s.output_ids) == 8 == len(s.rollout_logprobs)
                assert s.finish_reason == "length"
                # SGLang's default: log-probs after temperature scaling.
                assert s.logprob_temperature == temperature
                ref = hf_logprobs(model, [p], [s.output_ids], temperature)[0]
                assert max(abs(a - b) for a, b in zip(s.rollout_logprobs, ref, strict=True)) < 1e-2
                if temperature != 1.0:  # and clearly not the un-tempered ones
                    untempered = hf_logprobs(model, [p], [s.output_ids], 1.0)[0]
                    assert max(abs(a - b) for a, b in zip(s.rollout_logprobs, untempered, strict=True)) > 5e-2


def test_greedy_logprobs_are_untempered(sglang_server: SGLangServer, tiny_ckpt: Path) -> None:
    model = load_hf(tiny_ckpt)

    async def go() -> list[list]:
        async with SGLangClient(sglang_server.url) as c:
            return await c.generate(
                PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
            )

    s = asyncio.run(go())[0][0]
    assert s.logprob_temperature == 1.0
    ref = hf_logprobs(model, [s.prompt_ids], [s.output_ids], 1.0)[0]
    assert max(abs(a - b) for a, b in zip(s.rollout_logprobs, ref, strict=True)) < 1e-2


def test_batched_requests_keep_samples_in_order(sglang_server: SGLangServer, tiny_ckpt: Path) -> None:
    # One /generate per sample vs batches that split prompt groups (3 prompts x 2 samples, 4 per
    # request): greedy outputs must land on their own prompt, with that prompt's log-probs.
    model = load_hf(tiny_ckpt)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)

    async def go(per_request: int) -> list[list]:
        async with SGLangClient(sglang_server.url, samples_per_request=per_request) as c:
            return await c.generate(PROMPTS, params, n=2)

    single, batched = asyncio.run(go(1)), asyncio.run(go(4))
    assert [len(g) for g in batched] == [2, 2, 2]
    for p, g1, g4 in zip(PROMPTS, single, batched, strict=True):
        for a, b in zip(g1, g4, strict=True):
            assert a.prompt_ids == b.prompt_ids == p
            assert a.output_ids == b.output_ids and len(b.rollout_logprobs) == 6
        ref = hf_logprobs(model, [p], [g4[0].output_ids], 1.0)[0]
        assert max(abs(x - y) for x, y in zip(g4[0].rollout_logprobs, ref, strict=True)) < 1e-2


def test_server_killed_mid_request_gives_clear_error(victim_server: SGLangServer) -> None:
    async def go() -> None:
        async with SGLangClient(victim_server.url, retries=2, backoff_s=0.2, timeout_s=60) as c:
            params = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True)
            task = asyncio.ensure_future(c.generate([PROMPTS[0]] * 4, params))
            await asyncio.sleep(1.0)
            victim_server.kill()
            # wait_for is only a hang guard: the error must come from the client, not from here.
            with pytest.raises(ServerGoneError, match=victim_server.url):
                await asyncio.wait_for(task, timeout=120)
            with pytest.raises(ServerGoneError, match="is it still running"):
                await asyncio.wait_for(c.generate_one(PROMPTS[0], params), timeout=120)

    asyncio.run(go())
    assert not victim_server.alive()


def test_start_failure_names_server_and_shows_log(tmp_path: Path, tiny_ckpt: Path) -> None:
    with pytest.raises(ServerStartError, match="bad-server: model path .* has no config.json"):
        SGLangServer(
            ServerSpec(model_path=str(tmp_path / "missing")), tmp_path / "a.log", name="bad-server"
        ).launch()
    spec = ServerSpec(model_path=str(tiny_ckpt), extra_args=("--no-such-flag",))
    srv = SGLangServer(spec, tmp_path / "bad.log", startup_timeout_s=120, name="bad-server")
    with pytest.raises(ServerStartError, match=r"bad-server:\d+ exited during start-up") as info:
        with srv:
            pass
    assert "--no-such-flag" in str(info.value)  # the log tail says what went wrong
    assert not srv.alive()


def _thread_affinities(root: psutil.Process) -> dict[int, frozenset[int]]:
    """Affinity of every thread of ``root``'s process tree (threads that end meanwhile are skipped)."""
    out: dict[int, frozenset[int]] = {}
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(FileNotFoundError):
            for task in Path(f"/proc/{p.pid}/task").iterdir():
                with contextlib.suppress(ProcessLookupError, FileNotFoundError):
                    out[int(task.name)] = frozenset(os.sched_getaffinity(int(task.name)))
    assert out
    return out


def test_server_cpus_bind_every_process_and_thread(tmp_path: Path, tiny_ckpt: Path) -> None:
    """``ServerSpec.cpus`` is the child's affinity from before SGLang starts: every process and thread
    of the server's tree runs on those cores (threads made later inherit it), and it serves."""
    core = (os.cpu_count() or 1) - 1
    mine = os.sched_getaffinity(0)
    spec = ServerSpec(model_path=str(tiny_ckpt), device="cpu", cpus=(core,))
    with SGLangServer(spec, tmp_path / "pinned.log", startup_timeout_s=240) as srv:
        assert srv.pid is not None
        root = psutil.Process(srv.pid)
        assert len(root.children(recursive=True)) >= 2  # the scheduler and the detokenizer
        assert set(_thread_affinities(root).values()) == {frozenset({core})}

        async def go() -> None:
            async with SGLangClient(srv.url, timeout_s=120) as c:
                out = await c.generate_one(
                    PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)
                )
                assert len(out.output_ids) == 4 and len(out.rollout_logprobs) == 4

        asyncio.run(go())
        # Threads SGLang started for that request (if any) were made on the core too.
        assert set(_thread_affinities(root).values()) == {frozenset({core})}
    assert os.sched_getaffinity(0) == mine  # only the child was bound


def test_server_cpus_the_child_cannot_take_fail_with_the_field_named(
    tmp_path: Path, tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(pid: int, cpus: object) -> None:  # what a cpuset that excludes the cores answers
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)  # the forked child runs the patched copy
    srv = SGLangServer(ServerSpec(model_path=str(tiny_ckpt), cpus=(0,)), tmp_path / "x.log", name="s")
    with pytest.raises(
        ServerStartError, match=r"s:\d+: could not bind the server to cores \[0\] \(ServerSpec.cpus"
    ):
        srv.launch()
    assert not srv.alive()


def test_server_cpus_are_checked_before_launch(tmp_path: Path) -> None:
    for bad in ((), (0, 0), (-1,)):
        with pytest.raises(ValueError, match=r"ServerSpec.cpus=.*distinct core numbers"):
            ServerSpec(model_path="m", cpus=bad)
    n = max(host_cores()) + 1
    srv = SGLangServer(ServerSpec(model_path="m", cpus=(0, n)), tmp_path / "x.log")
    with pytest.raises(ValueError, match=rf"cores \[{n}\] do not exist on this host or in this job's cpuset"):
        srv.launch()
    assert not srv.alive()


_SIGNALLED_PARENT = r"""
import signal, sys, time
from sglang_bridge.server import ServerSpec, SGLangServer

# What an interactive process has (a background job's shell may have passed SIGINT on ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
with SGLangServer(ServerSpec(model_path=sys.argv[1]), sys.argv[2], startup_timeout_s=240) as srv:
    untouched = (
        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    print(srv.pid, untouched, flush=True)
    time.sleep(600)
"""


def _gone(p: psutil.Process) -> bool:
    """Exited (a zombie whose new parent has not reaped it yet counts as exited)."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# SIGINT takes the same path as SIGTERM (one handler): the second case runs in the slow tier only.
@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)], ids=["SIGTERM", "SIGINT"]
)
def test_a_signalled_parent_leaves_no_server_behind(sig: int, tmp_path: Path, tiny_ckpt: Path) -> None:
    """The bridge installs no signal handler (SIGTERM / SIGINT belong to the entry point, which calls
    ``stop_all_servers``). A process that started a real server through it and gets SIGTERM (the
    default action: gone at once; the server follows through PR_SET_PDEATHSIG) or SIGINT
    (KeyboardInterrupt: the context manager stops the server) leaves none of the server's processes."""
    log = tmp_path / "server.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", _SIGNALLED_PARENT, str(tiny_ckpt), str(log)], stdout=subprocess.PIPE, text=True
    )
    tree: list[psutil.Process] = []
    try:
        line = parent.stdout.readline() if parent.stdout else ""  # once the server is healthy
        assert line, f"the parent exited before its server was up; log:\n{log.read_text()[-3000:]}"
        pid, untouched = line.split()
        assert untouched == "True"  # starting a server left the process's signal handlers alone
        root = psutil.Process(int(pid))
        tree = [root, *root.children(recursive=True)]
        assert len(tree) >= 3  # the server, its scheduler and its detokenizer
        parent.send_signal(sig)
        assert parent.wait(timeout=120) == -sig  # died of the signal: nothing caught it
        deadline = time.monotonic() + 60
        while not all(_gone(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p.pid for p in tree if not _gone(p)] == []
    finally:
        if parent.poll() is None:
            parent.kill()
        for p in tree:  # whatever a failure left behind
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


@pytest.mark.parametrize(
    "hung", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["stopped", "SIGSTOPped-then-killed"]
)
def test_a_stopped_server_leaves_none_of_its_shared_memory(
    hung: bool, tmp_path: Path, tiny_ckpt: Path
) -> None:
    """Issue #36 item 10: each start left a ``sglang_loads_*.shm`` and a ``sem.mp-*`` in /dev/shm (a
    killed tree never unlinks them). Stopping removes the files the server's own processes held --
    and only those: /dev/shm is shared with every other process on the host."""
    from sglang_bridge import proctree

    srv = SGLangServer(
        ServerSpec(model_path=str(tiny_ckpt), device="cpu"), tmp_path / "s.log", startup_timeout_s=240
    )
    with srv:
        assert srv.pid is not None
        held = proctree.shm_files([srv.pid, *(p for p, _ in proctree.descendants(srv.pid))])
        names = {p.name for p in held}
        assert any(n.startswith("sglang_loads_") for n in names), names  # what used to leak
        if hung:
            os.killpg(srv.pid, signal.SIGSTOP)  # a hung server: killed, not asked
    after = set(os.listdir("/dev/shm"))
    assert not (names & after), sorted(names & after)  # none of its own is left
