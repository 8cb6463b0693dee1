"""Weight sync with several sources into a real SGLang server: the coordinator in this process
(source 0), the other sources in spawned processes, each on its own update group; plus the layouts
and the order they rest on (no server).

The tiny model is split like a 2-stage pipeline: stage 0 holds the embeddings and layer 0, stage 1
layer 1, the final norm and the LM head (``_split``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from bridge_helpers import PROMPTS, hf_logprobs, hf_named_tensors, load_hf

from sglang_bridge.client import SGLangClient
from sglang_bridge.fp8 import Fp8Scheme, fake_quantize, should_quantize
from sglang_bridge.server import SGLangServer
from sglang_bridge.weight_sync import (
    ControlStore,
    DistributedWeightSynchronizer,
    Manifest,
    ManifestMismatchError,
    StreamMismatchError,
    WeightSource,
    WeightSyncError,
)
from sglang_bridge.weight_sync.buckets import (
    BucketPacker,
    SendBuffers,
    bucket_limit,
    copy_entry,
    grouped_buckets,
    planned_buckets,
    wire_entry,
    wire_meta,
)
from sglang_bridge.weight_sync.plan import interleave, plan_buckets

SCHEME = Fp8Scheme("block", (32, 32))
SMALL = dict(bucket_size_mb=0.02, first_bucket_mb=0.01, timeout_s=60)


def _split(named: dict[str, torch.Tensor]) -> tuple[list, list]:
    stage1 = [k for k in named if ".layers.1." in k or k in ("model.norm.weight", "lm_head.weight")]
    return [(k, v) for k, v in named.items() if k not in stage1], [(k, named[k]) for k in stage1]


def _meta(items: list) -> list:
    return [(n, tuple(t.shape), t.dtype) for n, t in items]


def _perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in base.items()}


def _source(address: tuple[str, int], path: str, out: str, plan: list[dict[str, Any]]) -> None:
    """A source process: one sync per entry of ``plan`` with the tensors saved at ``path``, each
    optionally renaming one tensor, killing this process after ``kill_after`` tensors, or raising
    after ``raise_after`` (the process lives on, and takes part in the next entry's sync)."""
    control = ControlStore.join(*address, timeout_s=60)
    source = WeightSource(control, 1, label="stage 1")
    named = torch.load(path)
    results = []
    for step in plan:
        items = [(n + step.get("suffix", "") if i == 0 else n, t) for i, (n, t) in enumerate(named)]

        def stream(
            items: list = items,
            kill: int | None = step.get("kill_after"),
            fail: int | None = step.get("raise_after"),
        ) -> Iterator:
            for i, item in enumerate(items):
                if i == kill:
                    os.kill(os.getpid(), signal.SIGKILL)  # this source dies mid-sync
                if i == fail:
                    raise RuntimeError("simulated failure of this source mid-stream")
                yield item

        try:
            r = source.sync(stream(), _meta(items))
            results.append({"ok": True, "bytes": r.num_bytes, "buckets": r.num_buckets})
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    source.close()
    Path(out).write_text(json.dumps(results))


class Sources:
    """Spawned source processes on one control store (stopped on the way out)."""

    def __init__(self, tmp: Path, control: ControlStore):
        self.tmp, self.control, self.procs = tmp, control, []

    def start(self, tensors: list, plan: list[dict[str, Any]]) -> Path:
        path, out = self.tmp / f"src{len(self.procs)}.pt", self.tmp / f"src{len(self.procs)}.json"
        torch.save(tensors, path)
        p = mp.get_context("spawn").Process(
            target=_source, args=(self.control.address, str(path), str(out), plan)
        )
        p.start()
        self.procs.append(p)
        return out

    def join(self, out: Path) -> list[dict[str, Any]] | int:
        p = self.procs[-1]
        p.join(120)
        return json.loads(out.read_text()) if p.exitcode == 0 else int(p.exitcode or -1)

    def stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(10)


@pytest.fixture()
def sources(tmp_path: Path) -> Iterator[Sources]:
    s = Sources(tmp_path, ControlStore.host(timeout_s=60))
    try:
        yield s
    finally:
        s.stop()


def _coordinator(
    url: str, manifest: Manifest, control: ControlStore, **kw: Any
) -> DistributedWeightSynchronizer:
    sync = DistributedWeightSynchronizer(
        [url], manifest, sources=2, control=control, source_label="stage 0", **{**SMALL, **kw}
    )
    sync.connect()
    return sync


def _generate(url: str, *, greedy: bool = False) -> list:
    """One sample per prompt: seeded at T=1 (log-probs to compare), or greedy (the same tokens for
    the same weights: a CPU server's seeded sampling depends on the batch it runs in)."""
    from sglang_bridge.client import SamplingParams
    from sglang_bridge.weight_sync.verify import verify_params

    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True) if greedy else None

    async def go() -> list:
        async with SGLangClient(url) as c:
            return [g[0] for g in await c.generate(PROMPTS, params or verify_params(8, 1.0))]

    return asyncio.run(go())


def _served(url: str, ckpt: Path, named: dict[str, torch.Tensor]) -> tuple[set[str], float]:
    """The server's weight versions and its max |delta logp| against ``named`` (HF, in float)."""
    samples = _generate(url)
    ref = hf_logprobs(
        load_hf(ckpt, named), [s.prompt_ids for s in samples], [s.output_ids for s in samples], 1.0
    )
    delta = max(
        abs(a - b)
        for s, r in zip(samples, ref, strict=True)
        for a, b in zip(s.rollout_logprobs, r, strict=True)
    )
    return {s.weight_version for s in samples}, delta


@pytest.fixture()
def restore(
    synchronizer: DistributedWeightSynchronizer, tiny_ckpt: Path, manifest: Manifest
) -> Iterator[dict]:
    v1 = hf_named_tensors(load_hf(tiny_ckpt, dtype=torch.bfloat16), manifest)
    yield v1
    synchronizer.sync(v1, version="v1-restored")  # the session's synchronizer: its own group


@pytest.mark.parametrize("fp8", [False, True])
def test_two_sources_one_lifecycle_and_the_served_logprobs_follow(
    sglang_server: SGLangServer,
    manifest: Manifest,
    tiny_ckpt: Path,
    restore: dict,
    sources: Sources,
    fp8: bool,
) -> None:
    named = _perturbed(restore, seed=11)
    mine, theirs = _split(named)
    out = sources.start(theirs, [{}, {}])
    sync = _coordinator(sglang_server.url, manifest, sources.control, fp8=SCHEME if fp8 else None)
    try:
        reports = [sync.sync(iter(mine), f"two-{i}", meta=_meta(mine)) for i in range(2)]
    finally:
        sync.close()
    got = sources.join(out)
    assert isinstance(got, list) and all(r["ok"] for r in got), got
    for rep in reports:
        assert rep.num_tensors == len(named) and rep.num_bytes == sum(rep.sources.values())
        assert set(rep.sources) == {"stage 0", "stage 1"} and rep.num_buckets > 4
        assert rep.fp8 == ("fake-quant" if fp8 else "none")
    assert got[0]["bytes"] == reports[0].sources["stage 1"]  # what the source sent itself
    served = {
        k: fake_quantize(v, SCHEME) if fp8 and should_quantize(k, v, SCHEME) else v for k, v in named.items()
    }
    versions, delta = _served(sglang_server.url, tiny_ckpt, served)
    assert versions == {"two-1"} and delta < 1e-2


@pytest.mark.parametrize("fault", ["renamed", "missing", "twice"])
def test_a_bad_declaration_of_any_source_is_refused_before_anything_is_sent(
    sglang_server: SGLangServer, manifest: Manifest, restore: dict, sources: Sources, fault: str
) -> None:
    named = _perturbed(restore, seed=12)
    mine, theirs = _split(named)
    first = theirs[0][0]  # stage 1's first tensor (the checkpoint's order)
    plan: dict[str, Any] = {}
    if fault == "renamed":
        plan["suffix"] = ".renamed"  # stage 1 declares (and would send) a tensor the server lacks
    elif fault == "missing":
        theirs = theirs[1:]
    else:
        mine = mine + theirs[:1]
    before = _generate(sglang_server.url, greedy=True)
    out = sources.start(theirs, [plan])
    sync = _coordinator(sglang_server.url, manifest, sources.control)
    try:
        with pytest.raises(ManifestMismatchError, match="nothing sent") as err:
            sync.sync(iter(mine), "bad", meta=_meta(mine))
    finally:
        sync.close()
    msg = str(err.value)
    want = {
        "renamed": f"stage 1: {first}.renamed: not a weight",
        "missing": "not in the update from any of stage 0, stage 1",
        "twice": f"stage 1: {first}: sent twice (also sent by stage 0)",
    }[fault]
    assert want in msg, msg
    got = sources.join(out)
    assert (
        isinstance(got, list) and "ManifestMismatchError" in got[0]["error"] and "refused" in got[0]["error"]
    )
    after = _generate(sglang_server.url, greedy=True)  # not paused, same weights and version
    assert [s.output_ids for s in after] == [s.output_ids for s in before]
    assert {s.weight_version for s in after} == {s.weight_version for s in before}


def test_a_source_killed_mid_sync_fails_it_by_name_and_a_new_synchronizer_recovers(
    sglang_server: SGLangServer, manifest: Manifest, tiny_ckpt: Path, restore: dict, sources: Sources
) -> None:
    named = _perturbed(restore, seed=13)
    mine, theirs = _split(named)
    out = sources.start(theirs, [{"kill_after": 5}])
    sync = _coordinator(sglang_server.url, manifest, sources.control)
    try:
        with pytest.raises(WeightSyncError, match="PAUSED") as err:
            sync.sync(iter(mine), "killed", meta=_meta(mine))
    finally:
        sync.close()
    assert "stage 1" in str(err.value) and "connect() a new one" in str(err.value), err.value
    assert sources.join(out) == -signal.SIGKILL
    # A new synchronizer (new groups) and a new process for stage 1: the update goes through.
    out = sources.start(theirs, [{}])
    sync = _coordinator(sglang_server.url, manifest, sources.control)
    try:
        sync.sync(iter(mine), "recovered", meta=_meta(mine))
    finally:
        sync.close()
    assert sources.join(out)[0]["ok"]
    versions, delta = _served(sglang_server.url, tiny_ckpt, named)
    assert versions == {"recovered"} and delta < 1e-2


def test_a_source_failing_mid_sync_fails_it_by_name_and_a_new_synchronizer_recovers(
    sglang_server: SGLangServer, manifest: Manifest, tiny_ckpt: Path, restore: dict, sources: Sources
) -> None:
    """A source whose stream raises between buckets, its process alive: it tears its update group
    down, so the server's receive of its bucket fails at once (not at the group's 30 min timeout)
    and the update fails naming it; the same synchronizer is then refused before anything is sent
    (that source's group is gone), and a new synchronizer recovers with the same source process."""
    named = _perturbed(restore, seed=14)
    mine, theirs = _split(named)
    out = sources.start(theirs, [{"raise_after": 5}, {}, {}])
    sync = _coordinator(sglang_server.url, manifest, sources.control)
    try:
        with pytest.raises(WeightSyncError, match="PAUSED") as err:
            sync.sync(iter(mine), "failing", meta=_meta(mine))
        with pytest.raises(WeightSyncError, match="torn down") as again:
            sync.sync(iter(mine), "same-synchronizer", meta=_meta(mine))
    finally:
        sync.close()
    msg = str(err.value)
    assert "stage 1" in msg and "simulated failure" in msg and "connect() a new one" in msg, msg
    assert "stage 1" in str(again.value) and "connect() a new one" in str(again.value), again.value
    sync = _coordinator(sglang_server.url, manifest, sources.control)
    try:
        sync.sync(iter(mine), "recovered-live", meta=_meta(mine))
    finally:
        sync.close()
    got = sources.join(out)
    assert isinstance(got, list) and [r["ok"] for r in got] == [False, False, True], got
    assert "simulated failure" in got[0]["error"] and "torn down" in got[1]["error"], got
    versions, delta = _served(sglang_server.url, tiny_ckpt, named)
    assert versions == {"recovered-live"} and delta < 1e-2


# -- no server: the layouts and the order ----------------------------------------------------------


def _named(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(40, 64, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(64, 96, generator=g).to(torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(64, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(64, generator=g)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(96, 64, generator=g).to(torch.bfloat16)),
    ]


@pytest.mark.parametrize("mode", ["none", "fake", "real"])
def test_planned_buckets_are_the_streamed_ones(mode: str) -> None:
    """Layouts planned from metadata alone pack exactly what grouping the stream packs: the same
    buckets, names, dtypes, shapes and bytes (so a source packs what the coordinator posted)."""
    scheme = None if mode == "none" else SCHEME
    fp8_mode = "fake" if mode == "none" else mode
    named = _named()
    limit = lambda k: bucket_limit(k, 9000, 20000)  # noqa: E731
    entry = lambda n, t: wire_entry(n, t, scheme, fp8_mode)  # type: ignore[arg-type]  # noqa: E731
    layouts = plan_buckets(_meta(named), lambda n, s, d: wire_meta(n, s, d, scheme, fp8_mode), limit)  # type: ignore[arg-type]

    def packed(produce: Any) -> list:
        p = BucketPacker(
            produce,
            SendBuffers(torch.device("cpu")),
            __import__("sglang_bridge.fp8", fromlist=["x"]).Fp8Workspace(),
        )
        out = []
        for b, idx in p.buckets():
            out.append((b.names, b.dtypes, b.shapes, b.last, b.flat.clone()))
            p.release(idx)
        return out

    planned = packed(planned_buckets(iter(named), layouts, entry))
    streamed = packed(grouped_buckets(iter(named), entry, limit))
    assert len(planned) == len(streamed) > 1
    for a, b in zip(planned, streamed, strict=True):
        assert a[:4] == b[:4] and torch.equal(a[4], b[4])


@pytest.mark.parametrize("fault", ["renamed", "reshaped", "short", "long"])
def test_a_stream_that_departs_from_its_declaration_is_refused(fault: str) -> None:
    named = _named()
    meta = _meta(named)
    if fault == "renamed":
        named[2] = (named[2][0] + ".x", named[2][1])
    elif fault == "reshaped":
        named[1] = (named[1][0], named[1][1].t().contiguous())
    elif fault == "short":
        named = named[:-1]
    else:
        named = named + [("model.norm.weight", torch.zeros(64, dtype=torch.bfloat16))]
    layouts = plan_buckets(meta, lambda n, s, d: [(n, s, d)], lambda k: 1 << 20)
    p = BucketPacker(
        planned_buckets(iter(named), layouts, copy_entry), SendBuffers(torch.device("cpu")), None
    )  # type: ignore[arg-type]
    with pytest.raises(
        StreamMismatchError,
        match={
            "renamed": "where it declared",
            "reshaped": "where it declared",
            "short": "ended before",
            "long": "after every tensor",
        }[fault],
    ):
        for _, idx in p.buckets():
            p.release(idx)


def test_every_server_takes_the_sources_buckets_in_one_round_robin_order() -> None:
    assert interleave({0: 3, 1: 1, 2: 2}) == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2)]
    assert interleave({}) == []


def _one_group_rank(rank: int, port: int, names: list, out: str) -> None:
    from datetime import timedelta

    from sglang_bridge.weight_sync import broadcast_async, create_update_group

    group = create_update_group(
        "gloo", "127.0.0.1", port, 3, rank, "one-group-two-trainers", timedelta(seconds=60), store=None
    )
    flat = (
        torch.load(out + ".flat")
        if rank == 0
        else torch.zeros(torch.load(out + ".flat").numel(), dtype=torch.uint8)
    )
    broadcast_async(flat, group).wait()  # rank 1 cannot stay out of a broadcast of its own group
    torch.save(flat, out + f".rank{rank}")
    time.sleep(1.0)  # let the server finish before the group goes
    torch.distributed.destroy_process_group(group)


def test_an_update_group_takes_one_sender_and_its_other_members_receive_every_byte(
    sglang_server: SGLangServer, manifest: Manifest, tiny_ckpt: Path, restore: dict, tmp_path: Path
) -> None:
    """The measurement behind one group per source (docs/bridge.md): SGLang 0.5.23 receives a
    bucket with ``broadcast(src=0)``, so in a group of two trainer ranks and the server only group
    rank 0 can send, and rank 1, a member, has to take part in that broadcast: it receives every
    byte. A second source therefore needs a group of its own."""
    from sglang_bridge.server import free_port
    from sglang_bridge.weight_sync.buckets import Bucket

    named = _perturbed(restore, seed=14)
    bucket = Bucket(
        list(named.items()),
        torch.empty(sum(t.numel() * t.element_size() for t in named.values()), dtype=torch.uint8),
    )
    base = str(tmp_path / "one")
    torch.save(bucket.flat.clone(), base + ".flat")
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_one_group_rank, args=(r, port, bucket.names, base)) for r in (0, 1)]
    for p in procs:
        p.start()

    async def update() -> list:
        async with SGLangClient(sglang_server.url) as c:
            init = await c.init_weights_update_group(
                "127.0.0.1", port, 2, 3, "one-group-two-trainers", "gloo"
            )
            await c.begin_weight_update()
            loaded = await c.update_weights_from_distributed(
                bucket.names,
                bucket.dtypes,
                bucket.shapes,
                "one-group-two-trainers",
                load_format="flattened_bucket",
                flush_cache=True,
            )
            await c.end_weight_update()
            await c.update_weight_version("one-group")
            await asyncio.sleep(1.5)
            gone = await c.destroy_weights_update_group("one-group-two-trainers")
            return [init, loaded, gone]

    try:
        init, loaded, _ = asyncio.run(update())
    finally:
        for p in procs:
            p.join(60)
    assert init["success"] and loaded["success"], (init, loaded)
    assert [p.exitcode for p in procs] == [0, 0]
    assert torch.equal(torch.load(base + ".rank1"), bucket.flat)  # the second trainer rank got it all
    assert _served(sglang_server.url, tiny_ckpt, named)[1] < 1e-2
