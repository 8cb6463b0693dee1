"""Weight-sync throughput of the bridge vs a raw transfer of the same bytes, on the same group, same run;
and per layout, the per-source sync against today's rank-0 path.

    python benchmarks/weight_sync.py [--layout pp2,ep2,pp2ep2,pp1] [--layers 8 --hidden 768 --experts 8]
                                     [--reps 15 --bucket-mb 512 --first-bucket-mb 32]
                                     [--placements shared,split]

``--layout pp2 / ep2 / pp2ep2``: real Megatron layouts (PP=2 dense, EP=2 MoE, PP=2 x EP=2 MoE) push
the same weights into a real SGLang server, the rank-0 path and the per-source path alternating
(``benchmarks/_weight_sync_layouts.py``); each prints ``busiest rank bytes share`` and
``per-source sync time ratio``. ``pp1`` is the measurement below, at PP=1 (one source):

Starts a real SGLang server (CPU: bf16, so FP8 is fake-quant, block 128x128) on a locally built
model, connects a :class:`DistributedWeightSynchronizer`, and measures, interleaved (the order flips
every rep), median of ``reps``:

* raw:    the bytes the bridge puts on the wire (checked equal), pre-flattened once outside the
          timing, as one ``/update_weights_from_distributed`` request + one broadcast on the bridge's
          group, between the begin/end calls SGLang 0.5.23 requires (without them it answers 400 and
          never joins the broadcast). The server must join the broadcast and load what it
          received, so this is the least any transfer into the server costs;
* bridge: ``sync()`` with the bridge's defaults: validation against the manifest, FP8 fake-quant,
          bucketing (quantized straight into the send buffers, overlapped with the transfer),
          pause -> begin -> buckets (the last one flushes the radix cache) -> end -> version ->
          continue.

Each placement gets its own server and its own interleaved reps; the last one is the goal figure:

* ``shared``: server and trainer may run on every core. On a 2-core machine the raw transfer then
  has the server receive and load on both cores, and the bridge's packing thread competes with it
  for them (no GPU deployment has this contention: there the packing runs on the trainer's GPU and
  the transfer into the rollout GPU costs no server CPU);
* ``split`` (default goal): the server runs on the last core (``ServerSpec.cpus``, the CPU
  counterpart of its own GPU) and the trainer on the others, so each side's work competes only with
  its own, as on GPU nodes. Both paths run under the same placement.

Also block-FP8 quantize throughput (the bridge's real-mode path: e4m3 + scales into preallocated
outputs) vs a plain copy of the same input bytes, interleaved. Prints, per placement, the bridge's
median breakdown (quantize / pack run on the packing thread, overlapped with "wire"; "wait" is the
part of them the transfer did not hide), the mean CPU seconds each path costs the trainer process
and the server's process tree (less sensitive to other jobs than wall time on a shared machine),
the server's page faults per transfer; then the load average, ``shared-core sync efficiency``,
``quantize efficiency: <copy time / quantize time>`` and, last, ``sync efficiency: <raw / bridge>``
of the last placement. The goal lines come last: each layout's two figures, then (``pp1``) the
shared-core and quantize figures and ``sync efficiency``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from statistics import median

import psutil
import torch

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: its sibling module
import _weight_sync_layouts as layouts  # noqa: E402

from megatron_acrl.warmstart.tiny_model import build_checkpoint
from sglang_bridge.fp8 import (
    FP8_DTYPE,
    Fp8Scheme,
    Fp8Workspace,
    fake_quantize_block_into,
    quantize_block_into,
    quantize_named_tensors,
    should_quantize,
)
from sglang_bridge.server import ServerSpec, SGLangServer
from sglang_bridge.weight_sync import (
    DistributedWeightSynchronizer,
    Manifest,
    SyncReport,
    broadcast_async,
)
from sglang_bridge.weight_sync.buckets import Bucket


def load_named(path: Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return {k: v.to(manifest.tensors[k].dtype) for k, v in out.items()}


def raw_transfer(sync: DistributedWeightSynchronizer, flat: Bucket) -> float:
    """begin -> one request + one broadcast of pre-flattened bytes -> end; returns seconds.

    begin/end are part of the minimal protocol: without them SGLang 0.5.23 answers 400 and never
    joins the broadcast."""
    client = sync._calls.clients[0]
    assert sync.group is not None
    t0 = time.perf_counter()
    sync._calls.run(client.begin_weight_update())
    fut = sync._calls.submit(
        client.update_weights_from_distributed(
            flat.names, flat.dtypes, flat.shapes, sync.group_name, load_format="flattened_bucket"
        )
    )
    work = broadcast_async(flat.flat, sync.group)
    # Waited on exactly like the bridge's buckets: the server's answer first (it comes once the
    # bytes are received and loaded), then the broadcast handle.
    r = fut.result(timeout=120)
    assert r.get("success"), r
    work.wait(timeout=timedelta(seconds=120))
    sync._calls.run(client.end_weight_update())
    return time.perf_counter() - t0


class CpuMeter:
    """CPU seconds (user + system) of this process and of the server's process tree, and the
    server's minor page faults, per call.

    On a shared machine wall times swing with other jobs' load; the CPU each side spends per sync
    does much less, and shows what the bridge costs beyond the raw transfer (quantize/pack on the
    trainer, per-request and lifecycle work on the server). The page faults show the other thing
    that moves both sides: the server receives every request into a new buffer, which glibc takes
    from its reused heap only up to its (dynamic, at most 32 MiB) mmap threshold; larger buffers
    are fresh mappings, faulted and zero-filled on every transfer (see docs/bridge.md)."""

    def __init__(self, server_pid: int):
        root = psutil.Process(server_pid)
        self.server = [root, *root.children(recursive=True)]
        self.me = psutil.Process()

    @staticmethod
    def _cpu(procs: list[psutil.Process]) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    def _faults(self) -> int:
        # minflt: the 10th field of /proc/<pid>/stat, the 8th after the parenthesised name
        return sum(
            int(Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[7]) for p in self.server
        )

    def __call__(self, fn: Callable[[], float]) -> tuple[float, float, float, int]:
        """Run ``fn`` (returns its wall seconds); returns (wall, trainer cpu, server cpu, server
        minor page faults)."""
        c0, s0, f0 = self._cpu([self.me]), self._cpu(self.server), self._faults()
        wall = fn()
        return wall, self._cpu([self.me]) - c0, self._cpu(self.server) - s0, self._faults() - f0


def bench_quantize(
    named: dict[str, torch.Tensor], scheme: Fp8Scheme, reps: int
) -> tuple[list[float], list[float], list[float], int]:
    """Per rep, interleaved: block-FP8 quantize (the bridge's real-mode path: e4m3 + scales written
    into preallocated outputs), a plain copy of the same input bytes into preallocated outputs, and
    fake-quant (what a CPU sync runs). Returns (quantize, copy, fake) seconds per rep and the bytes."""
    ws = [t for n, t in named.items() if should_quantize(n, t, scheme)]
    nbytes = sum(t.numel() * t.element_size() for t in ws)
    bn, bk = scheme.block_size
    dst = [torch.empty_like(t) for t in ws]
    q = [torch.empty(t.shape, dtype=FP8_DTYPE) for t in ws]
    s = [torch.empty(-(-t.shape[0] // bn), -(-t.shape[1] // bk)) for t in ws]
    work = Fp8Workspace()
    qs: list[float] = []
    cs: list[float] = []
    fs: list[float] = []
    for _ in range(reps + 1):  # the first round warms caches and the workspace
        t0 = time.perf_counter()
        for w, qo, so in zip(ws, q, s, strict=True):
            quantize_block_into(w, qo, so, scheme.block_size, ue8m0=scheme.ue8m0, workspace=work)
        t1 = time.perf_counter()
        for d, w in zip(dst, ws, strict=True):
            d.copy_(w)
        t2 = time.perf_counter()
        for d, w in zip(dst, ws, strict=True):
            fake_quantize_block_into(w, d, scheme.block_size, ue8m0=scheme.ue8m0, workspace=work)
        t3 = time.perf_counter()
        qs.append(t1 - t0)
        cs.append(t2 - t1)
        fs.append(t3 - t2)
    return qs[1:], cs[1:], fs[1:], nbytes


@dataclass
class SyncResult:
    """One placement's interleaved measurement: raw transfer seconds and bridge reports per rep, the
    CPU seconds (trainer, server) and server page faults of each."""

    nbytes: int
    raws: list[float] = field(default_factory=list)
    reports: list[SyncReport] = field(default_factory=list)
    cpu: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: {"raw": [], "bridge": []})
    faults: dict[str, list[int]] = field(default_factory=lambda: {"raw": [], "bridge": []})

    @property
    def efficiency(self) -> float:
        return median(self.raws) / median(r.seconds for r in self.reports)


def split_cores(placement: str) -> tuple[tuple[int, ...] | None, set[int] | None]:
    """(server cores, trainer cores) of a placement: ``split`` gives the server the last of this
    process's cores and the trainer the others, as on GPU nodes where the trainer and the rollout
    engine have their own devices; ``shared`` lets both run anywhere."""
    mine = sorted(os.sched_getaffinity(0))
    if placement == "shared":
        return None, None
    if placement != "split":
        raise SystemExit(f"--placements: unknown placement {placement!r}; use split and/or shared")
    if len(mine) < 2:
        raise SystemExit(f"--placements split needs 2 cores, this process has {mine}; use shared")
    return (mine[-1],), set(mine[:-1])


def bind_threads(cores: set[int]) -> None:
    """Bind every thread of this process (threads made later inherit it from their creator)."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task.name), cores)


def measure_sync(
    ckpt: Path,
    manifest: Manifest,
    named: dict[str, torch.Tensor],
    scheme: Fp8Scheme,
    args: argparse.Namespace,
    placement: str,
    work: Path,
) -> SyncResult:
    """Start a server under ``placement`` and time raw transfers and bridge syncs, interleaved."""
    server_cpus, trainer_cpus = split_cores(placement)
    everything = os.sched_getaffinity(0)
    spec = ServerSpec(model_path=str(ckpt), device="cpu", cpus=server_cpus)
    with SGLangServer(spec, work / f"sglang-{placement}.log", startup_timeout_s=900) as srv:
        if trainer_cpus is not None:
            bind_threads(trainer_cpus)  # before connect(): gloo's threads inherit it
        sync = DistributedWeightSynchronizer(
            [srv.url],
            manifest,
            fp8=scheme,
            fp8_mode="fake",
            bucket_size_mb=args.bucket_mb,
            first_bucket_mb=args.first_bucket_mb,
            timeout_s=120,
        )
        sync.connect()
        try:
            # The raw path sends exactly the bytes the bridge sends (fake-quant keeps names and dtypes),
            # pre-flattened once outside the timing.
            sent = list(quantize_named_tensors(named.items(), scheme, mode="fake"))
            nbytes = sum(t.numel() * t.element_size() for _, t in sent)
            flat = Bucket(sent, torch.empty(nbytes, dtype=torch.uint8))
            warm = sync.sync(named, version="warmup")
            assert warm.num_bytes == nbytes, (warm.num_bytes, nbytes)  # same bytes on the wire
            raw_transfer(sync, flat)
            assert srv.pid is not None
            meter = CpuMeter(srv.pid)
            res = SyncResult(nbytes)

            def timed_sync(version: str) -> float:
                res.reports.append(sync.sync(named, version=version))
                return res.reports[-1].seconds

            for i in range(args.reps):
                # Interleaved, and the order flips every rep so neither side always runs second.
                order = ("raw", "bridge") if i % 2 == 0 else ("bridge", "raw")
                for which in order:
                    if which == "raw":
                        wall, mine, server, nflt = meter(lambda: raw_transfer(sync, flat))
                        res.raws.append(wall)
                    else:
                        _, mine, server, nflt = meter(functools.partial(timed_sync, f"bench-{i}"))
                    res.cpu[which].append((mine, server))
                    res.faults[which].append(nflt)
                rep = res.reports[-1]
                print(
                    f"[{placement}] rep {i}: raw {res.raws[-1]:.3f}s, bridge {rep.seconds:.3f}s "
                    f"{rep.num_buckets} buckets fp8={rep.fp8} "
                    + " ".join(f"{k}={v:.3f}" for k, v in rep.timings.items())
                )
        finally:
            sync.close()
            bind_threads(everything)
    return res


def report_sync(placement: str, res: SyncResult, reps: int) -> None:
    """The placement's summary lines (its efficiency line is printed by main, goal last)."""
    server_cpus, trainer_cpus = split_cores(placement)
    where = (
        f"server on core {server_cpus[0]}, trainer on {sorted(trainer_cpus)}"
        if server_cpus and trainer_cpus
        else "server and trainer share every core"
    )
    raw_t = median(res.raws)
    bridge_t = median(r.seconds for r in res.reports)
    last = res.reports[-1]
    print(f"== placement {placement}: {where}")
    print(
        f"model: {last.num_tensors} tensors, {res.nbytes / 1e6:.1f} MB sent per sync, "
        f"{last.num_buckets} buckets"
    )
    print(f"bridge breakdown (medians of {reps}; quantize/pack run on the packing thread, overlapped):")
    for key in last.timings:
        print(f"  {key:<12} {median([r.timings[key] for r in res.reports]):.4f}s")
    total: dict[str, float] = {}
    for which in ("raw", "bridge"):
        # Means: CPU times tick in 10 ms steps, a median of them would round to the tick.
        mine = sum(c[0] for c in res.cpu[which]) / len(res.cpu[which])
        server = sum(c[1] for c in res.cpu[which]) / len(res.cpu[which])
        total[which] = mine + server
        print(f"{which + ' cpu:':<12} trainer {mine:.3f}s, server {server:.3f}s per transfer (means)")
    print(f"cpu ratio (raw / bridge, trainer + server): {total['raw'] / total['bridge']:.3f}")
    print(
        f"server page faults per transfer (medians): raw {median(res.faults['raw']):.0f}, "
        f"bridge {median(res.faults['bridge']):.0f} (4 KiB each)"
    )
    print(f"raw transfer: {raw_t:.3f}s ({res.nbytes / raw_t / 1e9:.2f} GB/s)")
    print(f"bridge sync:  {bridge_t:.3f}s ({res.nbytes / bridge_t / 1e9:.2f} GB/s)")
    ratios = [r / b.seconds for r, b in zip(res.raws, res.reports, strict=True)]
    print("per-rep raw/bridge: " + " ".join(f"{x:.3f}" for x in ratios))


SMOKE: dict[str, float | int] = {
    "--layers": 2,
    "--hidden": 128,
    "--vocab": 512,
    "--experts": 4,
    "--reps": 2,
    "--first-bucket-mb": 0.1,
    "--bucket-mb": 0.5,
}
"""``--smoke``'s settings: a model of ~1-2 MB, several buckets per source, two reps."""


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--layout",
        default="pp2,ep2,pp2ep2,pp1",
        help="comma-separated: pp2 (dense, PP=2), ep2 (MoE, EP=2), pp2ep2 (MoE, PP=2 x EP=2), each the "
        "per-source sync vs the rank-0 path; pp1: the bridge vs a raw transfer at PP=1 (--placements)",
    )
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=8, help="experts of the layouts' MoE model")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--bucket-mb", type=float, default=512, help="the bridge's largest bucket")
    ap.add_argument("--first-bucket-mb", type=float, default=32, help="the bridge's first bucket")
    ap.add_argument(
        "--placements",
        default="shared,split",
        help="comma-separated, each measured with its own server, the last one is the goal figure: "
        "split (the server on the last core, the trainer on the others: each side on its own cores, "
        "as on GPU nodes where trainer and rollout have their own devices) and/or shared (both on "
        "every core: the bridge's packing then competes with the server for it)",
    )
    ap.add_argument("--layout-timeout", type=float, default=3600, help="seconds one layout may take")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a short run that checks the benchmark, not the goals: "
        + " ".join(f"{k} {v}" for k, v in SMOKE.items())
        + " (flags given win)",
    )
    ap.add_argument("--work-dir", default=None)
    for hidden in ("--worker", "--server-url", "--server-ckpt", "--out"):  # one rank of a layout
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        given = {a.split("=")[0] for a in sys.argv[1:]}
        for flag, value in SMOKE.items():
            dest = flag[2:].replace("-", "_")
            if flag not in given:  # a flag given on the command line wins
                setattr(args, dest, value)
    return args


def check_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(layouts, placements), refused before anything is built."""
    names = [n.strip() for n in args.layout.split(",") if n.strip()]
    bad = [n for n in names if n not in (*layouts.LAYOUTS, "pp1")]
    if bad or not names or len(set(names)) != len(names):
        raise SystemExit(f"--layout {args.layout!r}: give each of pp2, ep2, pp2ep2, pp1 at most once")
    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    if not placements or len(set(placements)) != len(placements):
        raise SystemExit(f"--placements {args.placements!r}: give split and/or shared, each once")
    for p in placements:
        split_cores(p)  # a bad placement fails before the model is built
    return names, placements


def main() -> None:
    args = parse_args()
    if args.worker:
        layouts.worker(args)
        return
    names, placements = check_args(args)
    load0 = os.getloadavg()[0]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-weight-sync-"))
    goals: list[str] = []
    megatron = [n for n in names if n != "pp1"]
    with contextlib.ExitStack() as stack:
        servers = layouts.start_layout_servers(megatron, args, work, stack) if megatron else {}
        for name in megatron:
            res = layouts.run_layout(name, args, servers[layouts.LAYOUTS[name]["moe"]], work)
            share, ratio = layouts.report_layout(name, res, args.reps)
            goals += [
                f"busiest rank bytes share [{name}]: {share:.3f}",
                f"per-source sync time ratio [{name}]: {ratio:.3f}",
            ]
    if "pp1" in names:
        goals += measure_pp1(args, placements, work)
    print(f"load average (1 min): {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    for line in goals:
        print(line)


def measure_pp1(args: argparse.Namespace, placements: list[str], work: Path) -> list[str]:
    """The bridge vs a raw transfer at PP=1 under each placement; returns its goal lines."""
    torch.set_num_threads(1)  # the server needs the other core; both paths run under the same limit
    cfg = layouts.model_config(args, moe=False)
    ckpt = build_checkpoint(cfg, cache_dir=work / "models")
    manifest = Manifest.from_checkpoint(ckpt)
    named = load_named(ckpt, manifest)
    scheme = Fp8Scheme("block", (128, 128))

    qs, cs, fs, q_bytes = bench_quantize(named, scheme, args.reps)
    q_t, c_t, f_t = median(qs), median(cs), median(fs)
    print(
        f"block-FP8 quantize: {q_bytes / 1e6:.1f} MB in {q_t:.4f}s ({q_bytes / q_t / 1e9:.2f} GB/s); "
        f"plain copy {c_t:.4f}s ({q_bytes / c_t / 1e9:.2f} GB/s); "
        f"fake-quant {f_t:.4f}s ({q_bytes / f_t / 1e9:.2f} GB/s)  [medians of {args.reps}]"
    )
    results = {p: measure_sync(ckpt, manifest, named, scheme, args, p, work) for p in placements}
    for p, res in results.items():
        report_sync(p, res, args.reps)
    lines = [f"{p}-core sync efficiency: {results[p].efficiency:.3f}" for p in placements[:-1]]
    lines.append(f"quantize efficiency: {median([c / q for c, q in zip(cs, qs, strict=True)]):.3f}")
    lines.append(f"sync efficiency: {results[placements[-1]].efficiency:.3f}")
    return lines


if __name__ == "__main__":
    main()
