"""LoRA on the Megatron trainer (issue #35): layout invariance, step 0 == base, frozen base, the PEFT
round trip, checkpoints, and the optimizer-state goal.

A single-rank fp32 run of each model (qwen2: all targets; qwen3: untied, QK-norm, KL reference;
qwen3_moe: the experts' adapters too) is the reference: it draws the base and a random non-zero
adapter (B != 0, so A's gradient is not zero either). Every layout loads both, runs forward-only
log-probs, two ACRL controller updates and one Adam step with eps >> |g| (the update is ~ minus the
gradient): the log-probs, the loss and every adapter's update must match the reference, and the base
must not move. One layout also saves a checkpoint (adapters and their optimizer state only), resumes
it exactly, and refuses it for another rank, another base and a full model.

Three launches (start-up dominates on CPU): one rank for the references (with the PEFT round trip:
``peft`` + ``transformers`` on our exported adapter dir must give the trainer's log-probs), four
ranks for the layouts, one rank for the optimizer bytes (LoRA vs full training, bf16).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_launch import launch

pytestmark = pytest.mark.timeout(2400)

WORKER = Path(__file__).with_name("lora_worker.py")
KINDS = ["qwen2", "qwen3", "moe"]
CASES = [
    dict(name="qwen2_tp2_pp2", kind="qwen2", layout=dict(tp=2, pp=2), checkpoint=True),
    dict(
        name="qwen2_tp2_sp_dp2_distopt",
        kind="qwen2",
        layout=dict(tp=2, sequence_parallel=True, distributed_optimizer=True),
    ),
    dict(name="qwen2_pp2_vpp2_dp2", kind="qwen2", layout=dict(pp=2, vpp=2)),
    dict(name="qwen3_kl_tp2_dp2", kind="qwen3", layout=dict(tp=2)),
    dict(name="moe_ep2_dp4", kind="moe", layout=dict(ep=2)),
    dict(name="moe_ep2_pp2", kind="moe", layout=dict(ep=2, pp=2), checkpoint=True),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("lora")
    ref = launch(
        "reference", 1, {"kinds": KINDS, "peft": ["qwen2", "qwen3"], "tmp": str(tmp)}, worker=WORKER
    )[0]
    ref_path = tmp / "reference.pt"
    torch.save(ref, ref_path)
    cases = [
        dict(c, checkpoint_dir=str(tmp / f"ckpt_{c['name']}")) if c.get("checkpoint") else c for c in CASES
    ]
    ranks = launch("layouts", 4, {"reference": str(ref_path), "cases": cases}, worker=WORKER)
    return ref, {c["name"]: [r[c["name"]] for r in ranks] for c in CASES}


def _update_errors(ref: dict, got: dict, start: dict) -> list[str]:
    """Adapters whose first Adam update differs from the reference's beyond fp32 rounding."""
    bad = []
    for name, after in ref["adapters_after"].items():
        delta_ref, delta = after - start[name], got["adapters_after"][name] - start[name]
        scale = delta_ref.abs().max().item()
        err = (delta - delta_ref).abs().max().item()
        ulp = torch.finfo(torch.float32).eps * after.abs().max().item()
        if err > 1e-4 * max(scale, 1e-3) + 2 * ulp:
            bad.append(f"{name}: update err {err:.2e} (|update| {scale:.2e})")
    return bad


def test_reference_step0_frozen_and_peft_round_trip(runs: tuple[dict, dict]) -> None:
    ref, _ = runs
    for kind in KINDS:
        r = ref[kind]
        assert r["step0"] == 0.0, f"{kind}: fresh adapters (B = 0) must leave the base's log-probs exact"
        f = r["frozen"]
        assert not f["trainable_not_lora"] and not f["lora_not_trainable"], (kind, f)
        assert not f["optimizer_not_lora"] and f["optimizer_count"] == f["lora_count"] > 0, (kind, f)
        assert r["base_moved"] == 0.0, f"{kind}: a step moved the frozen base"
        moved = max((r["adapters_after"][k] - v).abs().max().item() for k, v in r["adapters"].items())
        assert moved > 1e-3, f"{kind}: the adapters did not train"
    for kind in ("qwen2", "qwen3"):
        p = ref[kind]["peft"]
        assert p["adapter_effect"] > 0.1, p  # the adapters change the model: the comparison means something
        assert p["peft_err"] < 1e-4, f"{kind}: PEFT + transformers vs the trainer: {p}"
        assert p["merged_err"] < 1e-4, f"{kind}: the merged export vs the trainer: {p}"


@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_layout_matches_single_rank(runs: tuple[dict, dict], case: str) -> None:
    ref_all, results = runs
    spec = next(c for c in CASES if c["name"] == case)
    ref = ref_all[spec["kind"]]
    for rank, got in enumerate(results[case]):
        assert (got["old"] - ref["old"]).abs().max().item() < 1e-5, f"rank {rank}: log-probs"
        loss, ref_loss = got["metrics"]["loss/total"], ref["metrics"]["loss/total"]
        assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (
            f"rank {rank}: loss {loss} vs {ref_loss}"
        )
        assert not _update_errors(ref, got, ref["adapters"]), _update_errors(ref, got, ref["adapters"])[:5]
        assert got["base_moved"] == 0.0, f"rank {rank}: the frozen base moved"
        f = got["frozen"]
        assert not f["trainable_not_lora"] and not f["optimizer_not_lora"], (rank, f)
        if "ref" in ref:  # the KL reference model is the plain base
            assert (got["ref"] - ref["ref"]).abs().max().item() < 1e-5


@pytest.mark.parametrize("case", [c["name"] for c in CASES if c.get("checkpoint")])
def test_checkpoint_resume_exact_and_refusals(runs: tuple[dict, dict], case: str) -> None:
    _, results = runs
    got = results[case][0]
    m2, m2_again, after2, after2_again = got["resume"]
    assert m2["loss/total"] == m2_again["loss/total"] and m2["grad_norm"] == m2_again["grad_norm"]
    for name, t in after2.items():
        assert torch.equal(t, after2_again[name]), f"{name} differs after the resumed step"
    keys = got["ckpt_keys"]
    assert keys and all("_lora." in k for k in keys), [k for k in keys if "_lora." not in k][:5]
    assert not any("_lora" in n for n in got["merged_names"])  # the merged stream: HF names only
    refusals = got["refusals"]
    assert refusals["same"] == "loaded"
    assert "model.lora.rank" in refusals["rank"], refusals["rank"]
    assert "model.hf_path" in refusals["base"] and "fingerprint" in refusals["base"], refusals["base"]
    assert "model.lora" in refusals["full"] and "full weights" not in refusals["full"], refusals["full"]


def test_optimizer_state_bytes_lora_vs_full(tmp_path: Path) -> None:
    """Goal (issue #35): optimizer-state bytes with LoRA (rank 16, all linear layers) <= 0.05 of full
    training on the same model (4 layers, hidden 512, ffn 2048, bf16: Adam moments + fp32 main params)."""
    r = launch("optimizer_bytes", 1, {}, worker=WORKER)[0]
    ratio = r["lora"] / r["full"]
    print(
        f"optimizer state: full {r['full'] / 2**20:.1f} MiB, LoRA {r['lora'] / 2**20:.2f} MiB; "
        f"params full {r['full_params']}, LoRA model {r['lora_params']}; "
        f"lora_optimizer_state_ratio: {ratio:.4f}"
    )
    assert r["lora"] > 0
    assert ratio <= 0.05, ratio
