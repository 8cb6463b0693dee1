"""Adapter-only weight sync (``model.lora.sync: adapter``): the trainer's LoRA adapters reach
SGLang's LoRA engine under a versioned name; the base weights on the servers stay as they are.

SGLang 0.5.23 has no adapter versions: **the name is the version**. Version k of the policy is loaded
as ``policy@v{k}`` (:func:`adapter_name`) on every server, the PEFT-named full tensors (SGLang
slices them per rank itself) packed in one buffer: written as a PEFT directory on tmpfs and loaded
with ``/load_lora_adapter`` when the servers are on this host, else ``/load_lora_adapter_from_tensors``
with one ``flattened_bucket`` payload per server TP rank (:mod:`megatron_acrl.servers.lora_payload`),
and every request sent afterwards names it (``lora_path``, through
:class:`megatron_acrl.servers.dispatch.Dispatch`). A request holds the adapter it was submitted with
until it ends (also across a pause), so a sample's version is its adapter's, all of its tokens alike
(:func:`stamp`).

Nothing SGLang does checks an adapter up front: a name that matches no served module loads "with
success" and the first request using it kills the scheduler; fewer payloads than TP ranks kill it
too. :class:`LoraManifest` (read from the served checkpoint's own manifest) refuses such an adapter
before any POST (:class:`AdapterMismatchError`, a
:class:`~sglang_bridge.weight_sync.ManifestMismatchError`: nothing is retried).

Old versions are retired off the sync's critical path (:class:`AdapterSync`, a background thread):
``/unload_lora_adapter`` waits inside SGLang's adapter lock for every request that acquired the
adapter, and every later load waits behind it. So a version is unloaded only when no request this
client sent names it any more (its own count, :meth:`AdapterSync.acquire` / :meth:`~AdapterSync.release`)
and the servers are not paused, with a timeout: an unload that does not come back is a hung server,
and the next push raises :class:`TimeoutError` so that the recovery replaces it
(:mod:`megatron_acrl.servers.recovery`); the fresh server gets the current adapter at the retry.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson
import requests
import torch
from torch import Tensor

from megatron_acrl.batch.staleness import PREFIX, format_version
from megatron_acrl.config import Config, ConfigError
from megatron_acrl.config.model import LoraConfig, local_servers
from megatron_acrl.servers.lora_payload import (
    Transport,
    all_finite,
    flat_payload,
    pack,
    write_peft_dir,
)
from megatron_acrl.servers.transfer import fp8_scheme, weights_for_servers
from sglang_bridge.client import Sample, ServerGoneError
from sglang_bridge.fp8 import quantize_named_tensors
from sglang_bridge.server_spec import LoraServing
from sglang_bridge.transport import auth_headers
from sglang_bridge.weight_sync import Manifest, ManifestMismatchError, WeightSyncError

log = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module's HF path in a saved adapter."""

ADAPTER_PREFIX = "policy@"
_ADAPTER = re.compile(r"policy@v(\d+)")
_PEFT_NAME = re.compile(
    r"base_model\.model\.(model\.layers\.\d+\.(?:self_attn|mlp)\.\w+)\.lora_([AB])\.weight"
)


def served_modules(lora: LoraConfig) -> tuple[str, ...]:
    """The HF module names ``lora.target_modules`` puts adapters on, in a fixed order."""
    return lora.hf_modules


def lora_serving(lora: LoraConfig, max_loras_per_batch: int) -> LoraServing:
    """How a server serves this run's adapters (``ServerSpec.lora``): rank ``lora.rank`` at most."""
    return LoraServing(
        max_rank=lora.rank, target_modules=served_modules(lora), max_loras_per_batch=max_loras_per_batch
    )


def adapter_mode(cfg: Config) -> bool:
    """Whether the servers get adapters only (``model.lora`` set, ``sync: adapter``)."""
    return cfg.model.lora is not None and cfg.model.lora.sync == "adapter"


def check_adapter_sync(cfg: Config) -> None:
    """Refuse, before any server starts, what adapter sync cannot do: evaluate the trainer's
    unquantized weights (the servers' base is quantized once, at start-up; only adapters move)."""
    if adapter_mode(cfg) and fp8_scheme(cfg) is not None and cfg.training.eval_trainer_weights:
        raise ConfigError(
            [
                (
                    "training.eval_trainer_weights",
                    "evaluates the trainer's unquantized weights, but with model.lora.sync=adapter the "
                    "servers' base is quantized once at start-up and only adapters move; turn it off "
                    "or use model.lora.sync=merged",
                )
            ]
        )


def lora_serving_for(cfg: Config) -> LoraServing | None:
    """A server's LoRA engine under adapter sync (None otherwise): room in one batch for the base,
    every adapter version still in flight (async staleness) and the new one."""
    lora = cfg.model.lora
    if lora is None or not adapter_mode(cfg):
        return None
    r = cfg.rollout
    return lora_serving(lora, max(4, (r.max_staleness if r.mode == "async" else 0) + 3))


def adapter_sync_for(cfg: Config, urls: list[str], served_dir: str, base: str, api_key: str) -> AdapterSync:
    """Rank 0's :class:`AdapterSync` for ``cfg``'s servers at ``urls``, serving ``served_dir``
    (whose manifest names the adapter modules); ``base`` goes into the adapter config."""
    lora = cfg.model.lora
    assert lora is not None, "adapter sync needs model.lora"
    served = Manifest.from_checkpoint(served_dir)
    manifest = LoraManifest.from_manifest(served, served_modules(lora), lora.rank)
    return AdapterSync(
        urls,
        manifest,
        adapter_config(lora, base),
        server_tp=cfg.rollout.server_tp,
        api_key=api_key,
        timeout_s=cfg.rollout.sync_timeout_s,
        transport=lora.transport,
    )


def fake_quant_base(cfg: Config, model_dir: str, root: Path) -> Path:
    """The base a CPU (fake-quant) server serves under adapter sync: ``model_dir``'s weights rounded
    through the rollout's FP8 scheme exactly as a full sync would send them (stress emulations
    included), written once under ``root`` and reused, so the base is quantized once, at start-up,
    and a restarted server serves it too. (A real FP8 server serves the FP8 copy instead.)"""
    from safetensors.torch import load_file, save_file

    scheme = fp8_scheme(cfg)
    assert scheme is not None, "fake_quant_base needs rollout.quantization"
    src, dst = Path(model_dir), root / f"{Path(model_dir).name}-fake-{cfg.rollout.quantization}"
    if (dst / "config.json").exists():
        return dst
    tmp = dst.with_name(f"{dst.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in sorted(src.glob("*.safetensors")):
        stream = weights_for_servers(cfg, load_file(str(f)).items(), quantize=True)
        if not cfg.rollout.stress_quantization:  # the stress grids already rounded them
            stream = quantize_named_tensors(stream, scheme, mode="fake")
        save_file({k: v.contiguous() for k, v in stream}, str(tmp / f.name), metadata={"format": "pt"})
    for other in src.iterdir():
        if other.is_file() and other.suffix != ".safetensors":
            shutil.copy2(other, tmp / other.name)
    tmp.rename(dst)
    return dst


def adapter_name(label: str) -> str:
    """The adapter's name on the servers for weight version ``label``: ``step-<k>`` -> ``policy@v<k>``
    (any other label ``policy@<label>``)."""
    return (
        f"{ADAPTER_PREFIX}v{label[len(PREFIX) :]}"
        if re.fullmatch(r"step-\d+", label)
        else ADAPTER_PREFIX + label
    )


def adapter_label(name: str) -> str:
    """The weight version a sample of adapter ``name`` carries: ``policy@v<k>`` -> ``step-<k>``."""
    m = _ADAPTER.fullmatch(name)
    if m is not None:
        return format_version(int(m.group(1)))
    return name[len(ADAPTER_PREFIX) :] if name.startswith(ADAPTER_PREFIX) else name


def stamp(samples: list[Sample], name: str) -> list[Sample]:
    """Record on each sample the adapter it was sampled with (``meta["adapter"]``) and make its
    version that adapter's, for every token: the server's own weight version is the base's."""
    label = adapter_label(name)
    for s in samples:
        s.meta["adapter"] = name
        s.weight_version = label
        s.weight_versions = [{"version": label, "start": 0, "end": len(s.output_ids)}]
    return samples


def adapter_config(lora: LoraConfig, base_model: str = "") -> dict[str, Any]:
    """``adapter_config.json`` of the pushed adapters: the export's (:meth:`LoraConfig.peft_config`)."""
    return lora.peft_config(base_model)


class AdapterMismatchError(ManifestMismatchError):
    """An adapter that does not fit the served model (nothing was sent)."""


@dataclass(frozen=True)
class LoraManifest:
    """Every adapter module the servers hold: HF module path (``model.layers.L.self_attn.q_proj``) ->
    its base weight's ``(out, in)``; and the largest rank the servers take."""

    modules: dict[str, tuple[int, int]]
    max_rank: int

    @classmethod
    def from_manifest(cls, manifest: Manifest, targets: tuple[str, ...], max_rank: int) -> LoraManifest:
        """The modules of ``targets`` (HF names) in the served ``manifest``: every layer's. Raises
        ValueError for a target no layer has (LoRA on MoE experts: serve it ``sync: merged``)."""
        pattern = re.compile(rf"(model\.layers\.\d+\.(?:self_attn|mlp)\.({'|'.join(targets)}))\.weight")
        modules: dict[str, tuple[int, int]] = {}
        for name, spec in manifest.tensors.items():
            m = pattern.fullmatch(name)
            if m is not None and len(spec.shape) == 2:
                modules[m.group(1)] = (int(spec.shape[0]), int(spec.shape[1]))
        missing = [t for t in targets if not any(k.endswith("." + t) for k in modules)]
        if missing:
            raise ValueError(
                f"model.lora.target_modules: the served model has no dense {missing} layers (an MoE "
                "model's MLP is its experts, which SGLang's CPU LoRA cannot serve); use "
                "model.lora.sync=merged or target the attention layers only"
            )
        return cls(modules, max_rank)

    def check(self, adapter: Mapping[str, Tensor], finite: bool = True) -> int:
        """Raise :class:`AdapterMismatchError` listing what does not fit, else return the rank.

        Every name must be ``base_model.model.<served module>.lora_{A,B}.weight``, every served
        module present with both factors, A ``[r, in]`` and B ``[out, r]`` with one r <= the servers'
        max rank, floating and (``finite``) finite. A push checks finiteness once on the packed
        buffer instead (:func:`all_finite`: one pass, not one per tensor)."""
        errors: list[str] = []
        ranks: set[int] = set()
        seen: set[str] = set()
        for name, t in adapter.items():
            m = _PEFT_NAME.fullmatch(name)
            if m is None or m.group(1) not in self.modules:
                errors.append(f"{name}: {self._unknown(name)}")
                continue
            out, inp = self.modules[m.group(1)]
            seen.add(name)
            a = m.group(2) == "A"
            r = int(t.shape[0] if a else t.shape[-1]) if t.dim() == 2 else -1
            want = (r, inp) if a else (out, r)
            if t.dim() != 2 or tuple(t.shape) != want or r < 1:
                errors.append(
                    f"{name}: shape {tuple(t.shape)}, want {'[r, in]' if a else '[out, r]'} = "
                    f"{'[r, ' + str(inp) + ']' if a else '[' + str(out) + ', r]'}"
                )
                continue
            ranks.add(r)
            if not t.is_floating_point():
                errors.append(f"{name}: dtype {t.dtype}, want a floating dtype")
            elif finite and not bool(torch.isfinite(t).all()):
                errors.append(f"{name}: holds inf or nan")
        missing = [
            f"{PEFT_PREFIX}{mod}.lora_{f}.weight"
            for mod in self.modules
            for f in "AB"
            if f"{PEFT_PREFIX}{mod}.lora_{f}.weight" not in seen
        ]
        if missing:
            errors.append(
                f"{len(missing)} factor(s) missing, e.g. {missing[:3]} (every layer's module needs both)"
            )
        if len(ranks) > 1:
            errors.append(f"mixed ranks {sorted(ranks)}: SGLang takes one rank per adapter")
        elif ranks and (r := next(iter(ranks))) > self.max_rank:
            errors.append(f"rank {r} > the servers' --max-lora-rank {self.max_rank} (model.lora.rank)")
        if errors:
            more = f" (+{len(errors) - 8} more)" if len(errors) > 8 else ""
            raise AdapterMismatchError(
                "adapter refused before any POST (it would load and kill the server at its first "
                f"request): {'; '.join(errors[:8])}{more}"
            )
        return next(iter(ranks))

    def _unknown(self, name: str) -> str:
        if not name.startswith(PEFT_PREFIX):
            return f"not a PEFT name (want {PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)"
        close = difflib.get_close_matches(
            name, [f"{PEFT_PREFIX}{m}.lora_{f}.weight" for m in self.modules for f in "AB"], n=1
        )
        return "no such served module" + (f"; did you mean {close[0]}?" if close else "")


class AdapterLoadError(WeightSyncError):
    """A server refused an adapter (its reply's error message is in the text)."""


class AdapterSync:
    """Rank 0's adapter versions on its servers (module doc).

    Args:
        urls: the servers.
        manifest: what they serve (:class:`LoraManifest`).
        config: the adapter's ``adapter_config.json`` (:func:`adapter_config`).
        server_tp: payloads per load (one per server TP rank).
        api_key: the servers' key.
        timeout_s: a load's and an unload's bound.
        dtype: what the tensors travel in (the servers' dtype).
        background: retire old versions on a thread of its own (else only :meth:`retire_now` does).
        transport: ``disk``: each version is written once as a PEFT directory on this host's tmpfs
            (``/dev/shm``) and loaded with ``/load_lora_adapter`` (servers on this host only);
            ``tensors``: ``/load_lora_adapter_from_tensors`` with a :func:`flat_payload` (any host);
            ``auto``: ``disk`` when every URL is loopback, else ``tensors``. Measured on the 129 MB
            benchmark model (rank 16, 112 tensors, 3.5 MB): the tensors POST 50-60 ms (of which
            ~35 ms the HTTP server parsing a 4.7 MB JSON body), the disk load 18-21 ms + 5 ms to
            write the file.
    """

    def __init__(
        self,
        urls: list[str],
        manifest: LoraManifest,
        config: dict[str, Any],
        *,
        server_tp: int = 1,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        dtype: torch.dtype = torch.bfloat16,
        background: bool = True,
        transport: Transport = "auto",
    ):
        if transport not in ("auto", "disk", "tensors"):
            raise ValueError(f"AdapterSync(transport={transport!r}): give 'auto', 'disk' or 'tensors'")
        if transport == "disk" and not local_servers(urls):
            raise ValueError(
                f"AdapterSync(transport='disk') with servers {urls}: a server reads the adapter from "
                "this host's disk, so every URL must be loopback; use transport='tensors'"
            )
        self.transport: Literal["disk", "tensors"] = (
            ("disk" if local_servers(urls) else "tensors") if transport == "auto" else transport
        )
        self._stage: Path | None = None
        self.manifest, self.config = manifest, config
        self.server_tp, self.timeout_s, self.dtype = server_tp, timeout_s, dtype
        self._headers = {**auth_headers(api_key), "Content-Type": "application/json"}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self.loaded: dict[str, set[str]] = {u: set() for u in urls}
        """Server URL -> the adapter names it holds."""
        self.current: str | None = None
        """The adapter new requests name (None before the first push)."""
        self.outstanding: dict[str, int] = {}
        """Adapter name -> requests sent naming it that have not ended."""
        self.paused = False
        """While the servers are paused nothing is unloaded (an unload would wait on retracted requests)."""
        self.stuck: tuple[str, str] | None = None
        """(server URL, why): an unload that did not end within ``timeout_s``; the next push raises
        TimeoutError until that server is replaced."""
        self.retired = 0
        self._reload_all = False
        self._closed = False
        self._retirer: threading.Thread | None = None
        if background:
            self._retirer = threading.Thread(target=self._retire_loop, name="adapter-retirer", daemon=True)
            self._retirer.start()

    # -- the dispatch's side ----------------------------------------------------------------------

    def acquire(self) -> str | None:
        """The adapter a request sent now names (counted until :meth:`release`); None before any push."""
        with self._lock:
            name = self.current
            if name is not None:
                self.outstanding[name] = self.outstanding.get(name, 0) + 1
            return name

    def release(self, name: str | None) -> None:
        """A request naming ``name`` ended (answered, failed or cancelled)."""
        if name is None:
            return
        with self._lock:
            self.outstanding[name] = max(0, self.outstanding.get(name, 0) - 1)
            if not self.outstanding[name] and name != self.current:
                self._wake.notify()

    # -- a push -------------------------------------------------------------------------------------

    def servers_changed(self, urls: list[str], restarted: bool) -> None:
        """The servers are now ``urls``; ``restarted``: some were replaced since the last push (a
        fresh server holds no adapter, possibly at an old URL), so the next push loads the current
        version on every server (one that holds it already answers so, which counts as loaded), and
        an unload that hung is forgotten with the server the recovery replaced."""
        with self._lock:
            self.loaded = {u: self.loaded.get(u, set()) for u in urls}
            if restarted:
                self._reload_all = True
                self.stuck = None

    def push(self, adapter: Mapping[str, Tensor], label: str) -> dict[str, float]:
        """Validate ``adapter`` (PEFT names -> full tensors), load it as :func:`adapter_name`
        (``label``) on every server that lacks it, then point new requests at it; returns sync
        metrics. Raises :class:`AdapterMismatchError` before any POST, :class:`TimeoutError` for a
        server that does not answer (or an earlier unload that never ended), ServerGoneError for one
        that is gone, :class:`AdapterLoadError` for a refusal."""
        if self.stuck is not None:
            raise TimeoutError(f"an adapter unload on {self.stuck[0]} never ended ({self.stuck[1]})")
        t0 = time.perf_counter()
        rank = self.manifest.check(adapter, finite=False)
        packed = pack(adapter, self.dtype)
        if not all_finite(packed.flat):
            self.manifest.check(adapter)  # names each tensor that holds inf or nan
            raise AdapterMismatchError(
                "adapter refused before any POST: it holds inf or nan in the servers' dtype"
            )
        name = adapter_name(label)
        t1 = time.perf_counter()
        config = {**self.config, "r": rank}
        path: Path | None = None
        if self.transport == "disk":
            path = self._stage_dir() / name
            write_peft_dir(packed, config, path)
            body: dict[str, Any] = {"lora_name": name, "lora_path": str(path), "pinned": False}
            wire = float(sum(f.stat().st_size for f in path.iterdir()))
        else:
            payload = flat_payload(packed)
            body = {
                "lora_name": name,
                "config_dict": config,
                "serialized_named_tensors": [payload] * self.server_tp,  # one per TP rank: fewer kill it
                "load_format": "flattened_bucket",
                "pinned": False,
            }
            wire = float(len(payload) * self.server_tp)
        t2 = time.perf_counter()
        with self._lock:
            todo = [u for u, names in self.loaded.items() if self._reload_all or name not in names]
        try:
            if todo:
                with ThreadPoolExecutor(len(todo)) as pool:
                    list(pool.map(lambda u: self._load(u, body), todo))
        finally:
            if path is not None:  # every server has read it (a load returns once the weights are in memory)
                shutil.rmtree(path, ignore_errors=True)
        with self._lock:
            for u in todo:
                self.loaded[u].add(name)
            self._reload_all = False
            self.current = name
            self._wake.notify()  # the previous versions may retire now
        t3 = time.perf_counter()
        return {
            "sync/seconds": t3 - t0,
            "sync/validate_s": t1 - t0,
            "sync/serialize_s": t2 - t1,
            "sync/post_s": t3 - t2,
            "sync/bytes": float(packed.flat.numel() * packed.flat.element_size()),
            "sync/wire_bytes": wire * len(todo),
            "sync/tensors": float(len(adapter)),
            "sync/adapter_rank": float(rank),
            "sync/adapter_disk": float(self.transport == "disk"),
            "sync/adapters_live": float(len(self.live())),
            "sync/adapters_retired": float(self.retired),
        }

    def _stage_dir(self) -> Path:
        """This sync's directory for PEFT files: on tmpfs (``/dev/shm``) where there is one, so a
        version never touches a disk; removed by :meth:`close`."""
        if self._stage is None:
            shm = Path("/dev/shm")
            root = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
            self._stage = Path(tempfile.mkdtemp(prefix="acrl-lora-", dir=root))
        return self._stage

    def _load(self, url: str, body: dict[str, Any]) -> None:
        path = "/load_lora_adapter" if "lora_path" in body else "/load_lora_adapter_from_tensors"
        reply = self._post(url, path, body)
        if reply.get("success"):
            return
        msg = str(reply.get("error_message", reply))
        if (
            f"{body['lora_name']} already exists" in msg
            or f"{body['lora_name']} because it is already" in msg
        ):
            return  # an earlier try loaded it (its answer was lost): the name is the version
        raise AdapterLoadError(f"{url} refused adapter {body['lora_name']}: {msg}")

    def _post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            # orjson: the payload is a multi-MB string, which the stdlib encoder scans far slower
            data = orjson.dumps(body)
            r = requests.post(url + path, data=data, headers=self._headers, timeout=self.timeout_s)
        except requests.Timeout as e:
            raise TimeoutError(f"SGLang server {url}{path} did not answer within {self.timeout_s:g} s") from e
        except requests.ConnectionError as e:
            raise ServerGoneError(f"SGLang server {url} unreachable for {path}: {e}") from e
        try:
            reply = r.json()
        except ValueError:
            reply = {"success": False, "error_message": r.text[:500]}
        if not isinstance(reply, dict):
            reply = {"success": False, "error_message": str(reply)[:500]}
        if r.status_code >= 400 and reply.get("success") is None:
            reply["success"] = False
        return reply

    # -- retirement -----------------------------------------------------------------------------------

    def live(self) -> set[str]:
        """Every adapter name some server holds."""
        with self._lock:
            return set().union(*self.loaded.values()) if self.loaded else set()

    def retirable(self) -> dict[str, list[str]]:
        """Adapter name -> the servers to unload it from: not the current one, no request of ours
        names it, the servers are not paused."""
        with self._lock:
            if self.paused:
                return {}
            out: dict[str, list[str]] = {}
            for url, names in self.loaded.items():
                for n in names:
                    if n != self.current and not self.outstanding.get(n, 0):
                        out.setdefault(n, []).append(url)
            return out

    def retire_now(self) -> int:
        """Unload every retirable version (:meth:`retirable`) now; returns how many. An unload that
        does not end within ``timeout_s`` marks :attr:`stuck`; one refused is tried again later."""
        done = 0
        for name, urls in self.retirable().items():
            for url in urls:
                try:
                    reply = self._post(url, "/unload_lora_adapter", {"lora_name": name})
                except TimeoutError as e:
                    with self._lock:
                        self.stuck = (url, str(e))
                    log.warning(
                        "unloading adapter %s from %s timed out: the server is hung (%s)", name, url, e
                    )
                    return done
                except ServerGoneError:
                    continue  # a restart forgets it (servers_changed)
                if reply.get("success") or f"{name} does not exist" in str(reply.get("error_message", "")):
                    with self._lock:
                        self.loaded.get(url, set()).discard(name)
                        if not any(name in ns for ns in self.loaded.values()):
                            self.outstanding.pop(name, None)
                            self.retired += 1
                            done += 1
                else:
                    log.warning(
                        "unloading adapter %s from %s refused: %s", name, url, reply.get("error_message")
                    )
        return done

    def _retire_loop(self) -> None:
        while True:
            with self._lock:
                self._wake.wait(timeout=5.0)
                if self._closed:
                    return
                if self.stuck is not None:
                    continue
            try:
                self.retire_now()
            except Exception as e:  # noqa: BLE001 - retirement is best effort; the next wake tries again
                log.warning("retiring adapters failed: %s: %s", type(e).__name__, e)

    def close(self) -> None:
        """Stop the retirement thread (the servers keep what they hold)."""
        with self._lock:
            self._closed = True
            self._wake.notify()
        if self._retirer is not None:
            self._retirer.join(timeout=self.timeout_s + 5)
        if self._stage is not None:
            shutil.rmtree(self._stage, ignore_errors=True)
