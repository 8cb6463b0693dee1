"""MoE rollout routing replay (R3) against a real SGLang CPU server.

One server (``--enable-return-routed-experts``, with the CPU allocator hook) serves a tiny Qwen3-MoE;
a rollout batch with its routed experts is recorded (``RolloutBatch.save``, as ``--save-rollouts``)
and scored by the Megatron trainer in one 4-rank launch, under EP=2 and under EP=2 + TP=2 + SP,
with replay off and with R3 (``model.moe_routing_replay=rollout``):

* off: some token-layer routing decisions disagree with SGLang's and the flipped tokens carry most
  of the total log-prob gap (``routing/gap_share_flipped`` > 0.5; their mean |pi_old - mu| is many
  times the agreeing tokens', the largest gap is on a flipped token);
* rollout: pi_old and SGLang's log-probs agree on every token within the dense-model tolerance, the
  routing the routers used disagrees with SGLang's nowhere, layouts agree, and the training pass
  replays the same routing (its first forward equals pi_old);
* a replay with the layer order or the token order wrong breaks that agreement (caught, not accepted).

The trainer computes in fp32 on the served bf16 weights, the reference closest to exact (as in the
other bridge tests); the tolerance is the bridge's dense-model one. The model is the research
recipe's tiny MoE (2 layers, 4 experts, top-2) with per-group init ranges (``INIT``, see
``build_checkpoint``), one model for both modes: small router rows plus a large shared router
component (every expert's logit shifted alike: exact routing unchanged, but SGLang's bf16 router
logits resolve near-ties differently from the fp32 trainer -- real bf16 routing flips, many of
them), large experts (the MoE output dominates the residual, so a flip moves the log-prob a lot),
the rest small and a small LM head (the bf16 gap of agreeing tokens stays far below the tolerance).
A single global init scale cannot do both: 0.04 gives flips worth only ~7% of the total gap, 0.2
gives flips that dominate but a replayed gap of ~0.1.

Measured in three runs (32 samples, 2016 token-layer decisions; SGLang's samples vary from run to
run; EP=2 and EP=2+TP=2+SP give identical numbers): off -- 6.0-8.0% of decisions disagree (layer 0
3.6-5.9%, layer 1 8.3-10.2% with cascaded flips), 9.5-13% of response tokens flipped, mean
|pi_old - mu| 0.053-0.059 on flipped tokens vs 0.0006 on agreeing ones (~90x), flipped tokens carry
91-93% of the total gap, max 0.16-0.24; rollout -- max 0.0039-0.0043 on every token (0.0006-0.0007
mean on the formerly flipped tokens).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from dist_launch import launch

from megatron_acrl.batch.rollout_batch import build_batch
from megatron_acrl.config import load_config
from megatron_acrl.warmstart.tiny_model import build_checkpoint
from sglang_bridge.client import SamplingParams, SGLangClient
from sglang_bridge.server import ServerSpec, SGLangServer

pytestmark = pytest.mark.timeout(2400)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_moe.yaml"
WORKER = ROOT / "tests" / "r3_worker.py"
DENSE_TOL = 1e-2  # trainer/transformers vs SGLang on the dense tiny model (test_sglang_server.py)
INIT = dict(  # build_checkpoint's init ranges of the test model (module docstring)
    initializer_range=0.02,
    router_init_range=0.01,
    router_shared_init_range=0.4,
    expert_init_range=0.2,
    output_init_range=0.01,
)
EP2 = dict(ep=2)
EP2_TP2_SP = dict(ep=2, tp=2, sequence_parallel=True)
CASES = [
    dict(name="ep2_off", layout=EP2, replay="off"),
    dict(name="ep2_rollout", layout=EP2, replay="rollout", train=True),
    dict(name="ep2_tp2_sp_off", layout=EP2_TP2_SP, replay="off"),
    dict(name="ep2_tp2_sp_rollout", layout=EP2_TP2_SP, replay="rollout", train=True),
    dict(name="NEGATIVE_layer_order", layout=EP2, replay="rollout", negative="layer_order"),
    dict(name="NEGATIVE_token_order", layout=EP2_TP2_SP, replay="rollout", negative="token_order"),
]


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = load_config(CONFIG).model
    return build_checkpoint(model, seed=0, **INIT, cache_dir=tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def rollout(moe_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """32 samples (16 prompts x 2) of 24 tokens with routed experts, recorded to a file."""
    tmp = tmp_path_factory.mktemp("r3")
    spec = ServerSpec(model_path=str(moe_ckpt), device="cpu", return_routed_experts=True)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 16, (16,), generator=g).tolist()
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)

    async def go(url: str) -> list:
        async with SGLangClient(url, routed_experts_topk=2) as c:
            return await c.generate(prompts, params, n=2)

    with SGLangServer(spec, tmp / "sglang.log", startup_timeout_s=600, name="sglang-moe") as srv:
        groups = asyncio.run(go(srv.url))
    samples = [s for group in groups for s in group]
    batch = build_batch(
        [s.prompt_ids for s in samples],
        [s.output_ids for s in samples],
        [s.rollout_logprobs for s in samples],
        rewards=[0.0] * len(samples),
        group_ids=[i // 2 for i in range(len(samples))],
        pad_id=0,
        routed_experts=[s.routed_experts for s in samples],
    )
    path = tmp / "step_000000.pt"
    batch.save(path)
    return path, samples


@pytest.fixture(scope="module")
def scored(rollout: tuple[Path, list], moe_ckpt: Path) -> dict:
    path, _ = rollout
    args = {"batch": str(path), "ckpt": str(moe_ckpt), "config": str(CONFIG), "cases": CASES}
    ranks = launch("sglang", 4, args, timeout=2000, worker=WORKER)
    for res in ranks[1:]:  # every rank reports the same numbers
        for name, r in res.items():
            assert torch.equal(r["old"], ranks[0][name]["old"]), name
    return ranks[0]


def _gap(rollout: tuple[Path, list], res: dict) -> torch.Tensor:
    from megatron_acrl.batch.rollout_batch import RolloutBatch

    batch = RolloutBatch.load(rollout[0])
    mask = batch.loss_mask > 0
    return (res["old"] - batch.rollout_logprobs)[mask].abs()


def test_sglang_returns_routing_of_every_position_but_the_last(rollout):
    cfg = load_config(CONFIG).model
    for s in rollout[1]:
        r = s.routed_experts
        assert r.shape == (len(s.prompt_ids) + len(s.output_ids) - 1, cfg.num_layers, cfg.moe_router_topk)
        assert r.min() >= 0 and r.max() < cfg.num_experts
        assert (r[..., 0] != r[..., 1]).all()  # a top-2 set: two distinct experts


@pytest.mark.parametrize("layout", ["ep2", "ep2_tp2_sp"])
def test_replay_off_routing_flips_carry_the_gap(rollout, scored, layout):
    m = scored[f"{layout}_off"]["routing"]
    gap = _gap(rollout, scored[f"{layout}_off"])
    print(
        layout,
        "off:",
        {k: round(v, 5) for k, v in m.items() if "/layer" not in k or "disagree_frac/" in k},
        "max",
        gap.max().item(),
    )
    assert m["routing/disagree_frac"] > 0, "no routing flips: the test cannot show what replay removes"
    assert m["routing/disagree_frac_applied"] == m["routing/disagree_frac"]  # nothing replayed
    assert m["routing/logp_gap_flipped"] > 5 * m["routing/logp_gap_agree"]
    assert gap.max().item() > DENSE_TOL
    assert gap.max().item() > m["routing/logp_gap_agree_max"]  # the largest gap is on a flipped token
    assert m["routing/gap_share_flipped"] > 3 * m["routing/flipped_token_frac"]
    assert m["routing/gap_share_flipped"] > 0.5  # flipped tokens carry most of the total |pi_old - mu|
    for layer in range(2):
        assert not math.isnan(m[f"routing/disagree_frac/layer_{layer}"])


@pytest.mark.parametrize("layout", ["ep2", "ep2_tp2_sp"])
def test_replay_rollout_matches_sglang_on_every_token(rollout, scored, layout):
    res = scored[f"{layout}_rollout"]
    gap = _gap(rollout, res)
    m = res["routing"]
    print(
        layout,
        "rollout:",
        {k: round(v, 5) for k, v in m.items() if "/layer" not in k or "disagree_frac/" in k},
        "max",
        gap.max().item(),
    )
    assert gap.max().item() < DENSE_TOL
    assert m["routing/disagree_frac_applied"] == 0.0  # the routers used SGLang's experts
    # The disagreement is the routers' own choice before replay: the first MoE layer's input does not
    # depend on routing, so it disagrees exactly as without replay; later layers see SGLang's routing
    # upstream (fewer cascaded flips), so the total is only close.
    off = scored[f"{layout}_off"]["routing"]
    assert m["routing/disagree_frac/layer_0"] == off["routing/disagree_frac/layer_0"] > 0
    assert m["routing/disagree_frac"] == pytest.approx(off["routing/disagree_frac"], rel=0.5)
    assert abs(res["metrics"]["loss/ppo_kl"]) < 1e-6  # the training pass replays the same routing


def test_replay_is_layout_invariant_on_real_rollouts(scored):
    a, b = scored["ep2_rollout"]["old"], scored["ep2_tp2_sp_rollout"]["old"]
    assert (a - b).abs().max().item() < 1e-4


@pytest.mark.parametrize("negative", ["layer_order", "token_order"])
def test_misaligned_replay_is_caught(rollout, scored, negative):
    gap = _gap(rollout, scored[f"NEGATIVE_{negative}"])
    assert gap.max().item() > DENSE_TOL, f"a replay with the wrong {negative} matched SGLang"


def test_recorded_rollouts_carry_experts_for_replay(rollout):
    from megatron_acrl.batch.rollout_batch import RolloutBatch

    batch = RolloutBatch.load(rollout[0])  # what --load-rollouts replays
    assert batch.routed_experts is not None and batch.routed_experts.shape[:2] == batch.tokens.shape
    first = rollout[1][0]
    n = len(first.prompt_ids) + len(first.output_ids) - 1
    assert batch.routed_experts[0, :n].tolist() == first.routed_experts.tolist()
    assert (batch.routed_experts[0, n:] == -1).all()


def test_driver_logs_routing_metrics_on_replayed_rollouts(rollout, moe_ckpt, tmp_path):
    """The driver (one rank, --load-rollouts of the recorded batch) with R3 and with R2: the routing
    metrics reach the run's metrics log next to the mismatch metrics."""
    from test_e2e import run_spec

    from megatron_acrl.logging import read_jsonl_metrics

    common = [
        f"model.hf_path={moe_ckpt}",
        "training.num_steps=1",
        "training.micro_batch_size=8",
        "rollout.prompts_per_step=16",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=24",
        "rollout.quantization=none",
        "model.params_dtype=fp32",
        "logging.wandb_mode=disabled",
    ]
    spec = [
        {
            "config": str(CONFIG),
            "overrides": [*common, f"model.moe_routing_replay={mode}"],
            "args": ["--load-rollouts", str(rollout[0].parent), "--run-dir", str(tmp_path / mode)],
        }
        for mode in ("rollout", "train")
    ]
    run_spec(tmp_path, spec)
    for mode in ("rollout", "train"):
        (row,) = read_jsonl_metrics(tmp_path / mode / "metrics.jsonl")
        assert row["routing/disagree_frac"] > 0 and "routing/disagree_frac/layer_1" in row
        assert any(k.startswith("mismatch/") for k in row)  # logged together
        if mode == "rollout":
            assert row["routing/disagree_frac_applied"] == 0.0
        else:  # R2 routes freely in the pi_old pass: what it used is its own choice
            assert row["routing/disagree_frac_applied"] == row["routing/disagree_frac"]
        assert abs(row["loss/ppo_kl"]) < 1e-6
