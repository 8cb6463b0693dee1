"""How to launch one SGLang server: :class:`ServerSpec`, its command line and its environment.

A keyed spec's command line never holds the key: it names a ``--config`` file that does
(:class:`sglang_bridge.server_key.KeyFile`), and its environment drops any variable holding it. A
server that binds beyond loopback without a key is refused here, before anything starts.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sglang_bridge.cpu_compat import server_env
from sglang_bridge.listeners import is_loopback


@dataclass(frozen=True)
class LoraServing:
    """SGLang's LoRA engine on a server (``--enable-lora``): adapters are loaded at run time
    (``/load_lora_adapter_from_tensors``) and requests name one (``lora_path``)."""

    max_rank: int
    """``--max-lora-rank``: the largest adapter rank the server's pool takes (required without
    ``--lora-paths``)."""

    target_modules: tuple[str, ...]
    """``--lora-target-modules``: the HF module names adapters may sit on (q_proj, k_proj, ...)."""

    max_loras_per_batch: int = 4
    """``--max-loras-per-batch``: adapters one batch may mix (the base counts as one): keep it above
    the versions live at once."""

    backend: str = "torch_native"
    """``--lora-backend``; on CPU only torch_native works (the Triton ones kill the server at the
    first LoRA request)."""

    def __post_init__(self) -> None:
        if self.max_rank < 1 or not self.target_modules or self.max_loras_per_batch < 2:
            raise ValueError(
                f"LoraServing(max_rank={self.max_rank}, target_modules={self.target_modules}, "
                f"max_loras_per_batch={self.max_loras_per_batch}): give a rank >= 1, at least one "
                "target module and room for the base and one adapter (max_loras_per_batch >= 2)"
            )

    def args(self) -> list[str]:
        """The ``launch_server`` flags."""
        return [
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_rank),
            "--lora-target-modules",
            *self.target_modules,
            "--lora-backend",
            self.backend,
            "--max-loras-per-batch",
            str(self.max_loras_per_batch),
        ]


@dataclass(frozen=True)
class ServerSpec:
    """How to launch one SGLang server (``python -m sglang.launch_server``)."""

    model_path: str
    """HF model directory to serve (config.json + safetensors + tokenizer)."""

    device: Literal["cpu", "cuda"] = "cpu"
    """cpu: SGLang's CPU engine with the stand-ins of :mod:`sglang_bridge.cpu_compat`; cuda: real kernels."""

    host: str = "127.0.0.1"
    """Bind address; keep loopback unless the job spans nodes. Any other address needs ``api_key``."""

    port: int | None = None
    """HTTP port; None picks a free one at start."""

    tp: int = 1
    """Tensor-parallel size of this server."""

    gpu_ids: tuple[int, ...] | None = None
    """CUDA devices of this server (CUDA_VISIBLE_DEVICES); None leaves the environment's choice."""

    cpus: tuple[int, ...] | None = None
    """CPU cores this server's processes run on (the CPU counterpart of ``gpu_ids``): set as the
    child's affinity before SGLang starts, so every thread and sub-process it creates inherits it and
    its OpenMP pool is sized to these cores. None: the cores of the parent, shared with the trainer,
    whose work during a weight sync (FP8 packing) then competes with the server's for them
    (docs/bridge.md, "Where a CPU server runs")."""

    dtype: str = "bfloat16"
    """Activation/weight dtype of the served model."""

    quantization: str | None = None
    """SGLang ``--quantization`` ("fp8" online-quantizes a bf16 checkpoint); None: as the checkpoint."""

    max_total_tokens: int | None = None
    """KV-cache capacity in tokens; None: 4096 on CPU (SGLang would size it from RAM), SGLang's on GPU."""

    mem_fraction_static: float | None = None
    """GPU memory fraction for weights + KV cache; None: SGLang's default."""

    api_key: str | None = None
    """Require this bearer key on every endpoint but ``/health`` (SGLang's ``--api-key``, given through
    the 0600 ``--config`` file of :meth:`command`, never on the command line). None: no key, allowed
    on loopback only."""

    random_seed: int | None = 0
    """Sampling seed of the server (``--random-seed``)."""

    original_logprobs: bool = False
    """Return log-probs of the *unscaled* logits (SGLANG_RETURN_ORIGINAL_LOGPROB=1 on the server).
    False (SGLang's default): returned log-probs are log softmax(logits / temperature)."""

    return_routed_experts: bool = False
    """Serve the experts each token was routed to (``--enable-return-routed-experts``; MoE models, for
    routing replay). Without it SGLang silently ignores ``return_routed_experts`` in requests."""

    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    """KV-cache dtype. ``fp8_e4m3``: SGLang's FP8 KV cache (``--kv-cache-dtype fp8_e4m3``) on cuda; on
    cpu, where SGLang offers it only with Intel AMX kernels, emulated in the bf16 cache by the
    ``fp8_kv`` patch of :mod:`sglang_bridge.cpu_compat` (every K and V rounded through e4m3)."""

    sleep_on_idle: bool = True
    """Block the scheduler on its sockets while no request is queued (``--sleep-on-idle``). Without it
    an idle SGLang scheduler polls in a busy loop and keeps one CPU core at 100%: on a small CPU
    machine that core is taken from the trainer (and from a second server) for the whole run."""

    lora: LoraServing | None = None
    """Serve LoRA adapters (SGLang's LoRA engine); on cpu also the ``lora_cpu`` patch of
    :mod:`sglang_bridge.cpu_compat` (SGLang's LoRA layers pin host memory, which a CPU torch cannot)."""

    extra_args: tuple[str, ...] = ()
    """Further ``launch_server`` flags, passed verbatim."""

    extra_env: tuple[tuple[str, str], ...] = field(default=())
    """Further environment variables of the server process."""

    def __post_init__(self) -> None:
        if self.api_key and self.api_key.startswith("-"):
            raise ValueError(
                "ServerSpec.api_key begins with '-': SGLang reads it from its --config file as an "
                "argument and takes it for an option; choose a key that does not begin with '-'"
            )
        if not self.api_key and not is_loopback(self.host):
            raise ValueError(
                f"ServerSpec.host={self.host!r} without api_key: a server reachable beyond loopback "
                "takes weight updates from anyone who can reach it; give it an api_key or bind 127.0.0.1"
            )
        if self.cpus is not None and (
            not self.cpus
            or len(set(self.cpus)) != len(self.cpus)
            or not all(isinstance(c, int) and c >= 0 for c in self.cpus)
        ):
            raise ValueError(
                f"ServerSpec.cpus={self.cpus!r}: give distinct core numbers (e.g. (1,) or (2, 3)), "
                "or None to run on the parent's cores"
            )

    def check_cpus(self) -> None:
        """Raise ValueError naming the cores of :attr:`cpus` this host does not have."""
        if self.cpus is None:
            return
        have = host_cores()
        if missing := sorted(c for c in self.cpus if c not in have):
            raise ValueError(
                f"ServerSpec.cpus: cores {missing} do not exist on this host or in this job's cpuset "
                f"(cores {sorted(have)}); pick cores from those"
            )

    def command(self, port: int, key_file: str | Path | None = None) -> list[str]:
        """The launch command line for this spec on ``port``; a keyed spec needs ``key_file``, the
        0600 ``--config`` file that holds its key (written by :class:`~sglang_bridge.server_key.KeyFile`)."""
        if self.api_key and key_file is None:
            raise ValueError("a keyed server's key travels in its --config file: pass key_file")
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(port),
            "--device",
            self.device,
            "--dtype",
            self.dtype,
            "--tp-size",
            str(self.tp),
            "--skip-server-warmup",
            "--log-level",
            "info",
        ]
        if self.device == "cpu":
            # CUDA graphs and the xgrammar backend do not exist on a CPU build.
            cmd += [
                "--disable-cuda-graph",
                "--grammar-backend",
                "none",
                "--max-total-tokens",
                str(self.max_total_tokens or 4096),
            ]
        elif self.max_total_tokens:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.quantization:
            cmd += ["--quantization", self.quantization]
        if self.api_key:
            cmd += ["--config", str(key_file)]
        if self.random_seed is not None:
            cmd += ["--random-seed", str(self.random_seed)]
        if self.return_routed_experts:
            cmd += ["--enable-return-routed-experts"]
        if self.kv_cache_dtype != "auto" and self.device != "cpu":
            cmd += ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.sleep_on_idle:
            cmd += ["--sleep-on-idle"]
        if self.lora is not None:
            cmd += self.lora.args()
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        """The environment of the server process (without any variable that holds the key: the
        server reads it from its key file, and its environment would hand it to every sub-process)."""
        env = server_env(
            self.device,
            routed_experts=self.return_routed_experts,
            fp8_kv_cache=self.kv_cache_dtype == "fp8_e4m3",
            lora=self.lora is not None,
        )
        if self.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in self.gpu_ids)
        if self.original_logprobs:
            env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        env.update(dict(self.extra_env))
        if self.api_key:
            env = {k: v for k, v in env.items() if v != self.api_key}
        return env


def host_cores(cpuset: Path = Path("/sys/fs/cgroup/cpuset.cpus.effective")) -> set[int]:
    """The cores a server may be bound to: the job's cgroup cpuset where there is one, else every core
    of the host. Not the caller's own affinity: a trainer pinned to core 0 may start its server on
    core 1 (a server is bound between fork and exec, which the cpuset allows)."""
    try:
        text = cpuset.read_text().strip()
    except OSError:
        text = ""
    cores: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores or set(range(os.cpu_count() or 1))
