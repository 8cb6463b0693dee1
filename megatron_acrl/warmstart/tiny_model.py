"""Tiny models built locally (no hub access): a byte-level BPE tokenizer and HF checkpoints.

Used by tests, the CPU demo and the benchmarks. Everything is deterministic and cached under a
directory keyed by a hash of what determines the bytes, and built atomically (into a temporary
directory renamed into place), so concurrent builders never see a half-written checkpoint::

    path = build_checkpoint(ModelConfig())          # Qwen2ForCausalLM, bf16 safetensors + tokenizer
    path = build_checkpoint(ModelConfig(family="qwen3_moe", num_experts=4, qk_layernorm=True,
                                        add_qkv_bias=False))

The checkpoint directory is a normal HF model directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, chat template) that SGLang serves and the trainer loads into
Megatron.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from megatron_acrl.config import ModelConfig
from megatron_acrl.megatron.convert import hf_config

# Bump when the corpus or tokenizer recipe changes: it is part of every cache key.
TOKENIZER_RECIPE_VERSION = 2  # 2: the chat template gained tool-call markup
CHECKPOINT_RECIPE_VERSION = 2

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>"
    '{{ {"name": c["name"], "arguments": c["arguments"]} | tojson }}</tool_call>'
    "{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML with tool-call markup (``megatron_acrl.rollout.agent.templates.TINY_CHATML``, the same
source): a ``tools`` list is rendered in a system turn, an assistant message's ``tool_calls`` as
``<tool_call>{...}</tool_call>``, a tool result as a ``tool`` turn. Messages without tools or tool
calls render exactly as the first template (recipe version 1) did."""

_WORDS = (
    "the a an is are was of to and in on for with what answer question result sum total number "
    "add plus minus times equals think step first then so therefore because hello world model "
    "reward policy sample token learn train value each two three four five six seven eight nine ten"
).split()


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/megatron-acrl/tiny`` (``~/.cache/...`` by default)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "megatron-acrl" / "tiny"


def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    """Synthetic text: arithmetic ("12+34=46"), Q/A in english-ish words, chat-formatted lines."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        res = {"+": a + b, "-": a - b, "*": a * b}[op]
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        kind = i % 4
        if kind == 0:
            lines.append(f"{a}{op}{b}={res}")
        elif kind == 1:
            lines.append(f"What is {a} {op} {b}? The answer is {res}.")
        elif kind == 2:
            lines.append(words.capitalize() + ".")
        else:
            lines.append(f"<|im_start|>user\n{a}+{b}=<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>")
    return lines


def _atomic_build(final: Path, build: Any) -> Path:
    """Run ``build(tmp_dir)`` and rename the result to ``final``; a concurrent winner is kept."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # a real failure, not "another process got there first"
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_tokenizer(vocab_size: int = 320, cache_dir: str | Path | None = None) -> Path:
    """Train (or reuse) the byte-level BPE tokenizer with ``vocab_size`` entries; returns its directory.

    Digits are always split into single tokens (as in Qwen2's tokenizer), so "12+34=" becomes
    ``1 2 + 3 4 =`` and arithmetic tasks tokenise the same way at every length.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    min_vocab = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise ValueError(
            f"tokenizer vocab_size must be >= {min_vocab} (bytes + special tokens), got {vocab_size}"
        )
    key = hashlib.sha256(json.dumps([TOKENIZER_RECIPE_VERSION, vocab_size]).encode()).hexdigest()[:16]
    final = Path(cache_dir or default_cache_dir()) / f"tokenizer-v{vocab_size}-{key}"

    def build(tmp: Path) -> None:
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_corpus(), trainer=trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token="<|endoftext|>",
            pad_token="<|endoftext|>",
            bos_token=None,
            unk_token=None,
        )
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(str(tmp))

    return _atomic_build(final, build)


def hf_config_dict(cfg: ModelConfig, *, eos_token_id: int, initializer_range: float = 0.02) -> dict[str, Any]:
    """HF ``config.json`` content for ``cfg`` (architecture, sizes, family switches).

    Raises ``ValueError`` for combinations the HF family cannot express (so the Megatron model and the
    served HF model can never silently differ): qwen2 always has a QKV bias and no QK-norm, qwen3 /
    qwen3_moe always have QK-norm and no bias, llama's ``attention_bias`` would also bias o_proj.
    """
    want = {
        "qwen2": (True, False),
        "llama": (False, False),
        "qwen3": (False, True),
        "qwen3_moe": (False, True),
    }[cfg.family]
    if (cfg.add_qkv_bias, cfg.qk_layernorm) != want:
        raise ValueError(
            f"family {cfg.family} needs add_qkv_bias={want[0]}, qk_layernorm={want[1]} "
            f"(got {cfg.add_qkv_bias}, {cfg.qk_layernorm})"
        )
    if cfg.is_moe != (cfg.family == "qwen3_moe"):
        raise ValueError(
            f"num_experts={cfg.num_experts} does not fit family {cfg.family} (only qwen3_moe is MoE)"
        )
    # The architecture comes from the one Megatron<->HF table module (the trainer's export uses the
    # same function); a tiny checkpoint only adds its initialisation and special-token ids.
    d: dict[str, Any] = hf_config(cfg)
    d.update(
        initializer_range=initializer_range,
        eos_token_id=eos_token_id,
        bos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        torch_dtype="bfloat16",
    )
    return d


def _hf_config(d: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    kw = {k: v for k, v in d.items() if k not in ("architectures", "model_type", "torch_dtype")}
    c = AutoConfig.for_model(d["model_type"], **kw)
    c.architectures = d["architectures"]
    return c


def tiny_tokenizer_vocab(cfg: ModelConfig) -> int:
    """The vocabulary of the tiny tokenizer a checkpoint of ``cfg`` carries: small (at most 320),
    whatever the embedding table's size."""
    return min(cfg.vocab_size, 320)


def build_checkpoint(
    cfg: ModelConfig,
    *,
    seed: int = 0,
    initializer_range: float | None = None,
    router_init_range: float | None = None,
    router_shared_init_range: float = 0.0,
    expert_init_range: float | None = None,
    output_init_range: float | None = None,
    cache_dir: str | Path | None = None,
) -> Path:
    """Build (or reuse) a bf16 HF checkpoint for ``cfg`` initialised from ``seed``; returns its directory.

    ``initializer_range`` is the std of every weight matrix (embeddings, attention, MLP, router,
    LM head); it defaults to 0.02 (dense) / 0.2 (MoE: large enough that routing is not near-uniform,
    so routing mismatches are visible). The other ranges override it for one group of an MoE model,
    to shape how routing mismatches look (``tests/bridge/test_r3_server.py``); None keeps
    ``initializer_range``, and with all of them at their defaults the weights are exactly those of
    the plain recipe:

    * ``router_init_range``: std of each expert's own router row (``mlp.gate.weight``). Small: the
      experts' router logits lie close together, so more tokens sit near a top-k tie.
    * ``router_shared_init_range``: std of one random vector per layer added to every expert's router
      row. It shifts all experts' logits of a token by the same amount, so exact routing is
      unchanged (softmax is shift-invariant), but it makes the logits large next to their spread:
      an engine that rounds router logits to bf16 (SGLang does) then resolves near-ties differently
      from an fp32 trainer -- the routing flips real bf16 serving produces, more of them.
    * ``expert_init_range``: std of the expert weights (``mlp.experts.*``). Large: the MoE output
      dominates the residual stream, so one flipped expert moves the token's log-prob a lot.
    * ``output_init_range``: std of the LM head (untied). Small logits keep the bf16 precision gap
      of tokens whose routing agrees small.

    Weights are saved under the checkpoint's own names (per-expert names for MoE), which is also
    what SGLang's loader and the weight-sync manifest expect.
    """
    init = initializer_range if initializer_range is not None else (0.2 if cfg.is_moe else 0.02)
    arch_fields = {
        # model.lora adapts the RL policy, not this base: LoRA and full runs share it (null as before)
        f.name: None if f.name == "lora" else getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.name
        not in ("params_dtype", "hf_path", "tokenizer_path", "moe_aux_loss_coeff", "moe_routing_replay")
    }
    tok_vocab = tiny_tokenizer_vocab(cfg)
    groups = _init_groups(
        cfg,
        router=router_init_range,
        router_shared=router_shared_init_range or None,
        expert=expert_init_range,
        output=output_init_range,
    )
    key_parts: list[Any] = [CHECKPOINT_RECIPE_VERSION, arch_fields, seed, init, tok_vocab]
    if groups:  # the plain recipe keeps its cache key
        key_parts.append(groups)
    key_src = json.dumps(key_parts, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    root = Path(cache_dir or default_cache_dir())
    final = root / f"{cfg.family}-{key}"
    if final.is_dir():
        return final
    tok_dir = build_tokenizer(tok_vocab, cache_dir=root)
    recipe = {"model_config": arch_fields, "seed": seed, "initializer_range": init, "init_ranges": groups}
    return _atomic_build(final, lambda tmp: _write_checkpoint(tmp, cfg, tok_dir, recipe))


def _init_groups(cfg: ModelConfig, **ranges: float | None) -> dict[str, float]:
    """The weight groups given their own init std (None: ``initializer_range``), checked against
    the model (router / expert groups need MoE, the output group an untied head)."""
    groups = {k: v for k, v in ranges.items() if v is not None}
    if groups and not cfg.is_moe and set(groups) - {"output"}:
        raise ValueError(f"router/expert init ranges need an MoE model, got family {cfg.family}")
    if "output" in groups and cfg.tie_embeddings:
        raise ValueError("output_init_range needs an untied LM head (tie_embeddings: false)")
    return groups


def _write_checkpoint(tmp: Path, cfg: ModelConfig, tok_dir: Path, recipe: dict[str, Any]) -> None:
    """Initialise the HF model of ``cfg`` as ``recipe`` says and save it, the tokenizer and the
    recipe (``megatron_acrl.json``) into ``tmp``."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    if len(tok) > cfg.vocab_size:
        raise ValueError(f"model vocab_size {cfg.vocab_size} < tokenizer size {len(tok)}")
    init, groups = recipe["initializer_range"], recipe["init_ranges"]
    hf_cfg = _hf_config(hf_config_dict(cfg, eos_token_id=tok.eos_token_id, initializer_range=init))
    # Random init on CPU in fp32 from a private generator state, then cast: deterministic per seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe["seed"])
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
        if groups:
            _reinit_groups(model, groups)
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / "megatron_acrl.json").write_text(json.dumps(recipe, indent=2))


def _reinit_groups(model: torch.nn.Module, groups: dict[str, float]) -> None:
    """Redraw the weight groups named in ``groups`` (see :func:`build_checkpoint`), in parameter order
    from the current generator state, so the result is deterministic per seed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the router, [experts, hidden]
                if "router" in groups:
                    p.normal_(0.0, groups["router"])
                if "router_shared" in groups:
                    p += torch.randn(1, p.shape[1]) * groups["router_shared"]
            elif ".mlp.experts." in name and "expert" in groups and p.dim() >= 2:
                p.normal_(0.0, groups["expert"])
            elif name == "lm_head.weight" and "output" in groups:
                p.normal_(0.0, groups["output"])


__all__ = ["build_checkpoint", "build_tokenizer", "default_cache_dir", "hf_config_dict"]
