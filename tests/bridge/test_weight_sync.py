"""Weight sync into a real SGLang server over gloo: full sync, validation, fake-quant FP8, pause/continue."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time
import types
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import psutil
import pytest
import torch
import torch.multiprocessing as mp
from bridge_helpers import PROMPTS, hf_logprobs, hf_named_tensors, load_hf
from gloo_pair import gloo_group

from sglang_bridge.client import SamplingParams, SGLangClient
from sglang_bridge.fp8 import Fp8Scheme, fake_quantize, should_quantize
from sglang_bridge.fp8.block import _fake_quantize_block_reference, _quantize_block_reference
from sglang_bridge.server import SGLangServer, free_port
from sglang_bridge.weight_sync import (
    DistributedWeightSynchronizer,
    Manifest,
    ManifestMismatchError,
    WeightSyncError,
    WeightSyncTimeoutError,
    broadcast_async,
    host_update_store,
    inflight,
)
from sglang_bridge.weight_sync.buckets import Bucket, wire_entry
from sglang_bridge.weight_sync.inflight import InFlight as _InFlight

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def _generate(url: str, params: SamplingParams, prompts: list[list[int]] = PROMPTS) -> list:
    async def go() -> list:
        async with SGLangClient(url) as c:
            return [g[0] for g in await c.generate(prompts, params)]

    return asyncio.run(go())


def _max_delta(samples: list, model: torch.nn.Module) -> float:
    ref = hf_logprobs(
        model,
        [s.prompt_ids for s in samples],
        [s.output_ids for s in samples],
        samples[0].logprob_temperature,
    )
    return max(
        abs(a - b)
        for s, r in zip(samples, ref, strict=True)
        for a, b in zip(s.rollout_logprobs, r, strict=True)
    )


def _perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in base.items()}


@pytest.fixture()
def restore_v1(
    synchronizer: DistributedWeightSynchronizer, tiny_ckpt: Path, manifest: Manifest
) -> Iterator[dict]:
    """The checkpoint's weights; re-synced after the test whatever it did to the server."""
    v1 = hf_named_tensors(load_hf(tiny_ckpt, dtype=torch.bfloat16), manifest)
    yield v1
    synchronizer.sync(v1, version="v1-restored")


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_bucket_quantizes_in_place_like_the_reference(mode: str) -> None:
    """The packer writes FP8 straight into the flat bucket: same names, dtypes, shapes, order and bytes
    as the reference quantizers' tensors packed by plain copies (no server needed)."""
    scheme = Fp8Scheme("block", (32, 32))
    g = torch.Generator().manual_seed(0)
    named = [
        ("model.layers.0.mlp.up_proj.weight", torch.randn(64, 96, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(70, 40, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(64, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.gate.weight", torch.randn(8, 64, generator=g).to(torch.bfloat16)),  # router
        ("lm_head.bias", torch.randn(5, generator=g)),  # fp32: packed first for alignment
    ]
    ref: list[tuple[str, torch.Tensor]] = []
    for n, t in named:
        if not should_quantize(n, t, scheme):
            ref.append((n, t))
        elif mode == "fake":
            ref.append((n, _fake_quantize_block_reference(t, scheme.block_size)))
        else:
            q, sc = _quantize_block_reference(t, scheme.block_size)
            ref += [(n, q), (n[: -len("weight")] + "weight_scale_inv", sc)]
    entries = [wire_entry(n, t, scheme, mode) for n, t in named]  # type: ignore[arg-type]
    got = Bucket(entries, torch.full((sum(e.nbytes for e in entries),), 0xAB, dtype=torch.uint8))
    want = Bucket(ref, torch.empty(sum(t.numel() * t.element_size() for _, t in ref), dtype=torch.uint8))
    assert (got.names, got.dtypes, got.shapes) == (want.names, want.dtypes, want.shapes)
    assert torch.equal(got.flat, want.flat)
    assert got.seconds["fp8"] > 0 and got.seconds["copy"] > 0


def test_full_sync_then_logprobs_match_new_weights(
    synchronizer, sglang_server: SGLangServer, tiny_ckpt: Path, manifest: Manifest, restore_v1: dict
) -> None:
    v2 = _perturbed(restore_v1, seed=1)
    _generate(sglang_server.url, GREEDY)  # old-weight KV for these prompts now in the radix cache
    report = synchronizer.sync(v2, version="v2")  # the last bucket's request must flush it
    assert report.num_tensors == len(manifest) and report.fp8 == "none"
    assert synchronizer.version == "v2"
    samples = _generate(
        sglang_server.url, SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=7)
    )
    assert {s.weight_version for s in samples} == {"v2"}
    new_model, old_model = load_hf(tiny_ckpt, v2), load_hf(tiny_ckpt)
    assert _max_delta(samples, new_model) < 1e-2
    assert _max_delta(samples, old_model) > 0.1  # the update really changed the served weights
    # verify mode: the trainer's reference is a callable; a wrong mapping would show deltas ~1.
    rep = synchronizer.verify(PROMPTS, lambda p, o, t: hf_logprobs(new_model, p, o, t))
    assert rep.version == "v2" and rep.num_tokens == 8 * len(PROMPTS) and rep.ok(1e-2)
    assert not synchronizer.verify(PROMPTS, lambda p, o, t: hf_logprobs(old_model, p, o, t)).ok(1e-2)


@pytest.mark.parametrize("fault", ["unknown_name", "wrong_shape", "wrong_dtype", "tied_copy", "incomplete"])
def test_bad_update_is_rejected_and_old_version_keeps_serving(
    fault: str, synchronizer, sglang_server, restore_v1: dict
) -> None:
    before = _generate(sglang_server.url, GREEDY)
    version = synchronizer.version
    bad = dict(_perturbed(restore_v1, seed=2))
    name = "model.layers.0.mlp.down_proj.weight"
    if fault == "unknown_name":
        bad["model.layers.0.mlp.experts.gate_up_proj"] = bad.pop(name)
    elif fault == "wrong_shape":
        bad[name] = bad[name].t().contiguous()
    elif fault == "wrong_dtype":
        bad[name] = bad[name].float()
    elif fault == "tied_copy":
        bad["lm_head.weight"] = bad["model.embed_tokens.weight"]
    else:
        del bad[name]
    with pytest.raises(ManifestMismatchError, match="nothing sent"):
        synchronizer.sync(bad, version="bad")
    after = _generate(sglang_server.url, GREEDY)  # not paused, same weights, same version
    assert [s.output_ids for s in after] == [s.output_ids for s in before]
    assert [s.rollout_logprobs for s in after] == [s.rollout_logprobs for s in before]
    assert {s.weight_version for s in after} == {s.weight_version for s in before}
    assert synchronizer.version == version


def test_failed_stream_leaves_server_paused_and_retry_recovers(
    synchronizer, sglang_server, manifest, restore_v1: dict
) -> None:
    v3 = _perturbed(restore_v1, seed=3)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:  # one-shot: validated tensor by tensor
        for i, (k, v) in enumerate(v3.items()):
            yield (k + ".typo" if i == len(v3) - 2 else k), v

    small = DistributedWeightSynchronizer([sglang_server.url], manifest, bucket_size_mb=0.01, timeout_s=120)
    small.connect()
    try:
        with pytest.raises(WeightSyncError, match="PAUSED"):
            small.sync(stream(), version="v3-broken")
        assert asyncio.run(_version(sglang_server.url)) != "v3-broken"
        report = small.sync(iter(list(v3.items())), version="v3")  # retry with good weights
        assert report.num_buckets > 1
    finally:
        small.close()
    samples = _generate(sglang_server.url, GREEDY)
    assert {s.weight_version for s in samples} == {"v3"}
    assert _max_delta(samples, load_hf(sglang_server.spec.model_path, v3)) < 1e-2


@pytest.mark.parametrize("which", ["second", "last"])
def test_refused_bucket_fails_fast_and_a_new_group_recovers(
    sglang_server, manifest, restore_v1: dict, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """A server that refuses a bucket never joins its broadcast. With the next request (a bucket, or
    /end_weight_update after the last one) pipelined behind it, the sync must see the refusal and
    send nothing more (the server would pair a later bucket's bytes with the refused broadcast),
    leave the server paused on the old version, and a reconnected synchronizer must recover."""
    v4 = _perturbed(restore_v1, seed=4)
    posted: list[Bucket] = []
    post = DistributedWeightSynchronizer._post_bucket

    def refuse(self: DistributedWeightSynchronizer, bucket: Bucket, idx: int) -> object:
        posted.append(bucket)
        if (len(posted) == 2) if which == "second" else bucket.last:
            bucket.dtypes = ["float99", *bucket.dtypes[1:]]  # the server cannot build it: it answers
        return post(self, bucket, idx)

    broken = DistributedWeightSynchronizer([sglang_server.url], manifest, bucket_size_mb=0.01, timeout_s=60)
    broken.connect()
    monkeypatch.setattr(DistributedWeightSynchronizer, "_post_bucket", refuse)
    ends: list[int] = []
    end = SGLangClient.end_weight_update

    async def count_end(self: SGLangClient) -> object:
        ends.append(1)
        return await end(self)

    monkeypatch.setattr(SGLangClient, "end_weight_update", count_end)
    try:
        with pytest.raises(WeightSyncError, match="PAUSED") as err:
            broken.sync(v4, version="v4-refused")
        assert "float99" in str(err.value) or "receive" in str(err.value)
        assert posted[-1].dtypes[0] == "float99" and not ends  # nothing was sent after the refusal
        assert asyncio.run(_version(sglang_server.url)) != "v4-refused"
    finally:
        monkeypatch.undo()
        broken.close()
    fresh = DistributedWeightSynchronizer([sglang_server.url], manifest, bucket_size_mb=0.01, timeout_s=60)
    fresh.connect()
    try:
        assert fresh.sync(v4, version="v4").num_buckets > 2
    finally:
        fresh.close()
    samples = _generate(sglang_server.url, GREEDY)
    assert {s.weight_version for s in samples} == {"v4"}
    assert _max_delta(samples, load_hf(sglang_server.spec.model_path, v4)) < 1e-2


def test_hung_server_times_out_once_and_a_new_group_recovers(
    sglang_server, manifest, restore_v1: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that stops mid-update (its scheduler frozen with SIGSTOP as the second bucket is
    posted) never joins that broadcast. The sync must fail with :class:`WeightSyncTimeoutError`
    after one timeout, without waiting for the bucket still in flight, leave the server paused on
    the old version, and say to reconnect: a retry on the same group fails once the server resumes
    (its end of the group was closed under the stale request), a new synchronizer recovers."""
    v5 = _perturbed(restore_v1, seed=5)
    scheduler = next(
        p for p in psutil.Process(sglang_server.pid).children(recursive=True) if "scheduler" in p.name()
    )
    posted: list[_InFlight] = []
    finished: list[Bucket] = []
    post, finish = DistributedWeightSynchronizer._post_bucket, DistributedWeightSynchronizer._finish_bucket

    def freeze_after_second(self: DistributedWeightSynchronizer, bucket: Bucket, idx: int) -> _InFlight:
        if len(posted) == 1:  # before posting: the request then reaches a scheduler that never runs
            scheduler.suspend()
        posted.append(post(self, bucket, idx))
        return posted[-1]

    def spy_finish(self: DistributedWeightSynchronizer, f: _InFlight, *a: object) -> int:
        finished.append(f.bucket)
        return finish(self, f, *a)

    hung = DistributedWeightSynchronizer([sglang_server.url], manifest, bucket_size_mb=0.01, timeout_s=3)
    hung.connect()
    monkeypatch.setattr(DistributedWeightSynchronizer, "_post_bucket", freeze_after_second)
    monkeypatch.setattr(DistributedWeightSynchronizer, "_finish_bucket", spy_finish)
    try:
        try:
            with pytest.raises(WeightSyncTimeoutError, match="PAUSED") as err:
                hung.sync(v5, version="v5-hung")
            # The trainer's end of the frozen broadcast gives up after the group's timeout (timeout_s,
            # like the sync's own deadline): resume the server only after that, as a hung one would.
            for _ in range(3000):
                if posted[-1].work.is_completed():
                    break
                time.sleep(0.01)
        finally:
            scheduler.resume()
            monkeypatch.undo()
        assert "connect() a new one" in str(err.value) and isinstance(err.value, TimeoutError)
        assert len(posted) == 2 and posted[1].bucket not in finished  # the frozen bucket: not drained
        # Why the advice: with that broadcast given up, the same group cannot carry a retry.
        with pytest.raises(WeightSyncError, match="PAUSED"):
            hung.sync(v5, version="v5-same-group")
    finally:
        hung.close()
    assert asyncio.run(_version(sglang_server.url)) != "v5-hung"
    fresh = DistributedWeightSynchronizer([sglang_server.url], manifest, bucket_size_mb=0.01, timeout_s=60)
    fresh.connect()
    try:
        fresh.sync(v5, version="v5")
    finally:
        fresh.close()
    samples = _generate(sglang_server.url, GREEDY)
    assert {s.weight_version for s in samples} == {"v5"}
    assert _max_delta(samples, load_hf(sglang_server.spec.model_path, v5)) < 1e-2


class _CountingFuture:
    """Stands in for a bucket's answers that never come: records each wait and advances the fake
    clock by it instead of sleeping."""

    def __init__(self, clock: list[float]):
        self.clock = clock
        self.waits: list[float] = []

    def result(self, timeout: float) -> None:
        self.waits.append(timeout)
        self.clock[0] += timeout
        raise concurrent.futures.TimeoutError


@pytest.mark.parametrize("error", [ValueError("refused"), WeightSyncTimeoutError("not received")])
def test_drain_after_a_failure_shares_one_timeout_and_skips_after_a_timeout(
    manifest: Manifest, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    """Buckets still in flight after a failure are waited for (so a retry cannot overtake them)
    within one shared ``timeout_s``, not ``timeout_s`` each; after a timeout not at all."""
    clock = [100.0]
    monkeypatch.setattr(inflight, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    sync = DistributedWeightSynchronizer(["http://127.0.0.1:9"], manifest, timeout_s=10)
    try:
        bucket = Bucket([], torch.empty(0, dtype=torch.uint8))
        futs = [_CountingFuture(clock) for _ in range(2)]
        flights = [_InFlight(bucket, i, f, None) for i, f in enumerate(futs)]  # type: ignore[arg-type]
        sync._drain(flights, error)
    finally:
        sync.close()
    waits = [w for f in futs for w in f.waits]
    if isinstance(error, TimeoutError):
        assert waits == []
    else:
        assert waits == [10.0, 0.0]  # the first used the whole budget; none is left for the second


class _FailedBroadcast:
    """A broadcast the group's own timeout ended: complete, and waiting on it raises."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: object = None) -> bool:
        raise RuntimeError("Timed out waiting 3000ms for send operation to complete")


def test_a_broadcast_that_failed_is_not_taken_for_joined(manifest: Manifest) -> None:
    """The group's timeout and the sync's deadline are both ``timeout_s``: a broadcast a hung server
    never joined may be ended by the group first. It must fail the sync as a timeout, not let the
    next bucket go out, and not wait for the silent server's answer."""
    sync = DistributedWeightSynchronizer(["http://127.0.0.1:9"], manifest, timeout_s=10)
    try:
        bucket = Bucket([], torch.empty(0, dtype=torch.uint8))
        f = _InFlight(bucket, 0, concurrent.futures.Future(), _FailedBroadcast())  # type: ignore[arg-type]
        with pytest.raises(WeightSyncTimeoutError, match="bucket not received"):
            sync._await_joined(f)
        assert not f.loaded
    finally:
        sync.close()


def _gloo_broadcast_rank(rank: int, port: int, path: str) -> None:
    done = []
    with gloo_group(rank, port, "join-test") as group:
        for n in (16, 1 << 20):
            t = torch.zeros(n, dtype=torch.uint8)
            if rank == 0:
                work = broadcast_async(t, group)
                time.sleep(0.5)  # the receiver joins only after 1 s
                done.append(work.is_completed())
                work.wait()
            else:
                time.sleep(1.0)
                broadcast_async(t, group).wait()
    if rank == 0:
        torch.save(done, path)


def test_gloo_root_finishes_a_broadcast_only_once_the_receiver_joins(tmp_path: Path) -> None:
    """What the pipelined sync's ordering rests on: until every server has joined a bucket's
    broadcast, the trainer's side of it is not complete, however small the bucket."""
    path = str(tmp_path / "done.pt")
    mp.start_processes(_gloo_broadcast_rank, args=(free_port(), path), nprocs=2, start_method="spawn")
    assert torch.load(path) == [False, False]


def _running_requests(obj: object) -> int:
    if isinstance(obj, dict):
        return sum(
            v if k == "num_running_reqs" and isinstance(v, int) else _running_requests(v)
            for k, v in obj.items()
        )
    if isinstance(obj, list):
        return sum(_running_requests(v) for v in obj)
    return 0


def _wait_until_running(url: str, polls: int = 2000) -> None:
    for _ in range(polls):
        if _running_requests(httpx.get(url + "/v1/loads", timeout=10).json()) > 0:
            return
        time.sleep(0.01)
    raise AssertionError("requests never started running")


async def _version(url: str) -> str:
    async with SGLangClient(url) as c:
        return await c.weight_version()


def test_fp8_fake_quant_in_flattened_buckets(
    synchronizer, sglang_server, tiny_ckpt: Path, manifest, restore_v1: dict
) -> None:
    scheme = Fp8Scheme("block", (32, 32))  # small blocks so the tiny 64-wide weights get several scales
    fq = DistributedWeightSynchronizer(
        [sglang_server.url], manifest, fp8=scheme, fp8_mode="fake", bucket_size_mb=0.05, timeout_s=120
    )
    fq.connect()
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=3)
    try:
        v4 = _perturbed(restore_v1, seed=4)
        report = fq.sync(v4, version="v4-fp8")
        assert report.fp8 == "fake-quant" and report.num_buckets > 1
        expected = {
            k: fake_quantize(v, scheme) if should_quantize(k, v, scheme) else v for k, v in v4.items()
        }
        assert any(not torch.equal(expected[k], v4[k]) for k in v4)
        samples = _generate(sglang_server.url, params)
        assert _max_delta(samples, load_hf(tiny_ckpt, expected)) < 1e-2
        # quantize=False (the trainer's own weights, e.g. for an eval): this one sync is unquantized
        plain = fq.sync(v4, version="v4-plain", quantize=False)
        assert plain.fp8 == "none" and asyncio.run(_version(sglang_server.url)) == "v4-plain"
        assert _max_delta(_generate(sglang_server.url, params), load_hf(tiny_ckpt, v4)) < 1e-2
        assert fq.sync(v4, version="v4-fp8-again").fp8 == "fake-quant"  # quantizing again after it
        assert _max_delta(_generate(sglang_server.url, params), load_hf(tiny_ckpt, expected)) < 1e-2
        fq.fp8_mode = "real"  # a server with real FP8 weights cannot take unquantized ones
        with pytest.raises(WeightSyncError, match="quantize=False"):
            fq.sync(v4, version="never", quantize=False)
        assert fq.fp8 == scheme and asyncio.run(_version(sglang_server.url)) == "v4-fp8-again"
    finally:
        fq.close()


def test_pause_continue_with_inflight_requests(synchronizer, sglang_server, restore_v1: dict) -> None:
    v5 = _perturbed(restore_v1, seed=5)
    params = SamplingParams(temperature=1.0, max_new_tokens=200, ignore_eos=True)
    result: dict = {}

    async def generate_long() -> None:
        async with SGLangClient(sglang_server.url) as c:
            task = asyncio.ensure_future(c.generate([PROMPTS[0]] * 4, params))
            result["started"].set()
            result["samples"] = [g[0] for g in await task]

    result["started"] = threading.Event()
    t = threading.Thread(target=lambda: asyncio.run(generate_long()))
    t.start()
    result["started"].wait()
    _wait_until_running(sglang_server.url)  # prefill done: each request holds >= 1 token of the old weights
    try:
        synchronizer.sync(v5, version="v5")  # pauses (retract) while the requests run, then continues
    finally:
        t.join(timeout=300)
    samples = result["samples"]
    # Every request finished normally, at full length, despite the update in the middle.
    assert all(
        s.finish_reason == "length" and len(s.output_ids) == 200 == len(s.rollout_logprobs) for s in samples
    )
    assert all(s.weight_version == "v5" for s in samples)
    # The version segments say which tokens came from which weights (retract recomputes the KV cache).
    spans = [[seg["version"] for seg in s.weight_versions] for s in samples]
    assert any(len(v) > 1 for v in spans), spans


def _scheduler_runnable_fraction(pid: int, samples: int = 50, every_s: float = 0.02) -> float:
    """Fraction of samples in which the server's scheduler process is running or runnable (``R``).

    State, not CPU time: a spinning process is ``R`` even while a loaded machine gives it no core, so
    the check holds on a busy CI box where CPU seconds would not."""
    (sched,) = [p for p in psutil.Process(pid).children(recursive=True) if "scheduler" in p.name()]
    running = 0
    for _ in range(samples):
        running += sched.status() == psutil.STATUS_RUNNING
        time.sleep(every_s)
    return running / samples


def test_paused_scheduler_sleeps(sglang_server: SGLangServer) -> None:
    """While paused (the whole of a weight update) the scheduler sleeps on its sockets like an idle
    one (the ``paused_sleep`` CPU patch + ``--sleep-on-idle``); SGLang's own paused loop spins on a
    core, which on 2 cores is taken from the trainer's FP8 packing and send. It still wakes for the
    next request."""
    assert sglang_server.pid is not None

    async def call(method: str, *args: object) -> object:
        async with SGLangClient(sglang_server.url) as c:
            return await getattr(c, method)(*args)

    asyncio.run(call("pause_generation", "retract"))
    try:
        paused = _scheduler_runnable_fraction(sglang_server.pid)
    finally:
        asyncio.run(call("continue_generation"))
    assert paused < 0.5, f"paused scheduler runnable in {paused:.0%} of samples: spinning"
    assert len(_generate(sglang_server.url, GREEDY)[0].output_ids) == 8  # and it serves after continue


def test_update_store_is_bound_before_servers_hear_the_port(manifest: Manifest) -> None:
    # Port 0: the OS picks the port at bind time, so nothing can take it between choice and bind.
    store = host_update_store("127.0.0.1", 0, 2, timedelta(seconds=5))
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", store.port))  # held by the store
    # A fixed master_port that is taken fails before any server is contacted (this URL has none).
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        sync = DistributedWeightSynchronizer(
            ["http://127.0.0.1:9"], manifest, master_port=busy.getsockname()[1], timeout_s=5
        )
        try:
            with pytest.raises(WeightSyncError, match="leave master_port unset"):
                sync.connect()
        finally:
            sync.close()
