"""The model architecture and the trainer's parallel layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from megatron_acrl.config._base import ConfigError, _check, _Section

ModelFamily = Literal["qwen2", "llama", "qwen3", "qwen3_moe"]

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The Megatron linear layers an adapter may sit on (= HF all-linear: q/k/v, o, gate/up, down)."""

LORA_FAMILIES = ("qwen2", "llama", "qwen3", "qwen3_moe")
"""Families whose Megatron<->HF tables (``megatron/convert.py``) name every adapter target for PEFT."""

_EXPERT_TARGETS = ("linear_fc1", "linear_fc2")

LORA_HF_MODULES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""The HF modules (PEFT's and SGLang's ``target_modules``) of each Megatron target."""

_HF_ALIASES = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "qkv_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "gate_up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}


@dataclass(frozen=True)
class LoraConfig(_Section):
    """Low-rank adapters on the Megatron model (issue #35); ``model.lora: null`` trains every weight."""

    rank: int = 16
    """The adapter rank r: A is [r, in], B is [out, r]."""

    alpha: float = 32.0
    """The scale numerator: the adapter adds (alpha / r) * B @ A to the base layer's output."""

    dropout: float = 0.0
    """Dropout on the adapter's input while training (0 in RL recipes: it would make pi_old noisy)."""

    target_modules: tuple[str, ...] = LORA_TARGETS
    """The Megatron linear layers that get an adapter (a subset of linear_qkv, linear_proj, linear_fc1,
    linear_fc2; on an MoE model linear_fc1/linear_fc2 mean the experts' layers)."""

    sync: Literal["adapter", "merged"] = "adapter"
    """adapter: push only the adapters to the servers' LoRA engine under a versioned name; merged:
    fold them into the weights and push those through the full-weight sync."""

    transport: Literal["auto", "disk", "tensors"] = "auto"
    """How an adapter push reaches the servers (``sync: adapter``): ``disk`` writes each version once
    as a PEFT directory on this host's tmpfs and the servers load it by path (servers on this host
    only: 18-21 ms a load on the 129 MB benchmark model); ``tensors`` POSTs one flattened bucket
    (any host; 50-60 ms, mostly SGLang parsing the body); ``auto``: ``disk`` when every server URL is
    loopback. Set ``tensors`` for a server on this host's network that does not share its /dev/shm
    (another container)."""

    @property
    def hf_modules(self) -> tuple[str, ...]:
        """The HF module names the adapters sit on, in the fixed order of :data:`LORA_HF_MODULES`."""
        return tuple(m for t, hf in LORA_HF_MODULES.items() if t in self.target_modules for m in hf)

    def peft_config(self, base_model_name_or_path: str) -> dict:
        """``adapter_config.json`` of these adapters (PEFT ``LoraConfig`` fields), for the export and
        the servers alike: one rank, plain alpha / r scaling (SGLang ignores rsLoRA, rank and alpha
        patterns), no bias, no DoRA."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": list(self.hf_modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "rank_pattern": {},
            "alpha_pattern": {},
            "modules_to_save": None,
            "init_lora_weights": True,
            "base_model_name_or_path": base_model_name_or_path,
        }

    def validate(self) -> list[tuple[str, str]]:
        e: list[tuple[str, str]] = []
        _check(e, self.rank >= 1, "rank", f"must be >= 1, got {self.rank}")
        _check(e, self.alpha > 0, "alpha", f"must be > 0, got {self.alpha}")
        _check(e, 0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")
        _check(e, len(self.target_modules) > 0, "target_modules", f"must name one of {list(LORA_TARGETS)}")
        for name in self.target_modules:
            if name in LORA_TARGETS:
                continue
            alias = _HF_ALIASES.get(name)
            fix = f"use the Megatron name {alias!r}" if alias else f"valid names: {', '.join(LORA_TARGETS)}"
            e.append(("target_modules", f"unknown module {name!r}; {fix}"))
        return e


@dataclass(frozen=True)
class ModelConfig(_Section):
    family: ModelFamily = "qwen2"
    """Model family; selects the Megatron<->HF name table and the architecture switches."""

    num_layers: int = 2
    """Number of transformer layers."""

    hidden_size: int = 64
    """Hidden (model) dimension."""

    ffn_hidden_size: int = 128
    """SwiGLU intermediate size of dense MLPs."""

    num_attention_heads: int = 4
    """Attention heads."""

    num_query_groups: int = 2
    """Key/value heads (GQA); equal to num_attention_heads for MHA."""

    kv_channels: int | None = None
    """Per-head dimension; None means hidden_size // num_attention_heads."""

    vocab_size: int = 320
    """Vocabulary size of the tokenizer (Megatron pads it for TP internally)."""

    max_position_embeddings: int = 512
    """Longest sequence (prompt + response) the model is built for."""

    rotary_base: float = 10000.0
    """RoPE base frequency (theta)."""

    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""

    qk_layernorm: bool = False
    """Apply RMSNorm to queries and keys (Qwen3)."""

    add_qkv_bias: bool = True
    """Bias on the QKV projection (Qwen2 has it; Llama and Qwen3 do not)."""

    tie_embeddings: bool = True
    """Share input embedding and output projection weights."""

    num_experts: int = 0
    """Routed experts per MoE layer; 0 builds a dense model."""

    moe_router_topk: int = 2
    """Experts each token is routed to."""

    moe_ffn_hidden_size: int = 64
    """Intermediate size of each routed expert."""

    moe_shared_expert_ffn_hidden_size: int = 0
    """Intermediate size of the shared expert; 0 means no shared expert."""

    moe_aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss coefficient."""

    moe_routing_replay: Literal["off", "rollout", "train"] = "off"
    """MoE routing replay (the issue's moe.routing_replay): off (the trainer routes itself), rollout
    (R3: pi_old and training passes replay the experts SGLang chose), train (R2: the training pass
    replays the pi_old pass's own routing)."""

    params_dtype: Literal["bf16", "fp32"] = "bf16"
    """Training precision of parameters and activations (fp32 for exact layout-parity tests)."""

    hf_path: str | None = None
    """HF safetensors checkpoint to initialise from; None initialises randomly from training.seed."""

    tokenizer_path: str | None = None
    """Tokenizer directory; None uses the locally built tiny tokenizer."""

    lora: LoraConfig | None = None
    """Low-rank adapters (rank, alpha, dropout, target_modules, sync); null trains every weight."""

    def validate(self) -> list[tuple[str, str]]:
        e: list[tuple[str, str]] = []
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size"):
            _check(e, getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _check(
            e,
            self.num_query_groups >= 1 and self.num_attention_heads % max(self.num_query_groups, 1) == 0,
            "num_query_groups",
            f"must divide num_attention_heads={self.num_attention_heads}, got {self.num_query_groups}",
        )
        if self.kv_channels is None:
            _check(
                e,
                self.hidden_size % max(self.num_attention_heads, 1) == 0,
                "hidden_size",
                f"must be divisible by num_attention_heads={self.num_attention_heads} "
                "(or set kv_channels explicitly)",
            )
        _check(e, self.num_experts >= 0, "num_experts", "must be >= 0 (0 = dense)")
        if self.num_experts:
            _check(
                e,
                1 <= self.moe_router_topk <= self.num_experts,
                "moe_router_topk",
                f"must be in [1, num_experts={self.num_experts}], got {self.moe_router_topk}",
            )
            _check(e, self.moe_ffn_hidden_size >= 1, "moe_ffn_hidden_size", "must be >= 1 for an MoE model")
        _check(
            e,
            self.family != "qwen3_moe" or self.num_experts > 0,
            "num_experts",
            "family qwen3_moe needs num_experts > 0",
        )
        _check(e, self.norm_epsilon > 0, "norm_epsilon", "must be > 0")
        if self.lora is not None:
            e += self._lora_errors()
        _check(
            e,
            self.moe_routing_replay == "off" or self.num_experts > 0,
            "moe_routing_replay",
            f"{self.moe_routing_replay!r} replays MoE routing but the model is dense (num_experts=0); "
            "set moe_routing_replay: off",
        )
        return e

    def _lora_errors(self) -> list[tuple[str, str]]:
        """``model.lora`` against this model: a family with PEFT names, and MoE experts (which
        CPU SGLang cannot serve as adapters, and whose shared expert has no HF name)."""
        lora = self.lora
        assert lora is not None
        e: list[tuple[str, str]] = []
        _check(
            e,
            self.family in LORA_FAMILIES,
            "lora",
            f"LoRA needs a family with Megatron<->HF tables ({', '.join(LORA_FAMILIES)}), got "
            f"{self.family!r}; set model.lora: null",
        )
        experts = [t for t in lora.target_modules if t in _EXPERT_TARGETS] if self.is_moe else []
        if experts:
            _check(
                e,
                lora.sync == "merged",
                "lora.sync",
                f"sync: adapter cannot serve adapters on MoE experts ({', '.join(experts)} adapt the "
                "routed experts): SGLang's expert-LoRA kernels need a GPU (Triton), and on CPU the first "
                "request kills the server. Set model.lora.sync: merged (the adapters are folded into the "
                "weights and pushed by the full-weight sync), or target attention only: "
                "target_modules: [linear_qkv, linear_proj]",
            )
            _check(
                e,
                self.moe_shared_expert_ffn_hidden_size == 0,
                "lora.target_modules",
                f"{', '.join(experts)} on an MoE model adapt the routed experts, but this model also has "
                "a shared expert (no HF/PEFT name, so its adapter could not be exported); set "
                "moe_shared_expert_ffn_hidden_size: 0 or target attention only: [linear_qkv, linear_proj]",
            )
        return e

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def local_servers(urls: Sequence[str]) -> bool:
    """Whether every server at ``urls`` listens on this host's loopback (so it reads our files)."""
    return bool(urls) and all((urlsplit(u).hostname or "") in LOOPBACK_HOSTS for u in urls)


def lora_transport_errors(lora: LoraConfig | None, server_urls: Sequence[str]) -> list[tuple[str, str]]:
    """``model.lora.transport: disk`` against ``rollout.server_urls`` (a check spanning two sections):
    a server elsewhere cannot read this host's tmpfs."""
    if lora is None or lora.transport != "disk" or not server_urls or local_servers(server_urls):
        return []
    return [
        (
            "model.lora.transport",
            f"disk: the servers read each adapter from this host's /dev/shm, but rollout.server_urls "
            f"{list(server_urls)} are not all loopback; use transport: tensors (or auto)",
        )
    ]


def lora_layout_errors(model: ModelConfig, parallel: ParallelConfig) -> list[tuple[str, str]]:
    """``model.lora`` against the trainer's layout (a check spanning two sections)."""
    lora = model.lora
    if lora is None:
        return []
    e: list[tuple[str, str]] = []
    _check(
        e,
        lora.rank % parallel.tp == 0,
        "model.lora.rank",
        f"the adapters' A is split over tensor parallelism, so rank={lora.rank} must be divisible by "
        f"parallel.tp={parallel.tp}; use rank {-(-lora.rank // parallel.tp) * parallel.tp}",
    )
    experts = model.is_moe and any(t in _EXPERT_TARGETS for t in lora.target_modules)
    _check(
        e,
        not experts or parallel.tp == 1,
        "model.lora.target_modules",
        f"adapters on MoE experts need expert tensor parallel size 1, but parallel.tp={parallel.tp} "
        "splits the experts too; use parallel.tp=1 (expert parallelism parallel.ep is fine), or target "
        "attention only: [linear_qkv, linear_proj]",
    )
    return e


@dataclass(frozen=True)
class ParallelConfig(_Section):
    tp: int = 1
    """Tensor-parallel size."""

    pp: int = 1
    """Pipeline-parallel size."""

    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B); None disables interleaving."""

    ep: int = 1
    """Expert-parallel size (MoE only)."""

    dp: int | None = None
    """Data-parallel size; None derives it as world_size / (tp * pp)."""

    world_size: int | None = None
    """Trainer ranks; None takes it from the launcher (WORLD_SIZE) at start-up."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism (required for MoE with tp > 1)."""

    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks."""

    def validate(self) -> list[tuple[str, str]]:
        e: list[tuple[str, str]] = []
        for name in ("tp", "pp", "ep"):
            _check(e, getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _check(e, self.vpp is None or self.vpp >= 2, "vpp", "must be >= 2 or null (no interleaving)")
        _check(e, self.vpp is None or self.pp >= 2, "vpp", "interleaving needs pp >= 2; set vpp: null")
        _check(e, self.dp is None or self.dp >= 1, "dp", "must be >= 1 or null (derived)")
        if self.world_size is not None and self.tp >= 1 and self.pp >= 1:
            mp = self.tp * self.pp
            if self.dp is not None:
                _check(
                    e,
                    mp * self.dp == self.world_size,
                    "dp",
                    f"tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {mp * self.dp} != world_size "
                    f"{self.world_size}; "
                    + (f"set dp: {self.world_size // mp}" if self.world_size % mp == 0 else "change tp/pp"),
                )
            else:
                _check(
                    e,
                    self.world_size % mp == 0,
                    "world_size",
                    f"world_size {self.world_size} is not divisible by tp*pp = {mp}",
                )
        return e

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel size for ``world_size`` ranks (raises ConfigError if inconsistent)."""
        mp = self.tp * self.pp
        if world_size % mp or (self.dp is not None and self.dp * mp != world_size):
            raise ConfigError(
                [
                    (
                        "parallel",
                        f"tp*pp*dp must equal world_size={world_size} "
                        f"(tp={self.tp}, pp={self.pp}, dp={self.dp})",
                    )
                ]
            )
        return world_size // mp
