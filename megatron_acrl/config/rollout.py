"""The rollout engine (SGLang servers, routing, weight sync)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from megatron_acrl.config._base import _check, _Section
from megatron_acrl.config.agent import AgentConfig

Quantization = Literal["none", "fp8_block", "fp8_per_tensor", "fp8_per_channel"]


RouterPolicy = Literal["cache_aware", "power_of_two", "round_robin", "random", "consistent_hashing"]
"""sglang-router 0.3.2 policies usable for a regular (not prefill/decode-split) deployment; its
``manual`` policy needs a routing key per request and is not offered."""


@dataclass(frozen=True)
class RolloutConfig(_Section):
    backend: Literal["sglang", "replay"] = "sglang"
    """Where rollouts come from: live SGLang servers, or a directory recorded with --save-rollouts."""

    num_servers: int = 1
    """SGLang servers to start (each serves one full copy of the model)."""

    server_tp: int = 1
    """Tensor-parallel size of each SGLang server."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device the SGLang servers run on; auto picks cuda when available."""

    host: str = "127.0.0.1"
    """Address the servers bind; keep loopback unless the job spans nodes."""

    base_port: int | None = None
    """Port of the first server (server k listens on base_port + k); None picks free ports, so
    several runs on one machine never talk to each other's servers. A port another process holds
    (another run's server, say) is refused, naming that process: a run never adopts a server it
    did not start unless it is listed in ``server_urls``."""

    server_cpus: tuple[int, ...] = ()
    """CPU cores of the servers the driver starts itself, split evenly among them in order (server k
    runs on the k-th slice; the CPU counterpart of giving each server its own GPUs); empty: every
    core, shared with the trainer (right for a small machine, where the two take turns). Keep the
    trainer off these cores (``taskset``), or its work during a weight sync (FP8 packing) competes
    with the servers' (docs/bridge.md). A job script's server step gets its CPUs from SLURM instead."""

    server_urls: tuple[str, ...] = ()
    """URLs of SGLang servers already running (multi-node launch scripts start them on their own
    nodes); empty means the driver starts num_servers local servers itself. They must be keyed
    (``api_key_env``): a listed server is used only when it answers with that key and refuses
    requests without it."""

    api_key_env: str | None = None
    """Name of the environment variable holding the servers' API key (the job script makes one per
    job). None: the run makes a random key at start, gives it to the servers it starts and to its own
    client only, and never writes it down. Every run keys its servers, on loopback too; the key
    reaches SGLang through a 0600 file, never its command line, and is redacted from its logs."""

    n_samples_per_prompt: int = 4
    """Samples per prompt (the GRPO group size)."""

    prompts_per_step: int = 8
    """Prompts per rollout batch."""

    temperature: float = 1.0
    """Sampling temperature (applied identically in the trainer's log-probs)."""

    top_p: float = 1.0
    """Nucleus sampling; values < 1 bias rho because returned log-probs are renormalised."""

    top_k: int = -1
    """Top-k sampling; -1 disables."""

    max_new_tokens: int = 16
    """Longest response."""

    max_prompt_len: int = 64
    """Longest prompt in tokens; longer prompts are an error, never silently truncated."""

    quantization: Quantization = "fp8_block"
    """Weight quantization of the rollout copy: none (BF16 rollout) or an FP8 e4m3 scheme."""

    fp8_block_size: tuple[int, int] = (128, 128)
    """Block shape for fp8_block scales (rows, cols)."""

    fp8_scale_ue8m0: bool = False
    """Round FP8 scales to powers of two (DeepGEMM UE8M0), as SGLang's own quantizer does."""

    bucket_size_mb: float = 512
    """Weight-sync bucket size in MiB (the first bucket is at most 32 MiB; a larger tensor gets a
    bucket of its own). Each source holds two send buffers of this size."""

    fp8_mode: Literal["auto", "real", "fake"] = "auto"
    """How an FP8 quantization reaches the servers: real (e4m3 weights + scales, FP8 server), fake
    (quantize -> dequantize, FP8-rounded bf16 on a bf16 server; labelled fake-quant in metrics),
    auto (real on cuda servers, fake on cpu servers, which cannot serve FP8)."""

    fp8_rounding: Literal["nearest", "toward_zero"] = "nearest"
    """Stress emulation (fake-quant only): how scaled weights are cast to e4m3; toward_zero truncates
    the mantissa, a biased error in the spirit of the ACRL paper's "truncated FP8"."""

    fp8_mantissa_bits: int = 3
    """Stress emulation (fake-quant only): mantissa bits kept (e4m3 has 3); fewer truncates onto a
    coarser e4mM grid toward zero."""

    fp8_quantize_router: bool = False
    """Stress emulation (fake-quant only): quantize the MoE router weights too (FP8 recipes keep them
    in bf16), so near-tie expert choices flip between trainer and rollout."""

    fp8_quantize_lm_head: bool = False
    """Stress emulation (fake-quant only): quantize the output projection too (FP8 recipes keep it in
    bf16), so every logit carries the rounding. A model with tied embeddings has no separate lm_head:
    its embedding table is the output projection, and is quantized (as both) instead."""

    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    """KV cache of the rollout servers: auto (the model dtype) or fp8_e4m3 (SGLang's FP8 KV cache on
    cuda; on cpu emulated in the bf16 cache, every K and V rounded through e4m3, since SGLang's CPU
    FP8 cache needs Intel AMX kernels). Adds attention-side mismatch on top of the weights'."""

    pause_mode: Literal["retract", "abort", "in_place"] = "retract"
    """How generation pauses during a weight update: retract (requeue in-flight requests, KV recomputed
    with the new weights), abort (end them, finish_reason abort), in_place (keep their old KV cache)."""

    original_logprobs: bool = False
    """Servers return log-probs of the unscaled logits (SGLANG_RETURN_ORIGINAL_LOGPROB=1); default
    False: log softmax(logits / temperature), SGLang's default."""

    max_concurrency: int = 64
    """Concurrent /generate requests per server."""

    samples_per_request: int = 64
    """Samples batched into one /generate request. Batches are admitted into one prefill and decoded
    together; one request per sample (1) makes a CPU server prefill each arrival in its own forward
    pass between decode steps (about 3x slower for 256 samples of a tiny model)."""

    return_routed_experts: bool | None = None
    """Ask SGLang for the experts each token was routed to (server --enable-return-routed-experts;
    MoE models): null = only when model.moe_routing_replay=rollout replays them; true also gives the
    routing metrics (trainer-vs-rollout expert disagreement) with replay off or train."""

    request_timeout_s: float = 600.0
    """Timeout of a /generate request, counted from when it was sent or when its server last finished
    a request, whichever is later: time spent waiting in a busy server's queue does not count, so a
    rollout may last far longer as long as the server keeps finishing requests (a request that would
    take longer than this to serve on its own, or a hung server, still times out; docs/bridge.md,
    "Timeouts"). Control calls (pause, health) time out after it too."""

    startup_timeout_s: float = 300.0
    """How long to wait for a server to become healthy."""

    weight_sync_timeout_s: float | None = None
    """How long one step of a weight sync may take (every server joining a bucket's broadcast,
    answering an update call, joining the update group); null: request_timeout_s. A local server that
    misses it and then answers no health request (or is stopped) is hung: its process tree is killed,
    a fresh server started and the sync retried (docs/bridge.md, "A hung server in a run")."""

    # -- asynchronous RL and weight lag (docs/async.md) --

    mode: Literal["sync", "async"] = "sync"
    """sync: generate, train, push the weights, in turn. async: the servers keep generating while the
    trainer trains (rank 0's producer thread), within max_staleness weight versions (docs/async.md)."""

    max_staleness: int = 1
    """Async: K, the most weight versions a trained token may be older than the weights that train
    on it (>= 1; 1 is one-step off-policy: batch t+1 is generated while batch t trains)."""

    stale_policy: Literal["wait", "drop"] = "wait"
    """Async: wait (admit a prompt only if its group can still be trained within K: nothing is
    dropped) or drop (keep the servers busy, drop finished groups already older than K)."""

    partial_rollouts: bool = True
    """Async: requests in flight at a weight update go on with the new weights (pause_mode retract or
    in_place; their tokens carry both versions). false: an update first lets them finish (retract,
    in_place) or aborts them and generates them again (abort): every sample has one version."""

    producer_cpus: tuple[int, ...] = ()
    """Async: CPU cores of rank 0's producer thread (the HTTP client, JSON decoding, scoring and
    bookkeeping of the requests in flight), set on that thread alone; empty: the trainer process's
    cores. Give it cores the trainer does not compute on (on a GPU node, a spare host core; on a
    CPU machine, e.g. the servers' cores) so that its work never takes the trainer's core
    (docs/async.md, "Where the trainer's time goes"). Threads share the GIL, so this moves its CPU
    work, not its GIL holds."""

    weight_lag_steps: int = 0
    """Deterministic drift for experiments: the servers sample every batch with the policy of this
    many RL steps ago (version max(0, t - L) at step t), in sync or async mode. Rank 0 keeps L + 1
    host copies of the HF weights, and checkpoints hold them too (resume reproduces the lag)."""

    router: Literal["none", "sglang"] = "none"
    """How /generate requests reach the servers. none: the driver fans the groups out itself, each to
    the server with the fewest requests in flight (at most max_concurrency each), and re-sends a dead
    server's groups to the others; sglang: through an sglang-router process the driver starts beside
    the servers (same API key), with router_policy. Weight updates and pause/continue always go to
    each server directly."""

    router_policy: RouterPolicy = "cache_aware"
    """sglang-router's policy (router: sglang): cache_aware (prefix-tree affinity, load balancing when
    the servers drift apart), power_of_two (the less loaded of two random servers), round_robin,
    random, consistent_hashing (by the routing key an agent trajectory's turns carry: all its turns
    to one server; other requests at random)."""

    router_port: int | None = None
    """Port of the router on 127.0.0.1 (only the driver talks to it); None picks a free one."""

    router_timeout_s: float | None = None
    """sglang-router's own timeout of a request (its request_timeout_secs); null: request_timeout_s.
    Unlike the driver's clock it counts from when the router forwards the request, time in the
    worker's queue included (up to max_concurrency requests per worker wait there): give it at least
    how long a worker takes to serve max_concurrency requests. It is also what ends the requests of a
    worker that hangs while the others keep finishing theirs (docs/bridge.md, "Timeouts")."""

    weight_sync: Literal["per_source", "rank0"] = "per_source"
    """Who sends the weights to the servers. per_source: the (DP 0, TP 0) rank of every pipeline
    stage sends its stage, and with EP > 1 every expert leaves from the EP rank that holds it, each
    source through its own update group, the sources concurrently, rank 0 running the update's
    lifecycle once (no rank holds more than its stage's tensors plus two buckets). rank0: every
    stage is broadcast to global rank 0, which sends the whole model (the baseline)."""

    weight_sync_port: int | None = None
    """First port of the weight sync on the trainer nodes: rank 0's control store listens on it and
    source s's update-group store on weight_sync_port + 1 + s (the servers dial those); None picks
    free ports (one machine, or open networks). Job scripts set it from the job id."""

    weight_sync_address: str | None = None
    """Address the servers dial to reach a weight-sync source (its store and broadcasts); None:
    loopback when the driver starts its servers itself, else the source node's host name."""

    agent: AgentConfig = field(default_factory=AgentConfig)
    """Agentic (multi-turn, tool-calling) rollouts: the agent, its environment and limits."""

    @property
    def sync_timeout_s(self) -> float:
        """:attr:`weight_sync_timeout_s`, else :attr:`request_timeout_s`."""
        return self.request_timeout_s if self.weight_sync_timeout_s is None else self.weight_sync_timeout_s

    @property
    def router_request_timeout_s(self) -> float:
        """:attr:`router_timeout_s`, else :attr:`request_timeout_s`."""
        return self.request_timeout_s if self.router_timeout_s is None else self.router_timeout_s

    @property
    def stress_quantization(self) -> bool:
        """True when any stress emulation option departs from plain e4m3 (round to nearest, bf16 routers)."""
        return (
            self.fp8_rounding != "nearest"
            or self.fp8_mantissa_bits != 3
            or self.fp8_quantize_router
            or self.fp8_quantize_lm_head
        )

    def validate(self) -> list[tuple[str, str]]:
        e: list[tuple[str, str]] = []
        for name in (
            "num_servers",
            "server_tp",
            "n_samples_per_prompt",
            "prompts_per_step",
            "max_new_tokens",
            "max_prompt_len",
            "max_concurrency",
            "samples_per_request",
        ):
            _check(e, getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        self._validate_async(e)
        for name in ("request_timeout_s", "startup_timeout_s"):
            _check(
                e,
                getattr(self, name) > 0,
                name,
                f"must be > 0 seconds, got {getattr(self, name)} (a timeout of 0 fails every request)",
            )
        _check(
            e,
            self.weight_sync_timeout_s is None or self.weight_sync_timeout_s > 0,
            "weight_sync_timeout_s",
            f"must be > 0 seconds or null (request_timeout_s), got {self.weight_sync_timeout_s}",
        )
        _check(
            e,
            not (self.fp8_mode == "real" and self.device == "cpu" and self.quantization != "none"),
            "fp8_mode",
            "real FP8 needs a cuda server, but rollout.device is cpu (SGLang serves FP8 on CPU only with "
            "Intel AMX kernels); use fp8_mode auto or fake (FP8-rounded bf16), or rollout.device=cuda",
        )
        _check(e, self.bucket_size_mb > 0, "bucket_size_mb", f"must be > 0, got {self.bucket_size_mb}")
        _check(e, self.temperature > 0, "temperature", "must be > 0 (use a small value for near-greedy)")
        _check(e, 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(e, self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1")
        _check(e, all(b >= 1 for b in self.fp8_block_size), "fp8_block_size", "both entries must be >= 1")
        _check(
            e, 0 <= self.fp8_mantissa_bits <= 3, "fp8_mantissa_bits", "must be in [0, 3] (e4m3 has 3 bits)"
        )
        if self.stress_quantization:
            # These grids exist only as FP8-rounded bf16 (no FP8 kernel serves them).
            _check(
                e,
                self.quantization != "none",
                "quantization",
                "the fp8 stress options (fp8_rounding, fp8_mantissa_bits, fp8_quantize_router, "
                "fp8_quantize_lm_head) need an fp8_* quantization",
            )
            _check(
                e,
                self.fp8_mode != "real",
                "fp8_mode",
                "the fp8 stress options are fake-quant emulations; use fp8_mode auto (CPU) or fake",
            )
        _check(
            e,
            self.base_port is None or 1 <= self.base_port <= 65535 - self.num_servers,
            "base_port",
            "must be a valid TCP port or null (free ports)",
        )
        _check(
            e,
            self.weight_sync_port is None or 1024 <= self.weight_sync_port <= 65535,
            "weight_sync_port",
            f"must be a TCP port in [1024, 65535] or null (free ports), got {self.weight_sync_port}",
        )
        for i, url in enumerate(self.server_urls):
            _check(
                e,
                url.startswith(("http://", "https://")),
                f"server_urls[{i}]",
                f"must be an http(s) URL like http://node1:30000, got {url!r}",
            )
        self._check_key(e)
        self._check_server_cpus(e)
        return e + self._router_checks()

    def _check_server_cpus(self, e: list[tuple[str, str]]) -> None:
        """``server_cpus``: distinct cores, an even split among the servers, only servers we start."""
        if not self.server_cpus:
            return
        cpus = self.server_cpus
        _check(
            e,
            all(isinstance(c, int) and c >= 0 for c in cpus) and len(set(cpus)) == len(cpus),
            "server_cpus",
            f"must be distinct core numbers >= 0, got {list(cpus)}",
        )
        _check(
            e,
            len(cpus) % self.num_servers == 0 if self.num_servers >= 1 else True,
            "server_cpus",
            f"{len(cpus)} cores do not split evenly among num_servers={self.num_servers}; "
            f"give a multiple of {self.num_servers} cores or [] to share every core",
        )
        _check(
            e,
            not self.server_urls,
            "server_cpus",
            "binds only servers the driver starts itself; servers at server_urls are started "
            "(and bound) elsewhere: set it to []",
        )

    def _router_checks(self) -> list[tuple[str, str]]:
        e: list[tuple[str, str]] = []
        _check(
            e,
            self.router == "none" or self.backend != "replay",
            "router",
            "the replay backend reads recorded rollouts and starts no servers to route to; set "
            "rollout.router=none (or backend=sglang)",
        )
        _check(
            e,
            self.router_port is None or 1 <= self.router_port <= 65535,
            "router_port",
            "must be a valid TCP port or null (a free one)",
        )
        _check(
            e,
            self.router_timeout_s is None or self.router_timeout_s >= 1,
            "router_timeout_s",
            f"must be >= 1 second (sglang-router counts whole seconds) or null (request_timeout_s), "
            f"got {self.router_timeout_s}",
        )
        return e

    def _check_key(self, e: list[tuple[str, str]]) -> None:
        """``api_key_env``: a variable name, and set whenever the servers were started elsewhere."""
        _check(
            e,
            not self.server_urls or bool(self.api_key_env),
            "api_key_env",
            "servers at server_urls were started elsewhere, so a key made by this run cannot be theirs: "
            "start them with a key, export it and name its variable here",
        )
        _check(
            e,
            self.api_key_env is None or bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env)),
            "api_key_env",
            f"must be an environment variable name (letters, digits, _), got {self.api_key_env!r}",
        )

    def _validate_async(self, e: list[tuple[str, str]]) -> None:
        """The asynchronous-RL and weight-lag fields (docs/async.md)."""
        _check(
            e,
            self.weight_lag_steps >= 0,
            "weight_lag_steps",
            f"must be >= 0 (RL steps the served weights lag the trainer's), got {self.weight_lag_steps}",
        )
        _check(
            e,
            self.max_staleness >= 1,
            "max_staleness",
            f"must be >= 1 (weight versions), got {self.max_staleness}",
        )
        _check(
            e,
            all(isinstance(c, int) and c >= 0 for c in self.producer_cpus)
            and len(set(self.producer_cpus)) == len(self.producer_cpus),
            "producer_cpus",
            f"must be distinct core numbers >= 0, got {list(self.producer_cpus)}",
        )
        _check(
            e,
            not self.producer_cpus or self.mode == "async",
            "producer_cpus",
            "pins the async producer's thread; sync mode has none (its client runs in the trainer's "
            "thread, while the trainer waits): set rollout.mode=async or producer_cpus=[]",
        )
        if self.mode == "async":
            _check(
                e,
                self.backend != "replay",
                "mode",
                "async generates on live SGLang servers while training; a replay of recorded rollouts "
                "(backend: replay, --load-rollouts) is sync: set rollout.mode=sync",
            )
            _check(
                e,
                not (self.pause_mode == "abort" and self.partial_rollouts),
                "pause_mode",
                "abort ends the requests in flight at a weight update, so they cannot go on with the new "
                "weights: use pause_mode retract (or in_place) for partial rollouts, or set "
                "rollout.partial_rollouts=false (aborted samples are generated again)",
            )
            _check(
                e,
                self.max_staleness >= self.weight_lag_steps,
                "max_staleness",
                f"every token is at least weight_lag_steps={self.weight_lag_steps} versions old, more than "
                f"max_staleness={self.max_staleness} allows: raise it to >= {self.weight_lag_steps} "
                f"({self.weight_lag_steps + 1} lets generation overlap training)",
            )

    def cpus_of_server(self, k: int) -> tuple[int, ...] | None:
        """The cores of server ``k`` (its slice of :attr:`server_cpus`); None when they are shared."""
        if not self.server_cpus:
            return None
        n = len(self.server_cpus) // self.num_servers
        return self.server_cpus[k * n : (k + 1) * n]
