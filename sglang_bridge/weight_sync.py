"""Push trainer weights (HF names) into running SGLang servers over a torch.distributed group.

    manifest = Manifest.from_checkpoint(served_model_path)            # what the servers hold
    sync = DistributedWeightSynchronizer([srv.url], manifest)          # gloo on CPU, nccl on GPU
    sync.connect()                                                     # /init_weights_update_group
    report = sync.sync(hf_named_tensors, version="step-1")             # one full update
    sync.verify(prompts, reference_logprobs)                           # max |delta logp| vs trainer
    sync.close()

One update (:meth:`DistributedWeightSynchronizer.sync`):

1. validate every (name, shape, dtype) that will be sent against the served model's
   :class:`Manifest` - SGLang itself accepts unknown names (skipped), wrong shapes (CPU) and dtype
   casts silently, so this is the only guard. A materialised input (dict / list) is checked
   completely before anything touches a server; a one-shot iterator is checked tensor by tensor
   before its bucket is sent;
2. pause generation -> flush the radix cache -> ``/begin_weight_update``;
3. bucketed broadcasts: each bucket is one ``/update_weights_from_distributed`` request in
   ``flattened_bucket`` format (all tensors' bytes concatenated into one uint8 tensor, so FP8 crosses
   gloo, which cannot broadcast float8) plus one broadcast from rank 0;
4. ``/end_weight_update`` (SGLang's post-load processing) -> ``/update_weight_version`` -> continue.

The version is advanced only after ``end_weight_update`` succeeded. If anything fails after step 2
the servers stay *paused* (never generating on half-updated weights) and :class:`WeightSyncError`
says so; calling ``sync`` again with a full set of weights is safe and resumes generation (after a
:class:`WeightSyncTimeoutError`, a server that did not answer in time, through a new synchronizer).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import queue
import struct
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from sglang_bridge.client import PauseMode, SamplingParams, SGLangClient, SGLangHTTPError
from sglang_bridge.fp8 import (
    FP8_DTYPE,
    Fp8Scheme,
    Fp8Workspace,
    fake_quantize,
    fake_quantize_block_into,
    quantize,
    quantize_block_into,
    should_quantize,
)

log = logging.getLogger(__name__)

_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


_NOT_FLUSHED = "cache was not flushed"
"""SGLang's answer when a bucket loaded but its flush found requests still being retracted."""


class WeightSyncError(RuntimeError):
    """A weight update failed; the message says what state the servers were left in."""


class ManifestMismatchError(WeightSyncError, ValueError):
    """Tensors to send do not match the served model; nothing was sent."""


class WeightSyncTimeoutError(WeightSyncError, TimeoutError):
    """A server did not join a broadcast or answer within ``timeout_s``: it is hung, gone or far
    slower than the timeout allows. Its requests may still be pending in it, so recover through a
    new synchronizer (``close()``, then ``connect()`` a fresh one), not by retrying on this group."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Manifest:
    """Name -> (shape, dtype) of every weight the served model loads, as the server holds it."""

    tensors: dict[str, TensorSpec]
    tied: dict[str, str] = field(default_factory=dict)
    """Names the server does not load because they are tied to another (``lm_head.weight``)."""
    quantization_config: dict[str, Any] | None = None
    model_path: str = ""

    @classmethod
    def from_checkpoint(cls, model_path: str | Path, served_dtype: torch.dtype = torch.bfloat16) -> Manifest:
        """Read safetensors headers (no tensor data) and ``config.json`` of an HF checkpoint.

        Floating tensors are recorded in ``served_dtype`` (SGLang casts at load time to ``--dtype``),
        except FP8 weights and their fp32 scales, which the server keeps as they are.
        """
        path = Path(model_path)
        cfg = json.loads((path / "config.json").read_text())
        qc = cfg.get("quantization_config")
        tensors: dict[str, TensorSpec] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        for f in files:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                dt = _ST_DTYPES[info["dtype"]]
                is_scale = name.endswith(("weight_scale_inv", "weight_scale", "input_scale"))
                if (
                    dt.is_floating_point
                    and dt not in (torch.float8_e4m3fn, torch.float8_e5m2)
                    and not is_scale
                ):
                    dt = served_dtype
                tensors[name] = TensorSpec(tuple(info["shape"]), dt)
        tied = {}
        if cfg.get("tie_word_embeddings") and "lm_head.weight" not in tensors:
            tied["lm_head.weight"] = "model.embed_tokens.weight"
        return cls(tensors, tied, qc, str(path))

    def check(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> str | None:
        """None if ``(name, shape, dtype)`` matches, else a one-line reason."""
        spec = self.tensors.get(name)
        if spec is None:
            if name in self.tied:
                return (
                    f"{name}: tied to {self.tied[name]} in the served model (tie_word_embeddings); "
                    "SGLang would ignore it - send only the tied-to tensor"
                )
            import difflib

            near = difflib.get_close_matches(name, list(self.tensors), n=1, cutoff=0.6)
            return f"{name}: not a weight of the served model" + (
                f" (did you mean {near[0]}?)" if near else ""
            )
        if tuple(shape) != spec.shape:
            return f"{name}: shape {tuple(shape)} != served {spec.shape}"
        if dtype != spec.dtype:
            return f"{name}: dtype {_dtype_str(dtype)} != served {_dtype_str(spec.dtype)}"
        return None

    def __len__(self) -> int:
        return len(self.tensors)


def _dtype_str(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


@dataclass
class SyncReport:
    version: str
    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float
    fp8: str
    """"none", "real" (FP8 tensors sent) or "fake-quant" (FP8-rounded bf16 sent to a bf16 server)."""
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def gbytes_per_s(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-9) / 1e9


@dataclass
class VerifyReport:
    version: str
    max_abs_delta: float
    mean_abs_delta: float
    num_tokens: int
    per_prompt_max: list[float]

    def ok(self, tol: float) -> bool:
        return self.max_abs_delta <= tol


ReferenceLogprobs = Callable[[list[list[int]], list[list[int]], float], list[list[float]]]
"""``(prompt_ids, output_ids, temperature) -> per-output-token log-probs`` computed by the trainer."""


class WeightSynchronizer(ABC):
    """Keeps rollout servers on the trainer's weights."""

    version: str | None

    @abstractmethod
    def connect(self) -> None:
        """Set up the transport to the servers."""

    @abstractmethod
    def sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        version: str,
        *,
        quantize: bool = True,
    ) -> SyncReport:
        """Replace the served weights by ``named_tensors`` (HF names, full tensors) as ``version``.

        ``quantize=False`` sends them as they are even where the synchronizer FP8-quantizes (only to
        a server that holds bf16 weights, i.e. fake-quant: e.g. to evaluate the trainer's own weights).
        """

    @abstractmethod
    def verify(
        self,
        prompts: Sequence[Sequence[int]],
        reference: ReferenceLogprobs,
        *,
        max_new_tokens: int = 8,
        temperature: float = 1.0,
    ) -> VerifyReport:
        """Compare the servers' log-probs on ``prompts`` with the trainer's ``reference``."""

    @abstractmethod
    def close(self) -> None:
        """Tear the transport down (idempotent)."""

    def __enter__(self) -> WeightSynchronizer:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def host_update_store(
    master_address: str, master_port: int, world_size: int, timeout: timedelta
) -> dist.TCPStore:
    """Rank 0's TCP store of the weight-update group, bound *before* any server is told its port.

    ``master_port=0`` lets the OS pick a free port at bind time (read it back from ``store.port``).
    Picking a "free" port first and binding it later is racy: another process (a server starting
    next to us takes several ports for its own IPC) can take it in between, and the servers would
    then dial whatever took it.
    """
    try:
        return dist.TCPStore(
            master_address, master_port, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
    except (RuntimeError, OSError) as e:
        raise WeightSyncError(
            f"cannot host the weight-update store on {master_address}:{master_port} ({e}); leave "
            "master_port unset to let the OS pick a free port, or choose one that is free"
        ) from e


def create_update_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """The trainer's end of the weight-update group, built exactly like SGLang's server end.

    SGLang's ``init_custom_process_group`` does a TCP rendezvous, wraps the store in
    ``PrefixStore(group_name)`` and calls torch's group factory; the store keys must match on both
    ends, so we do the same (rank 0 hosts the TCP store). No default process group is needed or
    touched: the group is passed explicitly to every collective.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    # A TCPStore built directly, not dist.rendezvous("tcp://..."): under torchrun the rendezvous
    # handler sees TORCHELASTIC_USE_AGENT_STORE and joins the *agent's* store as a client instead of
    # hosting this one, so trainer and servers would all wait for a host that never comes.
    if store is None:  # ``store``: one already hosted by :func:`host_update_store`
        store = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast_async(tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Start a broadcast of ``tensor`` from group rank 0; returns the work handle."""
    return dist.broadcast(tensor, src=0, group=group, async_op=True)


OutMeta = tuple[str, tuple[int, ...], torch.dtype]
"""(name, shape, dtype) of one tensor as it goes on the wire."""


@dataclass
class _Entry:
    """One input tensor and what it becomes on the wire: ``outs`` (one tensor, or an FP8 weight and
    its scale) and ``fill``, which writes them into their views of a send bucket."""

    name: str
    tensor: torch.Tensor
    outs: list[OutMeta]
    kind: Literal["copy", "fp8"] = "copy"
    fill: Callable[[list[torch.Tensor], Fp8Workspace], None] | None = None

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for _, s, d in self.outs)


def _copy_entry(name: str, t: torch.Tensor) -> _Entry:
    return _Entry(name, t, [(name, tuple(t.shape), t.dtype)])


class _Bucket:
    """Tensors packed into one flat uint8 buffer, largest itemsize first so every offset is aligned
    (SGLang's receiver rejects a tensor whose byte offset is not a multiple of its itemsize).

    ``items``: ``(name, tensor)`` pairs to copy, or :class:`_Entry` whose ``fill`` writes its FP8
    result straight into the bucket (no intermediate tensor, no concatenation). ``seconds`` holds
    the time spent per entry kind ("copy" = packing, "fp8" = quantizing into place).
    """

    def __init__(
        self,
        items: Sequence[tuple[str, torch.Tensor] | _Entry],
        buf: torch.Tensor,
        workspace: Fp8Workspace | None = None,
    ):
        entries = [it if isinstance(it, _Entry) else _copy_entry(*it) for it in items]
        slots = [(e, j) for e in entries for j in range(len(e.outs))]
        slots.sort(key=lambda s: -s[0].outs[s[1]][2].itemsize)  # stable: input order within a dtype
        self.names = [e.outs[j][0] for e, j in slots]
        self.dtypes = [_dtype_str(e.outs[j][2]) for e, j in slots]
        self.shapes = [list(e.outs[j][1]) for e, j in slots]
        views: dict[int, list[torch.Tensor]] = {id(e): [torch.empty(0)] * len(e.outs) for e in entries}
        off = 0
        for e, j in slots:
            _, shape, dtype = e.outs[j]
            nb = math.prod(shape) * dtype.itemsize
            views[id(e)][j] = buf[off : off + nb].view(dtype).view(shape)
            off += nb
        self.flat = buf[:off]
        self.nbytes = off
        self.seconds = {"copy": 0.0, "fp8": 0.0}
        self.last = False
        """The update's last bucket: its request also flushes the servers' radix cache."""
        ws = workspace or Fp8Workspace()
        for e in entries:
            t0 = time.perf_counter()
            if e.fill is None:
                views[id(e)][0].copy_(e.tensor.reshape(e.outs[0][1]), non_blocking=True)
            else:
                e.fill(views[id(e)], ws)
            self.seconds[e.kind] += time.perf_counter() - t0


@dataclass
class _InFlight:
    """A bucket on its way: the servers' answers (``fut``), the broadcast (``work``), the send buffer
    it occupies (``idx``), ``answered_at``, the ``perf_counter`` time every server had answered
    (0 until then), and ``loaded``, set once every server's answer was checked."""

    bucket: _Bucket
    idx: int
    fut: concurrent.futures.Future[Any]
    work: dist.Work
    answered_at: float = 0.0
    loaded: bool = False


class DistributedWeightSynchronizer(WeightSynchronizer):
    """Weight sync through ``/update_weights_from_distributed`` to one or many SGLang servers.

    The trainer is rank 0 of a group with every server's TP ranks (``world = 1 + sum(server_tp)``):
    one broadcast reaches all servers. gloo on CPU, nccl when ``device`` is CUDA; the code path is
    the same. Public methods are blocking and thread-safe to call from a driver loop; HTTP runs on a
    private event loop thread so they can also be called while other event loops run.

    ``fp8``: None sends tensors as given; with a scheme, quantizable weights are FP8-quantized on the
    way ("real": e4m3 + scales, for an FP8 server) or fake-quantized ("fake": FP8-rounded values in
    the original dtype, for a bf16 CPU server; reported as ``fp8="fake-quant"``).
    """

    def __init__(
        self,
        urls: Sequence[str],
        manifest: Manifest,
        *,
        server_tp: int | Sequence[int] = 1,
        api_key: str | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str | None = None,
        device: torch.device | str = "cpu",
        bucket_size_mb: float = 512,
        first_bucket_mb: float = 32,
        fp8: Fp8Scheme | None = None,
        fp8_mode: Literal["real", "fake"] = "fake",
        pause_mode: PauseMode = "retract",
        require_complete: bool = True,
        timeout_s: float = 300.0,
    ):
        self.urls = list(urls)
        if not self.urls:
            raise ValueError("no servers")
        self.manifest = manifest
        self.server_tp = [server_tp] * len(self.urls) if isinstance(server_tp, int) else list(server_tp)
        self.api_key = api_key
        self.master_address = master_address
        self.master_port = master_port
        # Unique by default: torch and the server refuse a second group under an existing name.
        self.group_name = group_name or f"acrl_weight_update_{uuid.uuid4().hex[:8]}"
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.bucket_bytes = max(1, int(bucket_size_mb * 1024 * 1024))
        self.first_bucket_bytes = max(1, min(self.bucket_bytes, int(first_bucket_mb * 1024 * 1024)))
        self.fp8 = fp8
        self.fp8_mode = fp8_mode
        self.pause_mode = pause_mode
        self.require_complete = require_complete
        self.timeout_s = timeout_s
        self.version: str | None = None
        self.group: dist.ProcessGroup | None = None
        self._dirty = False  # servers paused on partially updated weights
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weight-sync-http", daemon=True)
        self._thread.start()
        self._clients: list[SGLangClient] = self._run(self._make_clients())
        self._bufs: list[torch.Tensor] = []
        self._fp8_ws = Fp8Workspace()  # used by the (one) packing thread only
        self._validated: tuple[Any, ...] | None = None  # key of the last input set that validated

    # -- plumbing -------------------------------------------------------------------------
    async def _make_clients(self) -> list[SGLangClient]:
        return [
            SGLangClient(u, api_key=self.api_key, timeout_s=self.timeout_s, max_concurrency=16)
            for u in self.urls
        ]

    def _submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Any) -> Any:
        return self._submit(coro).result()

    def _all(self, method: str, *args: Any, **kw: Any) -> list[Any]:
        return self._submit_all(method, *args, **kw).result()

    def _submit_all(self, method: str, *args: Any, **kw: Any) -> concurrent.futures.Future[list[Any]]:
        """``method`` on every server at once; the future holds their answers in server order."""

        async def go() -> list[Any]:
            return list(await asyncio.gather(*(getattr(c, method)(*args, **kw) for c in self._clients)))

        return self._submit(go())

    @property
    def fp8_label(self) -> str:
        if self.fp8 is None:
            return "none"
        return "real" if self.fp8_mode == "real" else "fake-quant"

    # -- connect / close --------------------------------------------------------------------
    def connect(self) -> None:
        """Rendezvous with every server through ``/init_weights_update_group``."""
        if self.group is not None:
            return
        world = 1 + sum(self.server_tp)
        # Bind first, then tell the servers the port the store actually holds (see host_update_store).
        store = host_update_store(
            self.master_address, self.master_port or 0, world, timedelta(seconds=self.timeout_s)
        )
        port = store.port
        offsets = [1 + sum(self.server_tp[:i]) for i in range(len(self.urls))]

        async def init_all() -> list[Any]:
            return list(
                await asyncio.gather(
                    *(
                        c.init_weights_update_group(
                            self.master_address, port, off, world, self.group_name, self.backend
                        )
                        for c, off in zip(self._clients, offsets, strict=True)
                    )
                )
            )

        fut = self._submit(init_all())  # the servers block in rendezvous until we join below
        try:
            self.group = create_update_group(
                self.backend,
                self.master_address,
                port,
                world,
                0,
                self.group_name,
                timedelta(seconds=self.timeout_s),
                store=store,
            )
            results = fut.result(timeout=self.timeout_s)
        except BaseException as e:
            fut.cancel()
            raise WeightSyncError(f"could not form the weight-update group with {self.urls}: {e}") from e
        for url, r in zip(self.urls, results, strict=True):
            if not (isinstance(r, dict) and r.get("success")):
                raise WeightSyncError(f"{url} refused /init_weights_update_group: {r}")
        log.info(
            "weight-update group %s ready: backend=%s world=%d servers=%s",
            self.group_name,
            self.backend,
            world,
            self.urls,
        )

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self.group is not None:
            try:
                self._all("destroy_weights_update_group", self.group_name)
            except Exception as e:  # a dead server must not block the trainer's shutdown
                log.warning("destroy_weights_update_group failed: %s", e)
            dist.destroy_process_group(self.group)
            self.group = None

        async def close_clients() -> None:
            await asyncio.gather(*(c.aclose() for c in self._clients), return_exceptions=True)

        self._run(close_clients())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    # -- validation -----------------------------------------------------------------------
    def _out_meta(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> list[tuple[str, tuple, Any]]:
        """What will actually be sent for one input tensor (after the FP8 step)."""
        if self.fp8 is None or self.fp8_mode == "fake":
            return [(name, shape, dtype)]
        if not should_quantize(name, torch.empty(shape, device="meta", dtype=dtype), self.fp8):
            return [(name, shape, dtype)]
        if self.fp8.granularity == "block":
            bn, bk = self.fp8.block_size
            sshape: tuple[int, ...] = (-(-shape[0] // bn), -(-shape[1] // bk))
        elif self.fp8.granularity == "per_channel":
            sshape = (shape[0], 1)
        else:
            sshape = (1,)
        return [
            (name, shape, FP8_DTYPE),
            (name[: -len("weight")] + self.fp8.scale_suffix, sshape, torch.float32),
        ]

    def validate(self, meta: Iterable[tuple[str, Sequence[int], torch.dtype]]) -> None:
        """Raise :class:`ManifestMismatchError` listing every input tensor that would not match."""
        errors: list[str] = []
        seen: set[str] = set()
        for name, shape, dtype in meta:
            for oname, oshape, odtype in self._out_meta(name, tuple(shape), dtype):
                if oname in seen:
                    errors.append(f"{oname}: sent twice")
                seen.add(oname)
                if (err := self.manifest.check(oname, oshape, odtype)) is not None:
                    errors.append(err)
        if self.require_complete and not errors:
            missing = sorted(set(self.manifest.tensors) - seen)
            if missing:
                errors.append(
                    f"{len(missing)} served weights not in the update (a partial update would mix "
                    f"versions; pass require_complete=False for that): {missing[:5]}"
                )
        if errors:
            raise ManifestMismatchError(
                f"refusing weight update for {self.manifest.model_path or 'the served model'} "
                f"({len(errors)} problems, nothing sent):\n  " + "\n  ".join(errors[:20])
            )

    # -- sync -----------------------------------------------------------------------------
    def _buffer(self, i: int, nbytes: int) -> torch.Tensor:
        """Reusable flat send buffer ``i`` (grow-only, so steady-state syncs allocate nothing)."""
        while len(self._bufs) <= i:
            self._bufs.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._bufs[i].numel() < nbytes:
            self._bufs[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._bufs[i]

    def _entry(self, name: str, t: torch.Tensor) -> _Entry:
        """What ``t`` becomes on the wire (after the FP8 step) and how to write it into a bucket."""
        scheme = self.fp8
        if scheme is None or not should_quantize(name, t, scheme):
            return _copy_entry(name, t)
        outs = self._out_meta(name, tuple(t.shape), t.dtype)
        block = scheme.granularity == "block"

        def fake(views: list[torch.Tensor], ws: Fp8Workspace) -> None:
            if block:
                fake_quantize_block_into(t, views[0], scheme.block_size, ue8m0=scheme.ue8m0, workspace=ws)
            else:
                views[0].copy_(fake_quantize(t, scheme))

        def real(views: list[torch.Tensor], ws: Fp8Workspace) -> None:
            if block:
                quantize_block_into(
                    t, views[0], views[1], scheme.block_size, ue8m0=scheme.ue8m0, workspace=ws
                )
            else:
                q, s = quantize(t, scheme)
                views[0].copy_(q)
                views[1].copy_(s)

        return _Entry(name, t, outs, "fp8", fake if self.fp8_mode == "fake" else real)

    def _bucket_limit(self, k: int) -> int:
        """Byte budget of bucket ``k``: ``first_bucket_bytes`` doubling up to ``bucket_bytes``.

        Only the first bucket's preparation (FP8, packing) cannot hide behind a transfer, so it is
        small enough to be ready when ``/begin_weight_update`` returns (32 MiB: ~10-20 ms of C
        fake-quant on one core); later buckets grow to keep the number of requests low (each costs
        the server a fixed ~10-40 ms on 2 loaded CPU cores: measured, 5 requests instead of 1 for
        the same bytes cost ~30% more)."""
        return min(self.bucket_bytes, self.first_bucket_bytes << min(k, 40))

    def _groups(
        self, tensors: Iterable[tuple[str, torch.Tensor]], checked: bool, stop: threading.Event
    ) -> Iterator[tuple[list[_Entry], bool]]:
        """Consecutive tensors grouped by the bytes they put on the wire, up to :meth:`_bucket_limit`
        (a larger tensor gets its own bucket), each with whether it is the last group."""
        cur: list[_Entry] = []
        size = 0
        k = 0
        for name, t in tensors:
            if stop.is_set():
                return
            e = self._entry(name, t.detach().to(self.device))
            if not checked:
                for oname, oshape, odtype in e.outs:
                    if (err := self.manifest.check(oname, oshape, odtype)) is not None:
                        raise ManifestMismatchError(f"refusing tensor mid-stream: {err}")
            nb = e.nbytes
            if cur and size + nb > self._bucket_limit(k):
                yield cur, False
                cur, size, k = [], 0, k + 1
            cur.append(e)
            size += nb
        if cur:
            yield cur, True

    def _prepared_buckets(
        self, tensors: Iterable[tuple[str, torch.Tensor]], checked: bool
    ) -> tuple[Iterator[tuple[_Bucket, int]], Callable[[int], None], Callable[[], None]]:
        """Packed buckets, prepared ahead on a worker thread that starts at once (so bucket 0 is
        prepared while the servers pause and open the update).

        Returns the buckets (each with the index of the send buffer it occupies), ``release(index)``,
        which hands a buffer back once its broadcast is complete, and a shutdown function that stops
        the worker (idempotent; call it whether or not the buckets were used).

        The worker pulls tensors (running any lazy conversion of the caller's stream), FP8-quantizes
        and packs the next bucket straight into a free one of two send buffers while the other is
        being broadcast and loaded by the servers, so that work hides behind the transfer (torch ops
        release the GIL).
        """
        free: queue.Queue[int] = queue.Queue()
        for i in (0, 1):
            free.put(i)
        ready: queue.Queue[Any] = queue.Queue(maxsize=1)
        stop = threading.Event()
        done = object()

        def work() -> None:
            try:
                for entries, last in self._groups(tensors, checked, stop):
                    idx = free.get()
                    if stop.is_set():
                        return
                    nbytes = sum(e.nbytes for e in entries)
                    bucket = _Bucket(entries, self._buffer(idx, nbytes), self._fp8_ws)
                    bucket.last = last
                    ready.put((bucket, idx))
                ready.put(done)
            except BaseException as e:  # forwarded to the sending thread
                ready.put(e)

        worker = threading.Thread(target=work, name="weight-sync-pack", daemon=True)
        worker.start()

        def shutdown() -> None:
            stop.set()
            free.put(0)  # unblock a worker waiting for a buffer
            while worker.is_alive():
                with contextlib.suppress(queue.Empty):
                    ready.get(timeout=0.05)  # unblock a worker waiting to hand over
            worker.join()

        def consume() -> Iterator[tuple[_Bucket, int]]:
            try:
                while (item := ready.get()) is not done:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                shutdown()

        return consume(), free.put, shutdown

    def _post_bucket(self, bucket: _Bucket, idx: int) -> _InFlight:
        """Send ``bucket``: one request per server and the broadcast they will join."""
        assert self.group is not None

        async def post_all() -> list[Any]:
            return list(
                await asyncio.gather(
                    *(
                        c.update_weights_from_distributed(
                            bucket.names,
                            bucket.dtypes,
                            bucket.shapes,
                            self.group_name,
                            load_format="flattened_bucket",
                            # The last bucket's request also resets the radix cache / KV pools once
                            # every weight is in (see sync()).
                            flush_cache=bucket.last,
                        )
                        for c in self._clients
                    )
                )
            )

        fut = self._submit(post_all())
        work = broadcast_async(bucket.flat, self.group)
        f = _InFlight(bucket, idx, fut, work)
        fut.add_done_callback(lambda _: setattr(f, "answered_at", time.perf_counter()))
        return f

    def _await_joined(self, f: _InFlight) -> None:
        """Block until every server has joined ``f``'s broadcast (or one refused the bucket).

        A server handles update requests one at a time, in the order they arrive. A request sent
        while the previous one is still being transferred or loaded waits in the server instead of
        behind a round trip through the trainer; but only once every server has *joined* the previous
        broadcast (the trainer's side of a broadcast completes only then) is it certain that the
        previous request arrived first, so that no server pairs a bucket's bytes with another
        bucket's layout."""
        if self.backend != "gloo":
            # An NCCL root can finish a broadcast small enough for the peers' staging buffers before
            # they join it, so only their answer proves the order there: not pipelined.
            self._finish_bucket(f)
            return
        # gloo's root finishes a broadcast only once every receiver has joined it, whatever its size
        # (checked by tests/bridge/test_weight_sync.py). Polled: with a done-callback on the
        # broadcast's future instead, every transfer on the group was slower (the benchmark's raw
        # transfers: 0.16-0.18 s with it, 0.13 s without, in alternating runs).
        deadline = time.monotonic() + self.timeout_s
        while not (f.work.is_completed() or f.fut.done()):
            if time.monotonic() > deadline:
                raise WeightSyncTimeoutError(f"bucket not received after {self.timeout_s}s")
            time.sleep(0.0005)
        if not f.work.is_completed():
            # A server answered first: a refusal (it never joins), which this raises with the
            # server's answer; or the broadcast is a moment from being marked done.
            self._finish_bucket(f)

    def _finish_bucket(self, f: _InFlight, timeout_s: float | None = None) -> int:
        """Wait (up to ``timeout_s``, default :attr:`timeout_s`) for every server to have loaded
        ``f``'s bucket; returns its bytes. Once only: a bucket already checked (by
        :meth:`_await_joined`) is not waited on or flushed again."""
        if f.loaded:
            return f.bucket.nbytes
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        # Wait on the servers' answers, never blindly on the broadcast: a server answers only after
        # it has received and loaded the bucket, or with an error if it refused it (then it never
        # joins the broadcast, which would wait forever).
        try:
            results = f.fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError as e:
            raise WeightSyncTimeoutError(f"bucket not loaded after {timeout_s:g}s") from e
        except Exception as e:
            raise WeightSyncError(
                f"a server failed the bucket: {e}; the update group is now unusable (reconnect)"
            ) from e
        loaded = [
            isinstance(r, dict) and (r.get("success") or _NOT_FLUSHED in r.get("message", ""))
            for r in results
        ]
        if all(loaded):
            f.work.wait(timeout=timedelta(seconds=max(timeout_s, 1.0)))  # done: all received it
        for url, c, r, ok in zip(self.urls, self._clients, results, loaded, strict=True):
            if ok and not r.get("success"):
                # Loaded, but requests were still being retracted: flush on its own, with retries.
                self._run(c.flush_cache())
            elif not (isinstance(r, dict) and r.get("success")):
                raise WeightSyncError(
                    f"{url} failed to load bucket {f.bucket.names[:3]}...: {r}; "
                    "the update group may be unusable (reconnect)"
                )
        f.loaded = True
        return f.bucket.nbytes

    def sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        version: str,
        *,
        quantize: bool = True,
    ) -> SyncReport:
        if self.group is None:
            raise WeightSyncError("not connected: call connect() first")
        if not quantize and self.fp8 is not None:
            if self.fp8_mode == "real":
                raise WeightSyncError(
                    "quantize=False: the servers hold real FP8 weights (fp8_mode='real') and cannot take "
                    "unquantized ones; only a fake-quant (bf16) server can"
                )
            # The FP8 scheme is part of the validation key and of every packing decision: this one
            # sync runs without it, and the synchronizer is back to quantizing afterwards.
            scheme, self.fp8 = self.fp8, None
            try:
                return self.sync(named_tensors, version)
            finally:
                self.fp8 = scheme
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        checked = isinstance(items, Sequence | type({}.items()))
        if checked:
            items = list(items)
            # A trainer sends the same names / shapes / dtypes every step: checked once, then only
            # compared with the last set that passed (under the same manifest and FP8 settings).
            meta = tuple((n, tuple(t.shape), t.dtype) for n, t in items)
            key = (id(self.manifest), self.fp8, self.fp8_mode, self.require_complete, meta)
            if key != self._validated:
                self.validate(meta)
                self._validated = key
        timings["validate"] = time.perf_counter() - t0
        # The packer starts on bucket 0 now, overlapping the pause / begin round trips.
        buckets, release, stop_packer = self._prepared_buckets(items, checked)
        try:
            return self._update(buckets, release, checked, version, t0, timings)
        finally:
            stop_packer()

    def _update(
        self,
        buckets: Iterator[tuple[_Bucket, int]],
        release: Callable[[int], None],
        checked: bool,
        version: str,
        t0: float,
        timings: dict[str, float],
    ) -> SyncReport:
        """Steps 2-4 of :meth:`sync` (everything that touches the servers)."""
        t = time.perf_counter()
        self._all("pause_generation", self.pause_mode)
        self._dirty = True
        timings["pause"] = time.perf_counter() - t
        # No separate /flush_cache here: the last bucket's request flushes the radix cache after
        # loading (nothing generates while paused, so stale KV is never read in between). The HTTP
        # /flush_cache also runs a full gc.collect() of the server heap on CPU SGLang (its
        # empty_cache), ~0.5 s that has nothing to do with the cache; the request's flush skips it.
        t = time.perf_counter()
        self._begin()
        timings["begin"] = time.perf_counter() - t
        n_tensors = n_bytes = n_buckets = 0
        sent: set[str] = set()
        for k in ("quantize", "pack", "wire", "wait"):
            timings[k] = 0.0
        inflight: list[_InFlight] = []  # sent, not yet loaded by every server (at most two)
        try:
            t = time.perf_counter()
            with contextlib.closing(buckets):
                while True:
                    tw = time.perf_counter()
                    item = next(buckets, None)
                    # Preparation not hidden by a transfer: all of bucket 0's wait, and for later
                    # ones the part after the servers had loaded everything sent before.
                    ready = time.perf_counter()
                    idle = inflight[-1].answered_at if inflight else tw
                    timings["wait"] += max(0.0, ready - idle) if idle else 0.0
                    if item is None:
                        break
                    tw = time.perf_counter()
                    # Pipelined one deep: this request waits in the servers while they load the
                    # previous bucket, instead of after a round trip through the trainer.
                    inflight.append(self._post_bucket(*item))
                    if len(inflight) == 2:
                        n_bytes += self._finish_bucket(inflight.pop(0))
                    self._await_joined(inflight[-1])
                    # Its broadcast is complete, so its buffer is free: the packer fills it while
                    # the servers load the bucket (the trainer's core is otherwise idle then).
                    release(inflight[-1].idx)
                    timings["wire"] += time.perf_counter() - tw
                    bucket = item[0]
                    timings["quantize"] += bucket.seconds["fp8"]
                    timings["pack"] += bucket.seconds["copy"]
                    n_tensors += len(bucket.names)
                    n_buckets += 1
                    sent.update(bucket.names)
            if not checked and self.require_complete:
                missing = set(self.manifest.tensors) - sent
                if missing:
                    raise ManifestMismatchError(
                        f"stream ended without {len(missing)} served weights, e.g. {sorted(missing)[:5]}"
                    )
            tw = time.perf_counter()
            end = None
            if inflight:
                # Pipelined like a bucket (the last one was joined above): /end_weight_update waits
                # in the servers behind it (the tokenizer manager serialises both on is_pause_cond).
                # If that bucket fails, the session is closed on partial weights: still paused, and
                # a retry opens a new one.
                end = self._submit_all("end_weight_update")
            while inflight:
                n_bytes += self._finish_bucket(inflight[0])
                inflight.pop(0)
            timings["wire"] += time.perf_counter() - tw
            timings["buckets"] = time.perf_counter() - t
            t = time.perf_counter()
            if end is None:
                self._all("flush_cache")  # nothing sent (an empty partial update): still drop stale KV
                end = self._submit_all("end_weight_update")
            try:
                ends = end.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError as e:
                raise WeightSyncTimeoutError(f"end_weight_update not answered after {self.timeout_s}s") from e
            for url, r in zip(self.urls, ends, strict=True):
                if not (isinstance(r, dict) and r.get("success")):
                    raise WeightSyncError(f"{url} end_weight_update failed: {r}")
            self._all("update_weight_version", version)
            timings["end_version"] = time.perf_counter() - t
        except BaseException as e:
            if isinstance(e, Exception):
                self._drain(inflight, e)
            timed_out = isinstance(e, TimeoutError)
            raise (WeightSyncTimeoutError if timed_out else WeightSyncError)(
                f"weight update to {version!r} failed after {n_buckets} buckets: {e}\n"
                f"servers {self.urls} are left PAUSED (generation would run on partially updated weights); "
                + (
                    "a server did not answer in time: close() this synchronizer and connect() a new "
                    "one (a server that is merely slow may still act on what was sent), then sync again"
                    if timed_out
                    else "call sync() again with the full weights to recover"
                )
            ) from e
        self.version = version
        self._dirty = False
        t = time.perf_counter()
        self._all("continue_generation")
        timings["continue"] = time.perf_counter() - t
        report = SyncReport(
            version, n_tensors, n_bytes, n_buckets, time.perf_counter() - t0, self.fp8_label, timings
        )
        log.info(
            "weight sync %s: %d tensors, %.1f MB, %d buckets, %.3fs (fp8=%s)",
            version,
            n_tensors,
            n_bytes / 1e6,
            n_buckets,
            report.seconds,
            report.fp8,
        )
        return report

    def _drain(self, inflight: list[_InFlight], error: Exception) -> None:
        """After ``error``, let the buckets still on their way land, so that a retry's requests
        cannot overtake them; all of them share one :attr:`timeout_s`.

        Skipped after a timeout: a server that did not answer in time is not expected to answer the
        rest, and the recovery is a new group anyway (:class:`WeightSyncTimeoutError`)."""
        if isinstance(error, TimeoutError):
            return
        deadline = time.monotonic() + self.timeout_s
        for f in inflight:
            with contextlib.suppress(Exception):
                self._finish_bucket(f, max(0.0, deadline - time.monotonic()))

    def _begin(self) -> None:
        async def begin(c: SGLangClient) -> Any:
            try:
                return await c.begin_weight_update()
            except SGLangHTTPError as e:
                # A failed earlier update left its session open: ours continues it (retry path).
                if e.status == 400 and "already open" in e.body:
                    log.warning(
                        "%s: weight-update session still open from a failed update; reusing it", c.url
                    )
                    return {"success": True}
                raise

        async def go() -> list[Any]:
            return list(await asyncio.gather(*(begin(c) for c in self._clients)))

        for url, r in zip(self.urls, self._run(go()), strict=True):
            if not (isinstance(r, dict) and r.get("success")):
                raise WeightSyncError(f"{url} begin_weight_update failed: {r}")

    # -- verify ---------------------------------------------------------------------------
    def verify(
        self,
        prompts: Sequence[Sequence[int]],
        reference: ReferenceLogprobs,
        *,
        max_new_tokens: int = 8,
        temperature: float = 1.0,
    ) -> VerifyReport:
        """Generate on the first server and compare its per-token log-probs with ``reference``.

        ``reference(prompt_ids, output_ids, T)`` must return the trainer's log-probs of each output
        token at temperature ``T`` (the temperature the server's log-probs are at). Reports
        max / mean |delta logp| over all tokens; a broken name mapping shows up as deltas of order 1.
        """
        params = SamplingParams(
            temperature=temperature, max_new_tokens=max_new_tokens, ignore_eos=True, seed=1234
        )
        client = self._clients[0]
        groups = self._run(client.generate([list(p) for p in prompts], params, n=1))
        samples = [g[0] for g in groups]
        ref = reference(
            [s.prompt_ids for s in samples], [s.output_ids for s in samples], samples[0].logprob_temperature
        )
        deltas: list[float] = []
        per_prompt = []
        for s, r in zip(samples, ref, strict=True):
            if len(r) != len(s.rollout_logprobs):
                raise ValueError(
                    f"reference returned {len(r)} log-probs for {len(s.rollout_logprobs)} tokens"
                )
            d = [abs(a - b) for a, b in zip(s.rollout_logprobs, r, strict=True)]
            deltas += d
            per_prompt.append(max(d, default=0.0))
        rep = VerifyReport(
            samples[0].weight_version,
            max(deltas, default=0.0),
            sum(deltas) / max(len(deltas), 1),
            len(deltas),
            per_prompt,
        )
        log.info(
            "verify %s: max|dlogp|=%.4g mean=%.4g over %d tokens",
            rep.version,
            rep.max_abs_delta,
            rep.mean_abs_delta,
            rep.num_tokens,
        )
        return rep


__all__ = [
    "DistributedWeightSynchronizer",
    "Manifest",
    "ManifestMismatchError",
    "ReferenceLogprobs",
    "SyncReport",
    "TensorSpec",
    "VerifyReport",
    "WeightSyncError",
    "WeightSyncTimeoutError",
    "WeightSynchronizer",
    "broadcast_async",
    "create_update_group",
    "host_update_store",
]
