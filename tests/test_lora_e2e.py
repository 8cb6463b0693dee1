"""LoRA through the whole driver (issue #35, trainer side): real SGLang servers, ``sync: merged``.

One live run (3 RL steps, the adapters merged into the weights and pushed through the full-weight
sync every step) records its rollouts, checkpoints every step and exports both the PEFT adapter
directory (``--export-hf``) and the merged model (``--export-hf-merged``). Replays of its rollouts
then check that a run stopped by SIGTERM resumes exactly (adapters and their optimizer state).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_e2e import BASE, CONFIG, rows, run_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]

LORA = [
    "model.lora={rank: 8, alpha: 16.0, sync: merged}",
    "training.lr=2e-3",
    "training.save_interval=1",
]


def _logprobs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def test_lora_merged_sync_export_and_resume(tmp_path: Path) -> None:
    common = BASE + LORA + ["logging.wandb_mode=disabled"]
    live = [
        {
            "config": CONFIG,
            "overrides": common + ["training.num_steps=3", f"training.checkpoint_dir={tmp_path / 'ck-live'}"],
            "args": [
                "--run-dir",
                str(tmp_path / "live"),
                "--save-rollouts",
                str(tmp_path / "rollouts"),
                "--export-hf",
                str(tmp_path / "peft"),
                "--export-hf-merged",
                str(tmp_path / "merged"),
            ],
        }
    ]
    run_spec(tmp_path, live)
    r = rows(tmp_path / "live")
    assert [x["step"] for x in r] == [1, 2, 3]
    for x in r:  # the servers serve the merged weights: the trainer-vs-rollout mismatch stays finite
        assert math.isfinite(x["loss/pg_loss"]) and math.isfinite(x["mismatch/kl"])

    # the checkpoint holds the adapters (and their optimizer state) and its base's reference only
    from megatron.core import dist_checkpointing

    latest = json.loads((tmp_path / "ck-live" / "latest.json").read_text())
    policy = tmp_path / "ck-live" / latest["dir"] / "policy"
    keys = dist_checkpointing.load_tensors_metadata(str(policy)).keys()
    assert keys and all("_lora." in k for k in keys), [k for k in keys if "_lora." not in k][:5]
    meta = dist_checkpointing.load_common_state_dict(str(policy))["acrl_meta"]["lora"]
    assert meta["rank"] == 8 and len(meta["base"]["sha256"]) == 64

    # --export-hf: a PEFT dir on its base == --export-hf-merged (a plain HF model)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16.0 and config["peft_type"] == "LORA"
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    tokens = torch.randint(1, 300, (4, 24), generator=torch.Generator().manual_seed(0))
    base_lp = _logprobs(base, tokens)
    peft_lp = _logprobs(PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval(), tokens)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    merged_lp = _logprobs(merged, tokens)
    effect = (peft_lp - base_lp).abs().max().item()
    err = (peft_lp - merged_lp).abs().max().item()
    print(f"lora e2e: adapter effect {effect:.3e}, PEFT vs merged export (bf16 weights) {err:.3e}")
    assert effect > 1e-3, "the adapters did not train"
    assert err < 0.1 * effect + 2e-2, (err, effect)  # the merged export is bf16

    # SIGTERM during step 2 of a replay, resumed: step 3 equals the uninterrupted replay's
    replay = ["--load-rollouts", str(tmp_path / "rollouts")]
    ck = f"training.checkpoint_dir={tmp_path / 'ck-b'}"
    spec = [
        {
            "config": CONFIG,
            "overrides": common + ["training.num_steps=3", f"training.checkpoint_dir={tmp_path / 'ck-a'}"],
            "args": ["--run-dir", str(tmp_path / "a"), *replay],
        },
        {
            "config": CONFIG,
            "overrides": common + ["training.num_steps=3", ck],
            "args": ["--run-dir", str(tmp_path / "b"), *replay],
            "faults": {"sigterm_at_train_step": 2},
        },
        {
            "config": CONFIG,
            "overrides": common + ["training.num_steps=3", ck],
            "args": ["--run-dir", str(tmp_path / "c"), *replay],
        },
    ]
    run_spec(tmp_path, spec)
    a, b, c = rows(tmp_path / "a"), rows(tmp_path / "b"), rows(tmp_path / "c")
    assert [x["step"] for x in b] == [1, 2] and [x["step"] for x in c] == [3]
    for k, v in a[2].items():
        if not k.startswith(("time/", "perf/", "sync/seconds")):
            assert c[0][k] == v, k


def test_lora_adapter_sync_through_the_driver(tmp_path: Path) -> None:
    """The two halves of issue #35 together: the trainer's adapters pushed to a LoRA-enabled server
    (``sync: adapter``) every step, the rollouts sampled with that version's adapter."""
    lora = [o.replace("sync: merged", "sync: adapter") for o in LORA]
    common = BASE + lora + ["logging.wandb_mode=disabled"]
    live = [
        {
            "config": CONFIG,
            "overrides": common + ["training.num_steps=3", f"training.checkpoint_dir={tmp_path / 'ck'}"],
            "args": ["--run-dir", str(tmp_path / "live")],
        }
    ]
    run_spec(tmp_path, live)
    r = rows(tmp_path / "live")
    assert [x["step"] for x in r] == [1, 2, 3]
    for x in r:  # the server serves base + adapter: the trainer-vs-rollout mismatch stays small
        assert math.isfinite(x["loss/pg_loss"]) and math.isfinite(x["mismatch/kl"]) and x["mismatch/kl"] < 0.1
    assert all(x.get("sync/adapter") == 1.0 for x in r[1:]), [x.get("sync/adapter") for x in r]
