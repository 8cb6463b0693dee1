"""The RL algorithm, its policy loss, and the training-inference mismatch correction.

:data:`ALGORITHMS` is the algorithm table: each ``algorithm.name`` carries its advantage estimator,
whether it needs a critic, and the algorithm-section values it implies. The loader
(:mod:`megatron_acrl.config.loader`) fills those values into every field the user leaves unset;
an explicit value (YAML or override) wins, and ``--explain`` names the fields the name set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from megatron_acrl.config._base import _check, _Section
from megatron_acrl.config.rollout import RolloutConfig

AlgorithmName = Literal["grpo", "dr_grpo", "dapo", "ppo"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Estimator = Literal["group", "gae"]


@dataclass(frozen=True)
class FromRollout:
    """A default that depends on the run's rollout section: ``rule(rollout)``, described by ``says``
    (what ``--explain`` prints after the name)."""

    rule: Callable[[RolloutConfig], Any]
    says: str


@dataclass(frozen=True)
class Algorithm:
    """One entry of :data:`ALGORITHMS`."""

    estimator: Estimator
    """``group``: group-relative sequence advantages ``r - mean_group`` (``/ std_group`` with
    ``grpo_norm_std``), ``algo.advantages.grpo_advantages``; ``gae``: GAE over a critic's values,
    ``algo.advantages.ppo_advantages``."""

    defaults: Mapping[str, Any]
    """Algorithm-section fields the name sets where the user does not (a plain value or a
    :class:`FromRollout`)."""

    requires: Mapping[str, Any]
    """Fields that define the name: set like ``defaults``, but an explicit other value is refused."""

    summary: str
    """One line for the docs and ``--explain``."""

    @property
    def needs_critic(self) -> bool:
        """Whether the run trains a value model next to the policy (``estimator == "gae"``)."""
        return self.estimator == "gae"


ALGORITHMS: Mapping[str, Algorithm] = MappingProxyType(
    {
        # GRPO's values are the fields' own defaults: a grpo config is the dataclass as written.
        "grpo": Algorithm("group", MappingProxyType({}), MappingProxyType({}), "group-relative advantages"),
        # Dr. GRPO (Liu et al. 2025): no std normalisation, a constant-length token sum per sequence
        # (verl norm_adv_by_std_in_grpo=False, loss_agg_mode=seq-mean-token-sum-norm).
        "dr_grpo": Algorithm(
            "group",
            MappingProxyType({"loss_agg": "seq-mean-token-sum-norm"}),
            MappingProxyType({"grpo_norm_std": False}),
            "GRPO without the std division, a constant-length token sum",
        ),
        # DAPO (Yu et al. 2025) and verl's recipe: clip_ratio_high 0.28, loss_agg_mode token-mean,
        # filter_groups (dynamic sampling), overlong buffer 4096 of 20480 response tokens (1/5)
        # with penalty factor 1.0.
        "dapo": Algorithm(
            "group",
            MappingProxyType(
                {
                    "clip_high": 0.28,
                    "loss_agg": "token-mean",
                    "dynamic_sampling": True,
                    "overlong_buffer_len": FromRollout(
                        lambda r: max(1, r.max_new_tokens // 5), "rollout.max_new_tokens // 5"
                    ),
                    "overlong_penalty": 1.0,
                }
            ),
            MappingProxyType({}),
            "GRPO with clip-higher, token-mean, dynamic sampling and overlong shaping",
        ),
        # PPO: the fields' own defaults; the name adds the critic.
        "ppo": Algorithm("gae", MappingProxyType({}), MappingProxyType({}), "a critic and GAE"),
    }
)
"""``algorithm.name`` -> its :class:`Algorithm` (the keys are exactly :data:`AlgorithmName`)."""


@dataclass(frozen=True)
class AlgorithmConfig(_Section):
    name: AlgorithmName = "grpo"
    """The algorithm (its entry in ALGORITHMS): grpo (the defaults below); dr_grpo (grpo_norm_std
    false, required; loss_agg seq-mean-token-sum-norm); dapo (clip_high 0.28, loss_agg token-mean,
    dynamic_sampling true, overlong_buffer_len rollout.max_new_tokens // 5, overlong_penalty 1.0);
    ppo (a critic and GAE). The name's values fill every algorithm field the config leaves unset; a
    value set in the YAML or an override wins (`--explain CONFIG` marks the ones the name set)."""

    clip_low: float = 0.2
    """PPO ratio clip below 1 (epsilon_low)."""

    clip_high: float = 0.2
    """PPO ratio clip above 1 (epsilon_high; clip-higher: name dapo sets 0.28)."""

    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss for negative advantages; None disables."""

    loss_agg: LossAgg = "seq-mean-token-mean"
    """Loss aggregation: token-mean (name dapo sets it), seq-mean-token-mean (GRPO),
    seq-mean-token-sum-norm (name dr_grpo sets it)."""

    loss_norm_len: int | None = None
    """Constant length for seq-mean-token-sum-norm; None uses rollout.max_new_tokens."""

    grpo_norm_std: bool = True
    """Divide group-centred rewards by the group std (name dr_grpo sets false and refuses true)."""

    kl_coef: float = 0.0
    """Coefficient of the KL-to-reference penalty in the loss; 0 disables the reference model."""

    kl_type: Literal["k1", "k3"] = "k3"
    """KL estimator for the reference penalty."""

    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""

    gae_gamma: float = 1.0
    """PPO discount."""

    gae_lambda: float = 0.95
    """PPO GAE lambda."""

    value_clip: float = 0.2
    """Clip range of the PPO value loss."""

    value_coef: float = 0.5
    """Weight of the value loss."""

    ppo_epochs: int = 1
    """Passes over each rollout batch."""

    num_minibatches: int = 1
    """Optimizer steps per pass over a rollout batch."""

    dynamic_sampling: bool = False
    """DAPO (name dapo sets it): drop groups whose rewards are all equal and refill with new prompts."""

    max_refill_rounds: int = 3
    """DAPO: extra generation rounds to refill a batch after dynamic sampling."""

    overlong_buffer_len: int = 0
    """DAPO overlong shaping: length of the soft-penalty buffer before max_new_tokens; 0 disables
    (name dapo sets max_new_tokens // 5, at least 1)."""

    overlong_penalty: float = 1.0
    """DAPO overlong shaping: penalty reached at max_new_tokens (name dapo sets 1.0, DAPO's factor)."""

    def validate(self) -> list[tuple[str, str]]:
        e: list[tuple[str, str]] = []
        _check(e, 0 <= self.clip_low < 1, "clip_low", f"must be in [0, 1), got {self.clip_low}")
        _check(e, self.clip_high >= 0, "clip_high", f"must be >= 0, got {self.clip_high}")
        _check(
            e,
            self.clip_low <= self.clip_high,
            "clip_low",
            f"clip_low={self.clip_low} must not exceed clip_high={self.clip_high} "
            "(clip-higher raises clip_high)",
        )
        _check(
            e,
            self.dual_clip is None or self.dual_clip > 1,
            "dual_clip",
            f"must be > 1 or null, got {self.dual_clip}",
        )
        _check(
            e, self.loss_norm_len is None or self.loss_norm_len >= 1, "loss_norm_len", "must be >= 1 or null"
        )
        _check(e, self.kl_coef >= 0, "kl_coef", "must be >= 0")
        _check(e, 0 <= self.gae_gamma <= 1, "gae_gamma", "must be in [0, 1]")
        _check(e, 0 <= self.gae_lambda <= 1, "gae_lambda", "must be in [0, 1]")
        _check(e, self.value_clip > 0, "value_clip", "must be > 0")
        _check(e, self.ppo_epochs >= 1, "ppo_epochs", "must be >= 1")
        _check(e, self.num_minibatches >= 1, "num_minibatches", "must be >= 1")
        _check(e, self.max_refill_rounds >= 0, "max_refill_rounds", "must be >= 0")
        _check(e, self.overlong_buffer_len >= 0, "overlong_buffer_len", "must be >= 0 (0 disables)")
        _check(e, self.overlong_penalty >= 0, "overlong_penalty", "must be >= 0")
        return e + self._required_errors()

    @property
    def spec(self) -> Algorithm:
        """This name's entry of :data:`ALGORITHMS` (its estimator, whether it needs a critic)."""
        return ALGORITHMS[self.name]

    def _required_errors(self) -> list[tuple[str, str]]:
        """The fields that define the name (``Algorithm.requires``) hold its value."""
        e: list[tuple[str, str]] = []
        spec = ALGORITHMS.get(self.name)  # None only for a name the loader refuses before this
        for key, want in (spec.requires if spec else {}).items():
            got = getattr(self, key)
            _check(
                e,
                got == want,
                key,
                f"algorithm.name={self.name} requires {key}={_yaml_scalar(want)}, got {_yaml_scalar(got)}: "
                f"leave {key} unset (the name sets it) or choose another algorithm.name",
            )
        return e


def _yaml_scalar(v: Any) -> str:
    """``v`` as a YAML user writes it (false, null, 0.2)."""
    if v is None:
        return "null"
    return str(v).lower() if isinstance(v, bool) else str(v)


CorrectionMethod = Literal["none", "tis", "seq_tis", "seq_mis", "geo_mis", "icepop", "acrl"]
CorrectionKernel = Literal["auto", "torch", "fused_cpu"]
CorrectionLevel = Literal["sequence", "segment"]
SEQUENCE_LEVEL_METHODS = ("seq_tis", "seq_mis", "geo_mis")
"""The methods whose ratio is taken over a unit of tokens (``correction.level``: a sequence or a turn)."""


@dataclass(frozen=True)
class CorrectionConfig(_Section):
    method: CorrectionMethod = "acrl"
    """Training-inference mismatch correction: none, tis, seq_tis, seq_mis, geo_mis, icepop or acrl
    (an async run that leaves it unset gets tis, with step control: the lag sweep's pick)."""

    tis_low: float = 0.0
    """tis: lower clamp of the token weight rho = pi_old / mu."""

    tis_high: float = 2.0
    """tis: upper clamp of the token weight (slime --tis-clip, verl rollout_is_threshold)."""

    seq_low: float = 0.5
    """seq_tis / seq_mis: lower bound of the sequence ratio prod rho."""

    seq_high: float = 2.0
    """seq_tis / seq_mis: upper bound of the sequence ratio prod rho."""

    geo_low: float = 0.999
    """geo_mis: lower bound of the geometric-mean ratio exp(mean log rho)."""

    geo_high: float = 1.001
    """geo_mis: upper bound of the geometric-mean ratio."""

    level: CorrectionLevel = "sequence"
    """The unit of the sequence-level corrections (seq_tis, seq_mis, geo_mis, the masks and the
    veto): sequence, the whole response; segment, each agent turn (the generated tokens of one
    turn, from the batch's turn_ids; ROLL's segment weight type), so one bad turn of a long
    trajectory drops or clips that turn only. A single-turn sample is one segment (the same as
    sequence). The fractions are then token fractions named seg_*_frac."""

    icepop_low: float = 0.5
    """icepop: tokens with rho below this get weight 0."""

    icepop_high: float = 5.0
    """icepop: tokens with rho above this get weight 0."""

    veto_threshold: float | None = None
    """Drop a whole sequence if any token has rho below this (e.g. 1e-4); None disables."""

    batch_normalize: bool = False
    """Rescale the weights so their mean over valid tokens is 1."""

    gamma: float = 0.65
    """acrl: control strength; alpha = gamma * sign(A) * (1 - Y/X). 0 reproduces the uncorrected loss."""

    distance: Literal["prob_abs", "logprob_abs", "k3"] = "prob_abs"
    """acrl: per-token distance averaged into the sequence-level discrepancy (paper: prob_abs)."""

    reference: Literal["static", "ema"] = "static"
    """acrl: X fixed after the first reference batches (paper) or an exponential moving average."""

    reference_batches: int = 1
    """acrl: rollout batches averaged into the static reference X."""

    reference_lag: int | None = None
    """acrl: the smallest sampling lag (trainer version minus the oldest weight version among a
    batch's trained tokens) a batch needs to be measured into the reference X; earlier batches get
    alpha = 0 (``acrl/reference_deferred``). null: the run's own lag, ``rollout.weight_lag_steps``
    plus 1 in async mode: a lagged or async run's first batches are sampled closer to the trainer's
    weights than every later one, so an X measured there makes every later Y/X large (async K = 1 on
    the demo: Y/X 6-50, |alpha| 5-14). 0: every batch (the paper's law as written)."""

    ema_decay: float = 0.9
    """acrl: X_t = decay * X_{t-1} + (1 - decay) * Y_t when reference is ema."""

    per_sequence_y: bool = False
    """acrl: use each sequence's own discrepancy Y_i instead of the batch Y."""

    alpha_max: float | None = None
    """acrl: bound |alpha| <= alpha_max; None leaves it unbounded (paper)."""

    alpha_min: float | None = None
    """acrl: lower bound of alpha (alpha in [alpha_min, alpha_max]; an async ACRL run that leaves it
    unset gets 0, as the lag sweep found sign-safe ACRL ahead of the paper's law on 6/6 seeds at lag
    8); None keeps the paper's law
    (the lower bound is -alpha_max, or none). 0 is sign-safe ACRL: the weight interpolates between no
    correction (alpha = 0) and importance weighting (alpha = 1) and never inverts it: under staleness
    (Y > X for the whole run) the paper's alpha < 0 on positive-advantage tokens pulls the update
    back toward an older, worse sampler (issue #34). Keep None for precision-only runs (the paper's
    setting), where mu is pi plus noise and the inverse branch is its intent."""

    weight_low: float | None = None
    """acrl: lower clamp of the weights; None leaves them unclamped (paper)."""

    weight_high: float | None = None
    """acrl: upper clamp of the weights; None leaves them unclamped (paper)."""

    masks: tuple[Literal["seq_mis", "geo_mis"], ...] = ()
    """Extra sequence masks composed with the method's weights (e.g. [seq_mis] with acrl); the
    bands are seq_low/seq_high and geo_low/geo_high. The veto composes via veto_threshold."""

    eps: float = 1e-8
    """acrl: floor of X in Y/X so a perfectly matched reference does not divide by zero."""

    reference_min: float | None = None
    """acrl: the smallest Y a reference can be measured from, and the floor of X. Batches whose Y is
    below it are not measured into X (alpha = 0, the plain loss, until one is: ``acrl/
    reference_deferred``), so a first batch without mismatch (bf16 rollout, an exact first step)
    cannot make X = 0 and every later Y/X huge. null: the distance's default, 10-100x the float32
    resolution of the log-probs and below any real mismatch (prob_abs 1e-5, logprob_abs 1e-5, k3
    1e-10); 0: the paper's law as written (X may be 0; Y/X is then bounded by eps only)."""

    warn_weight: float = 100.0
    """acrl: log a warning when a step's weights saturate (``acrl/saturated_frac`` > 0: a weight cut
    at e^+-20) or leave [1 / warn_weight, warn_weight] (``correction/weight_max`` / ``weight_min``)."""

    remeasure_reference_on_resume: bool = False
    """acrl: on resume, discard the checkpoint's reference X and measure a new one (needed to resume
    with another ``distance`` or ``reference`` mode; without it such a resume is refused)."""

    step_control: Literal["none", "drift_budget"] = "none"
    """Scale each RL step's learning rate by the drift between trainer and sampler (an async run
    that leaves it unset gets drift_budget: the lag sweep's pick at every lag); none leaves the
    rate alone; drift_budget uses s = clip(sqrt(B / D), step_scale_min, 1) for all the step's
    optimizer steps, D the batch's token-mean k3 mismatch, B = max(step_kappa * D_ref,
    step_budget_min), D_ref the k3 of the first lag-0 batch (in async, of its lag-0 tokens). Without
    lag D stays near D_ref and s = 1. It composes with every correction.method: a per-token weight
    re-aims a step but under grad-clip and Adam hardly shortens it (issue #34)."""

    step_kappa: float = 1.5
    """drift_budget: the budget as a multiple of the lag-0 reference drift D_ref (1.5: the lag
    sweep's second pilot; with 4 the controller hardly bound on stress FP8, whose own k3 is D_ref)."""

    step_budget_min: float = 0.05
    """drift_budget: the floor of the budget B (k3, nats): a bf16 run's lag-0 drift (~1e-4) would
    otherwise set a budget every lagged batch exceeds by orders of magnitude (with 1e-3 the scale sat
    at its floor on 78-85% of a BF16 + lag 8 run's steps; 0.05: the lag sweep's second pilot)."""

    step_scale_min: float = 0.1
    """drift_budget: the smallest learning-rate scale; the step is never stopped outright."""

    kernel: CorrectionKernel = "auto"
    """Who computes the correction, chosen once when the trainer starts: fused_cpu is one C pass
    (correction/_fused_cpu.c, built on first use; CPU trainers only), torch the PyTorch path (the
    reference, and the GPU path), auto fused_cpu on a CPU trainer when the C library builds, else
    torch. fused_cpu is refused at start-up if the library does not build or the trainer is on a GPU."""

    def validate(self) -> list[tuple[str, str]]:
        e: list[tuple[str, str]] = []
        for lo, hi in (
            ("tis_low", "tis_high"),
            ("seq_low", "seq_high"),
            ("geo_low", "geo_high"),
            ("icepop_low", "icepop_high"),
        ):
            a, b = getattr(self, lo), getattr(self, hi)
            _check(e, a >= 0, lo, f"must be >= 0, got {a}")
            _check(e, a < b, lo, f"{lo}={a} must be smaller than {hi}={b}")
        _check(
            e,
            self.veto_threshold is None or 0 < self.veto_threshold < 1,
            "veto_threshold",
            "must be in (0, 1) or null",
        )
        _check(e, len(set(self.masks)) == len(self.masks), "masks", "lists a mask twice")
        _check(
            e,
            self.level == "sequence" or self._has_sequence_unit(),
            "level",
            f"level=segment changes only {', '.join(SEQUENCE_LEVEL_METHODS)}, masks and veto_threshold, "
            f"and method={self.method} uses none of them: set level=sequence, or choose one of those",
        )
        return e + self._acrl_errors()

    def _has_sequence_unit(self) -> bool:
        """Whether anything here takes a ratio over a unit of tokens (what ``level`` chooses)."""
        return self.method in SEQUENCE_LEVEL_METHODS or bool(self.masks) or self.veto_threshold is not None

    def _acrl_errors(self) -> list[tuple[str, str]]:
        """The ACRL controller's and weights' fields."""
        e: list[tuple[str, str]] = []
        _check(e, self.gamma >= 0, "gamma", f"must be >= 0 (0 disables the correction), got {self.gamma}")
        _check(e, self.reference_batches >= 1, "reference_batches", "must be >= 1")
        lag_ok = self.reference_lag is None or self.reference_lag >= 0
        _check(e, lag_ok, "reference_lag", "must be >= 0 or null")
        _check(e, 0 <= self.ema_decay < 1, "ema_decay", f"must be in [0, 1), got {self.ema_decay}")
        _check(e, self.alpha_max is None or self.alpha_max >= 0, "alpha_max", "must be >= 0 or null")
        if self.alpha_min is not None:
            _check(e, math.isfinite(self.alpha_min), "alpha_min", "must be finite or null")
            hi = self.alpha_max
            _check(e, hi is None or self.alpha_min <= hi, "alpha_min", f"must be <= alpha_max={hi}")
        _check(e, self.weight_low is None or self.weight_low >= 0, "weight_low", "must be >= 0 or null")
        if self.weight_low is not None and self.weight_high is not None:
            _check(e, self.weight_low < self.weight_high, "weight_low", "must be smaller than weight_high")
        _check(e, self.eps > 0, "eps", "must be > 0")
        _check(
            e,
            self.reference_min is None or self.reference_min >= 0,
            "reference_min",
            f"must be >= 0 (0: the paper's law) or null (the distance's default); got {self.reference_min}",
        )
        _check(e, self.warn_weight > 1, "warn_weight", f"must be > 1, got {self.warn_weight}")
        return e + self._step_control_errors()

    def _step_control_errors(self) -> list[tuple[str, str]]:
        """The drift-budget step controller's knobs."""
        e: list[tuple[str, str]] = []
        _check(e, self.step_kappa > 0, "step_kappa", f"must be > 0, got {self.step_kappa}")
        _check(e, self.step_budget_min > 0, "step_budget_min", f"must be > 0, got {self.step_budget_min}")
        ok = 0 < self.step_scale_min <= 1
        _check(e, ok, "step_scale_min", f"must be in (0, 1], got {self.step_scale_min}")
        return e
