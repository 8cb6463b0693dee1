"""Weight sync from real Megatron layouts into real SGLang servers, on gloo ranks (run by
``tests/dist_launch.py``, like ``mcore_worker``; the test starts the servers and passes their URLs).

    python tests/sync_worker.py <scenario> '<json args>' <out_dir>     (RANK/WORLD_SIZE/MASTER_* set)

``layouts``: per case, a Policy of the layout loads the case's weights and pushes them through the
driver's own path (``WeightPublisher.push``: per source, or rank 0 alone); the server's log-probs
on fixed prompts are then compared with the trainer's own (Megatron) log-probs of the same tokens.
Then the same server reloads the case's weights from disk, through SGLang's own loader, and scores
the same tokens again: the two must be equal bit for bit, whatever the layout (the log-probs of
trainer and server differ by the kernels, on the MoE model by near-tie routing flips too; the
server's two loads of the same bytes do not differ at all). Cases may also rename a tensor on one
stage (refused before anything is sent), or fail one source mid-stream (the sync fails naming it,
the driver reconnects and retries). Each rank measures the peak extra memory of a push (``VmHWM``
reset before it) next to what it holds to send: the first push, which allocates the send buffers,
and a second one of the same weights, which finds them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

import mcore_worker as mw  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from megatron_acrl.config import config_from_dict, config_to_dict  # noqa: E402

PROMPTS = [
    [5, 17, 42, 99, 7, 120, 33],
    [3, 1, 4, 1, 5, 9, 2, 6],
    [200, 201, 202],
    [11, 12, 13, 14],
    [77, 78, 79, 80, 81, 82],
    [250, 8, 250, 8],
    [31, 41, 59, 26, 53],
    [1, 2, 3],
]
NEW_TOKENS = 8
KEY_ENV = "ACRL_TEST_SYNC_KEY"
"""Where the ranks find the key of the test's servers (``rollout.api_key_env``)."""


def case_config(case: dict[str, Any], url: str) -> Any:
    """``mcore_worker``'s model of ``case["kind"]`` in bf16 under ``case["layout"]``, rolling out on
    the server at ``url`` (FP8 fake-quant in 32x32 blocks if ``case["fp8"]``)."""
    data = config_to_dict(mw.make_config(case.get("model_kind", case["kind"]), case["layout"], bf16=True))
    data["model"].update(case.get("model", {}))
    data["rollout"].update(
        server_urls=[url],
        api_key_env=KEY_ENV,
        quantization="fp8_block" if case.get("fp8") else "none",
        fp8_block_size=[32, 32],
        weight_sync=case.get("weight_sync", "per_source"),
        bucket_size_mb=case.get("bucket_mb", 0.02),
        request_timeout_s=120.0,
        startup_timeout_s=120.0,
    )
    data["training"]["micro_batch_size"] = 1
    return config_from_dict(data)


def peak_rss_reset() -> int:
    """Reset this process's peak resident size to its current one (``/proc/self/clear_refs``);
    returns it in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _status(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def _samples(url: str, temperature: float) -> list[Any]:
    from sglang_bridge.client import SGLangClient
    from sglang_bridge.weight_sync.verify import verify_params

    async def go() -> list[Any]:
        async with SGLangClient(url, api_key=os.environ[KEY_ENV]) as c:
            return [g[0] for g in await c.generate(PROMPTS, verify_params(NEW_TOKENS, temperature))]

    return asyncio.run(go())


def trainer_delta(trainer: Any, url: str, rank: int) -> dict[str, Any]:
    """Rank 0 samples the prompts on the server; every rank scores the same tokens with the trainer;
    rank 0 returns max and mean |server - trainer| log-prob over the generated tokens and the
    version."""
    from megatron_acrl.world.distributed import broadcast_object

    samples = _samples(url, trainer.cfg.rollout.temperature) if rank == 0 else None
    seqs = broadcast_object([s.prompt_ids + s.output_ids for s in samples] if samples else None)
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
    lp = trainer.forward_logprobs({"tokens": tokens})["logprobs"]
    if rank != 0:
        return {}
    deltas = [
        abs(a - b)
        for i, s in enumerate(samples)
        for a, b in zip(s.rollout_logprobs, lp[i, len(s.prompt_ids) : len(seqs[i])].tolist(), strict=True)
    ]
    return {
        "delta": max(deltas),
        "mean": sum(deltas) / len(deltas),
        "version": samples[0].weight_version,
        "seqs": seqs,
        "targets": [len(s.output_ids) for s in samples],
    }


def disk_oracle(url: str, ckpt: str, tensors: dict[str, torch.Tensor], after: dict[str, Any]) -> float:
    """max |log p| difference over the sampled tokens ``after`` holds between the server as the
    sync left it and the same server once it reloaded ``tensors`` (the trainer's weights, by their
    served names) from disk through SGLang's own loader, both scored teacher-forced after a cache
    flush; the version is put back as it was."""
    from safetensors.torch import save_file

    from sglang_bridge.client import SGLangClient

    async def score(c: Any) -> list[list[float]]:
        await c.flush_cache()
        return await c.score(after["seqs"], after["targets"])

    async def go(model_dir: Path) -> float:
        async with SGLangClient(url, api_key=os.environ[KEY_ENV]) as c:
            synced = await score(c)
            body = {"model_path": str(model_dir), "weight_version": after["version"]}
            answer = await c._post("/update_weights_from_disk", body)
            assert answer.get("success"), answer
            loaded = await score(c)
        return max(abs(a - b) for x, y in zip(synced, loaded, strict=True) for a, b in zip(x, y, strict=True))

    with tempfile.TemporaryDirectory() as d:
        for f in Path(ckpt).iterdir():  # config and tokenizer as served, the weights the trainer's
            if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                shutil.copy(f, Path(d) / f.name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, Path(d) / "model.safetensors")
        return asyncio.run(go(Path(d)))


def _perturbed(base: dict[str, torch.Tensor], seed: int, fp8: bool) -> dict[str, torch.Tensor]:
    from sglang_bridge.fp8 import Fp8Scheme, fake_quantize, should_quantize

    g = torch.Generator().manual_seed(seed)
    out = {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in base.items()}
    if fp8:  # the trainer holds weights already on the FP8 grid: its log-probs are the server's
        scheme = Fp8Scheme("block", (32, 32))
        out = {k: fake_quantize(v, scheme) if should_quantize(k, v, scheme) else v for k, v in out.items()}
    return out


def largest_gathered(trainer: Any) -> int:
    """Bytes of the largest full tensor this rank's per-source stream materializes (0 if no source)."""
    from megatron_acrl.megatron import hf_io

    if trainer.sync_source is None:
        return 0
    pg = trainer.layout.pg
    sizes = [
        torch.Size(hf_io._full_shape(e, pg)).numel() * e.param.element_size()
        for e, _, mine in hf_io._source_entries(trainer.model, trainer.layout)
        if mine
    ]
    return max(sizes, default=0)


def _sabotage(trainer: Any, case: dict[str, Any]) -> None:
    """A renamed tensor on ``case["rename_on"]``'s stage, a source that fails once mid-stream, or
    (``hold``, the memory test's negative control) a stream that keeps every tensor it yields."""
    src = trainer.sync_source
    if case.get("hold"):
        stream, held = trainer.hf_source_weights, []

        def holding() -> Any:
            for name, t in stream():
                held.append(t.clone())
                yield name, t

        trainer.hf_source_weights = holding
    if "rename_on" in case and src is not None and src.index == case["rename_on"]:
        to_hf = trainer._to_hf
        trainer._to_hf = lambda n, t: [
            (k + ".renamed" if k.endswith("norm.weight") else k, v) for k, v in to_hf(n, t)
        ]
    if "fail_on" in case and src is not None and src.index == case["fail_on"]:
        stream, failed = trainer.hf_source_weights, []

        def failing() -> Any:
            for i, item in enumerate(stream()):
                if i == 3 and not failed:
                    failed.append(1)
                    raise RuntimeError("simulated failure of this source mid-stream")
                yield item

        trainer.hf_source_weights = failing


def _recording(fn: Any, failures: list[str]) -> Any:
    def wrapped(*a: Any, **k: Any) -> Any:
        try:
            return fn(*a, **k)
        except Exception as e:
            failures.append(f"{type(e).__name__}: {e}")
            raise

    return wrapped


def run_case(case: dict[str, Any], url: str, base: dict[str, torch.Tensor], ckpt: str) -> dict[str, Any]:
    from megatron_acrl.megatron.base import initialize_parallel
    from megatron_acrl.megatron.policy import Policy
    from megatron_acrl.run.context import RunContext, attach_publisher
    from megatron_acrl.servers.handle import RolloutServers

    cfg = case_config(case, url)
    rank, world = dist.get_rank(), dist.get_world_size()
    initialize_parallel(cfg.parallel, mw.SEED)
    trainer = Policy(cfg)
    weights = _perturbed(base, case.get("seed", 1), bool(case.get("fp8")))
    trainer.load_hf(weights)
    out: dict[str, Any] = {"source": dataclasses.asdict(trainer.sync_source) if trainer.sync_source else None}
    with tempfile.TemporaryDirectory() as run_dir:
        servers = None
        if rank == 0:
            label = trainer.sync_source.label
            servers = RolloutServers(cfg, ckpt, Path(run_dir) / "logs", source_label=label)
        ctx = RunContext(
            cfg, argparse.Namespace(), rank, world, Path(run_dir), Path(ckpt), None, None, trainer
        )
        ctx.servers = servers
        attach_publisher(ctx, True)
        if case.get("before"):
            out["before"] = trainer_delta(trainer, url, rank)
        _sabotage(trainer, case)
        if servers is not None:  # what each failed attempt of the push said (the driver only logs it)
            servers.update_weights = _recording(servers.update_weights, out.setdefault("failures", []))
        # The memory cases push twice: the first allocates the send buffers (kept for the run), the
        # second (same weights) finds them, so its peak is what a push adds on top of them.
        for version in [f"{case['name']}-first"] * ("peak_first" in case) + [case["name"]]:
            peak_rss_reset()
            rss0 = _status("VmRSS")
            try:
                out["metrics"] = ctx.publisher.push(version)
            except RuntimeError as e:
                out["error"] = str(e)
            out["peak_first" if version.endswith("-first") else "peak_extra"] = _status("VmHWM") - rss0
        sync = ctx.servers.synchronizer if ctx.servers else ctx.publisher.source
        out["buffers"] = sync._send_buffers.nbytes if sync is not None else 0
        out["largest"] = largest_gathered(trainer)
        out["after"] = trainer_delta(trainer, url, rank)
        if rank == 0 and "error" not in out:
            out["oracle"] = disk_oracle(url, ckpt, weights, out["after"])
        for got in (out.get("before"), out["after"]):  # the tokens were the oracle's: not reported
            for k in ("seqs", "targets"):
                (got or {}).pop(k, None)
        ctx.close()
    del trainer
    parallel_state.destroy_model_parallel()
    return out


def scenario_layouts(args: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file

    results = {}
    bases: dict[str, dict[str, torch.Tensor]] = {}
    for case in args["cases"]:
        url, ckpt = args["servers"][case["kind"]]
        if ckpt not in bases:  # the served names (per-expert), as the checkpoint stores them
            bases[ckpt] = {
                k: v for f in sorted(Path(ckpt).glob("*.safetensors")) for k, v in load_file(f).items()
            }
        dist.barrier()
        results[case["name"]] = run_case(case, url, bases[ckpt], ckpt)
    return results


if __name__ == "__main__":
    mw.main(globals())
