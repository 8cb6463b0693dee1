"""The ``--layout`` part of ``benchmarks/weight_sync.py``: real Megatron layouts on gloo (torchrun,
one process per rank) pushing the same weights into a real SGLang CPU server through the driver's
own path (``WeightPublisher.push``), today's rank-0 path and the per-source path alternating.

* rank-0 path (``rollout.weight_sync: rank0``): every stage is broadcast over the pipeline group (and
  experts all-gathered over EP) to every rank; global rank 0 sends the whole model;
* per-source (``per_source``): each stage's (DP 0, TP 0) rank and each EP rank's expert owner sends
  its own part, through its own update group, rank 0 coordinating the update.

Bytes through a rank = what it sends to the servers + what it receives from other trainer ranks for
the sync (the tensors of other stages / EP ranks its stream yields; the layouts here are TP=1, so a
source gathers nothing). ``busiest rank bytes share`` = the busiest rank's bytes / the model's
bytes per sync; ``per-source sync time ratio`` = median per-source push / median rank-0 push.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

LAYOUTS: dict[str, dict[str, Any]] = {
    "pp2": {"pp": 2, "ep": 1, "moe": False},
    "ep2": {"pp": 1, "ep": 2, "moe": True},
    "pp2ep2": {"pp": 2, "ep": 2, "moe": True},
}
PATHS = ("rank0", "per_source")


def model_config(args: argparse.Namespace, moe: bool) -> Any:
    """The benchmark's dense model (the PP=1 part's) or its MoE sibling (``--experts``, top-2)."""
    from megatron_acrl.config import ModelConfig

    dense = dict(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.hidden * 8 // 3 // 64 * 64,
        num_attention_heads=max(1, args.hidden // 64),
        num_query_groups=max(1, args.hidden // 128),
        vocab_size=args.vocab,
        tie_embeddings=False,
    )
    if not moe:
        return ModelConfig(**dense)
    return ModelConfig(
        **dense,
        family="qwen3_moe",
        qk_layernorm=True,
        add_qkv_bias=False,
        num_experts=args.experts,
        moe_router_topk=2,
        moe_ffn_hidden_size=max(64, args.hidden // 2),
    )


def layout_config(name: str, args: argparse.Namespace, url: str, path: str) -> Any:
    """The trainer config of layout ``name`` rolling out on ``url`` (FP8 fake-quant, as a CPU run)."""
    from megatron_acrl.config import Config, ParallelConfig, RolloutConfig, TrainingConfig

    spec = LAYOUTS[name]
    return Config(
        model=dataclasses.replace(model_config(args, spec["moe"]), params_dtype="bf16"),
        parallel=ParallelConfig(pp=spec["pp"], ep=spec["ep"]),
        rollout=RolloutConfig(
            server_urls=(url,),
            api_key_env=KEY_ENV,
            weight_sync=path,  # type: ignore[arg-type]
            bucket_size_mb=args.bucket_mb,
            request_timeout_s=300.0,
        ),
        training=TrainingConfig(micro_batch_size=1),
    )


def run_layout(name: str, args: argparse.Namespace, server: tuple[str, str], work: Path) -> dict[str, Any]:
    """Run layout ``name`` under torchrun against ``server`` (url, checkpoint); its rank 0's results."""
    spec = LAYOUTS[name]
    out = work / f"layout-{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={spec['pp'] * spec['ep']}",
        str(Path(__file__).with_name("weight_sync.py")),
        *("--worker", name, "--server-url", server[0], "--server-ckpt", server[1], "--out", str(out)),
        *("--layers", str(args.layers), "--hidden", str(args.hidden), "--vocab", str(args.vocab)),
        *("--experts", str(args.experts), "--reps", str(args.reps), "--bucket-mb", str(args.bucket_mb)),
        "--work-dir",
        str(work),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.layout_timeout)
    if proc.returncode != 0:
        raise SystemExit(
            f"layout {name} failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return json.loads(out.read_text())


def _counting(stream_fn: Any, own: set[str], box: list[int]) -> Any:
    """``stream_fn`` whose tensors not in ``own`` (they came from other ranks) are added to box[0]."""

    def wrapped(*a: Any, **k: Any) -> Any:
        for name, t in stream_fn(*a, **k):
            if name not in own:
                box[0] += t.numel() * t.element_size()
            yield name, t

    return wrapped


def worker(args: argparse.Namespace) -> None:
    """One rank of layout ``args.worker``: both paths on the same Policy, interleaved."""
    import torch.distributed as dist

    from megatron_acrl.megatron.policy import Policy
    from megatron_acrl.run.context import RunContext, attach_publisher
    from megatron_acrl.servers.handle import RolloutServers
    from megatron_acrl.world.distributed import init_distributed

    cfgs = {p: layout_config(args.worker, args, args.server_url, p) for p in PATHS}
    rank, world = init_distributed(cfgs["per_source"])
    policy = Policy(cfgs["per_source"])
    policy.load_hf(args.server_ckpt)
    own = {n for n, _, _ in policy.hf_source_meta()}
    received = [0]
    policy.hf_weights = _counting(policy.hf_weights, own, received)  # type: ignore[method-assign]
    work = Path(args.work_dir)
    ctxs = {}
    for p, cfg in cfgs.items():
        label = policy.sync_source.label if policy.sync_source else ""
        servers = (
            RolloutServers(cfg, args.server_ckpt, work / f"logs-{p}", source_label=label)
            if rank == 0
            else None
        )
        ctx = RunContext(
            cfg, argparse.Namespace(), rank, world, work, Path(args.server_ckpt), None, None, policy
        )
        ctx.servers = servers
        attach_publisher(ctx, True)
        ctxs[p] = ctx
    res: dict[str, Any] = {"times": {p: [] for p in PATHS}, "ranks": world, "metrics": {}}
    for p in PATHS:  # warm-up: groups formed, buffers allocated
        ctxs[p].publisher.push(f"warmup-{p}")
    for i in range(args.reps):
        for p in PATHS if i % 2 == 0 else PATHS[::-1]:
            received[0] = 0
            dist.barrier()
            t0 = time.perf_counter()
            m = ctxs[p].publisher.push(f"{p}-{i}")
            res["times"][p].append(time.perf_counter() - t0)
            res["metrics"][p] = m
            if p == "rank0":
                res["rank0_received"] = received[0]
    if rank == 0:
        Path(args.out).write_text(json.dumps(res))
    for ctx in ctxs.values():
        ctx.close()
    dist.barrier()


def report_layout(name: str, res: dict[str, Any], reps: int) -> tuple[float, float]:
    """Print layout ``name``'s lines; returns (busiest rank bytes share, per-source sync time ratio)."""
    spec = LAYOUTS[name]
    r0, ps = res["metrics"]["rank0"], res["metrics"]["per_source"]
    model = r0["sync/bytes"]
    kind = f"MoE {spec['ep']}-way expert parallel" if spec["moe"] else "dense"
    print(
        f"== layout {name}: pp={spec['pp']} ep={spec['ep']} on {res['ranks']} ranks ({kind}), "
        f"{model / 1e6:.1f} MB per sync"
    )
    for i, (a, b) in enumerate(zip(res["times"]["rank0"], res["times"]["per_source"], strict=True)):
        print(f"[{name}] rep {i}: rank-0 path {a:.3f}s, per-source {b:.3f}s")
    rank0_share = (model + res["rank0_received"]) / model
    print(
        f"rank-0 path: rank 0 sends {model / 1e6:.1f} MB to the servers and receives "
        f"{res['rank0_received'] / 1e6:.1f} MB of other ranks' tensors: {rank0_share:.3f} of the model"
    )
    share = ps["sync/busiest_source_share"]
    print(
        f"per-source: {ps['sync/sources']:.0f} sources, the busiest sends {share:.3f} of the model "
        "and receives nothing"
    )
    t0, t1 = median(res["times"]["rank0"]), median(res["times"]["per_source"])
    print(
        f"rank-0 path {t0:.3f}s, per-source {t1:.3f}s (medians of {reps}, whole push_weights on every rank)"
    )
    return share, t1 / t0


KEY_ENV = "ACRL_BENCH_LAYOUTS_KEY"
"""Where the layout workers find the key of the benchmark's servers (``rollout.api_key_env``)."""


def layouts_key() -> str:
    """The benchmark's server key: made once per process and exported, so the torchrun workers
    inherit it in their environment (never on a command line)."""
    from sglang_bridge.server_key import new_api_key

    if not os.environ.get(KEY_ENV):
        os.environ[KEY_ENV] = new_api_key()
    return os.environ[KEY_ENV]


def start_layout_servers(
    names: list[str], args: argparse.Namespace, work: Path, stack: Any
) -> dict[bool, tuple[str, str]]:
    """One server per model kind the layouts need (dense / MoE), entered on ``stack``: kind -> (url, ckpt)."""
    from megatron_acrl.warmstart.tiny_model import build_checkpoint
    from sglang_bridge.server import ServerSpec, SGLangServer

    out = {}
    for moe in sorted({LAYOUTS[n]["moe"] for n in names}):
        ckpt = build_checkpoint(model_config(args, moe), cache_dir=work / "models")
        spec = ServerSpec(model_path=str(ckpt), device="cpu", api_key=layouts_key())
        srv = stack.enter_context(
            SGLangServer(
                spec, work / f"sglang-layouts-{'moe' if moe else 'dense'}.log", startup_timeout_s=900
            )
        )
        out[moe] = (srv.url, str(ckpt))
    return out
