"""The exact metric J: the enumerable prompts, the teacher-forced batch, the config checks, and two
live runs of the real loop (Megatron trainer, SGLang CPU server): with BF16 rollout the served J
equals the trainer's within bf16 noise and the trainer's J equals an independent transformers
forward of the exported weights; with the stress and a lag the served J is the lagged stress copy's.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_acrl.config import ConfigError, load_config
from megatron_acrl.logging import read_jsonl_metrics
from megatron_acrl.rollout.evaluate import exact_batch, exact_due, exact_j, exact_j_summary, exact_sequences
from megatron_acrl.tasks import make_task
from megatron_acrl.tasks.synthetic import AdditionTask

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "tiny_dense.yaml")
BASE = [
    "training.sft_steps=150",
    "training.sft_lr=3e-3",
    "task.num_digits=1",
    "task.heldout_fraction=0",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "training.micro_batch_size=8",
    "rollout.max_new_tokens=6",
    "rollout.max_prompt_len=16",
    "logging.wandb_mode=disabled",
    "training.num_steps=2",
    "training.exact_eval_interval=1",
    "training.lr=1e-3",
    # a shared 2-core machine under load has taken more than the default 300 s to start a server
    "rollout.startup_timeout_s=1800",
]
STRESS = [
    "rollout.quantization=fp8_per_tensor",
    "rollout.fp8_rounding=toward_zero",
    "rollout.fp8_mantissa_bits=1",
    "rollout.fp8_quantize_lm_head=true",
    "rollout.kv_cache_dtype=fp8_e4m3",
    "rollout.weight_lag_steps=1",
    "correction.method=none",
]


def test_addition_prompts_enumerate_every_fact_once():
    prompts = AdditionTask(1).exact_prompts()
    assert len(prompts) == 100 and len({p.text for p in prompts}) == 100
    assert all(int(p.text[0]) + int(p.text[2]) == int(p.answer) for p in prompts)
    assert len(AdditionTask(2).exact_prompts()) == 10_000
    with pytest.raises(ValueError, match="num_digits <= 2"):
        AdditionTask(3).exact_prompts()


def test_heldout_fraction_zero_trains_every_fact():
    cfg = load_config(CONFIG, ["task.num_digits=1", "task.heldout_fraction=0"])
    task = make_task(cfg.task)
    stream = task.train_prompts(seed=0)
    train = {next(stream).text for _ in range(100)}
    assert len(train) == 100 and task.eval_prompts(32) == []
    default = make_task(load_config(CONFIG, ["task.num_digits=1"]).task)
    assert 0 < len(default.eval_prompts(100)) < 30  # the old 10% hash split is the default


def test_exact_batch_masks_answer_and_eos(tiny_tokenizer):
    prompts = AdditionTask(1).exact_prompts()[:5]
    eos = tiny_tokenizer.eos_token_id
    seqs, lens = exact_sequences(tiny_tokenizer, prompts, eos)
    tokens, mask = exact_batch(seqs, lens, pad_id=eos)
    for i, (s, k) in enumerate(zip(seqs, lens, strict=True)):
        assert s[-1] == eos and tokens[i, : len(s)].tolist() == s
        assert mask[i].sum() == k and mask[i, len(s) - k : len(s)].eq(1).all()
        answer = tiny_tokenizer.decode(s[len(s) - k : -1])
        assert answer == prompts[i].answer
    assert exact_j([0.0, math.log(0.5)]) == pytest.approx(0.75)
    assert exact_j(torch.tensor([math.log(0.2)] * 3, dtype=torch.float64)) == pytest.approx(0.2)


def test_exact_due_at_zero_every_n_and_the_end():
    cfg = load_config(
        CONFIG, ["task.num_digits=1", "training.num_steps=12", "training.exact_eval_interval=5"]
    )
    assert [s for s in range(13) if exact_due(cfg, s)] == [0, 5, 10, 12]
    assert not any(exact_due(load_config(CONFIG), s) for s in range(5))


def test_config_refuses_what_cannot_be_enumerated():
    with pytest.raises(ConfigError, match=r"training\.exact_eval_interval.*enumerable.*num_digits=3"):
        load_config(CONFIG, ["task.num_digits=3", "training.exact_eval_interval=5"])
    with pytest.raises(ConfigError, match=r"training\.exact_eval_interval.*counting"):
        load_config(CONFIG, ["task.name=counting", "training.exact_eval_interval=5"])
    with pytest.raises(ConfigError, match=r"task\.heldout_fraction.*\[0, 1\)"):
        load_config(CONFIG, ["task.heldout_fraction=1.0"])
    with pytest.raises(ConfigError, match=r"rollout\.quantization.*fp8_quantize_lm_head"):
        load_config(CONFIG, ["rollout.quantization=none", "rollout.fp8_quantize_lm_head=true"])
    assert load_config(CONFIG, ["rollout.fp8_quantize_lm_head=true"]).rollout.stress_quantization


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from transformers import AutoTokenizer

    from megatron_acrl.warmstart.tiny_model import build_tokenizer

    return AutoTokenizer.from_pretrained(str(build_tokenizer()))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """Two runs in one process: BF16 rollout (exported at the end), and stress + lag 1."""
    tmp = tmp_path_factory.mktemp("exact")
    spec = [
        {
            "config": CONFIG,
            "overrides": [*BASE, "rollout.quantization=none", "correction.method=none"],
            "args": ["--run-dir", str(tmp / "bf16"), "--export-hf", str(tmp / "export")],
        },
        {"config": CONFIG, "overrides": [*BASE, *STRESS], "args": ["--run-dir", str(tmp / "stress")]},
    ]
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "e2e_runner.py"), str(tmp / "spec.json")],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return tmp


def _exact_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl_metrics(run_dir / "metrics.jsonl") if "eval/exact_j" in r]


def test_bf16_served_j_equals_the_trainers(live):
    rows = _exact_rows(live / "bf16")
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the weights that sample step 1
    for r in rows:
        assert 0.05 < r["eval/exact_j"] < 1.0
        # the same bf16 weights: only the two engines' bf16 arithmetic differs
        assert abs(r["eval/exact_j_served"] - r["eval/exact_j"]) < 0.01, r
        assert r["eval/exact_j_gap"] == pytest.approx(r["eval/exact_j_served"] - r["eval/exact_j"])


def test_trainer_j_matches_an_independent_transformers_forward(live, tiny_tokenizer):
    from sglang_bridge.hf_reference import hf_logprobs, load_hf

    model = load_hf(live / "export")  # fp32 compute on the exported bf16 weights
    prompts = AdditionTask(1).exact_prompts()
    seqs, lens = exact_sequences(tiny_tokenizer, prompts, tiny_tokenizer.eos_token_id)
    pairs = list(zip(seqs, lens, strict=True))
    lp = hf_logprobs(model, [s[:-k] for s, k in pairs], [s[-k:] for s, k in pairs], 1.0)
    reference = sum(math.exp(sum(x)) for x in lp) / len(lp)
    final = _exact_rows(live / "bf16")[-1]["eval/exact_j"]
    assert final == pytest.approx(reference, abs=3e-3)


def test_stress_served_j_is_the_lagged_quantized_copy(live):
    rows = _exact_rows(live / "stress")
    # The quantized copy (lm_head included) scores the answers lower than the trainer's weights.
    assert rows[0]["eval/exact_j_served"] < rows[0]["eval/exact_j"] - 0.01
    # Lag 1: after step 1 the servers still hold version 0, the copy step 0 scored: the same J.
    assert rows[1]["eval/exact_j_served"] == pytest.approx(rows[0]["eval/exact_j_served"], abs=1e-9)
    assert rows[1]["eval/exact_j"] != rows[0]["eval/exact_j"]  # while the trainer moved on
    line = exact_j_summary(live / "stress")
    assert line is not None and line.startswith("exact J (teacher-forced, step 0 -> 2): trainer ")
    assert "served" in line and "sampled reward" in line


def test_the_stress_lm_head_is_the_tied_embedding_when_there_is_none():
    from megatron_acrl.servers.transfer import lm_head_names

    assert lm_head_names(load_config(CONFIG, ["model.tie_embeddings=false"])) == ("lm_head.weight",)
    assert lm_head_names(load_config(CONFIG, ["model.tie_embeddings=true"])) == ("model.embed_tokens.weight",)
