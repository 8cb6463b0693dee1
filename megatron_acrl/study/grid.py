"""Study grid files: a base config, common overrides, seeds and named arms, validated before any run.

A grid YAML holds the keys of :data:`GRID_KEYS`; every arm's config (base + common + the arm's own
overrides) must load, and is kept on the :class:`Grid` (seed aside). Arm names are unique across the
grids of one invocation unless the arm is the same run in each (the shared BF16 baseline).

Two kinds of grid: ``reward`` (the first study's: verdicts on the sampled reward) and ``exact``
(verdicts on the exact metric, ``training.exact_eval_interval``): an exact grid names the arm of each
role its verdicts compare (:data:`ROLES`), and may name its ``pilot`` grid (run before it, on other
seeds) and the ``choices`` made from the pilot, written down before the grid runs.

Issue #34's lag sweep adds three keys: ``arm_seeds`` (``{arm: [seeds]}``, an arm run on other seeds
than the grid's ``seeds``, e.g. 6 seeds for some cells and 3 elsewhere), ``reuse`` (another grid
file whose archived runs, ``<report dir>/<grid>.runs.json``, stand for this grid's arms of the same
name: their settings must be identical, checked here; such runs are not run again) and
``verdicts`` (the verdicts, written into the grid file before it runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_acrl.config import Config, ConfigError, load_config

GRID_KEYS = (
    "base",
    "common",
    "seeds",
    "arms",
    "ranks",
    "title",
    "notes",
    "stress",
    "shared_server",
    "kind",
    "roles",
    "pilot",
    "choices",
    "arm_seeds",
    "reuse",
    "verdicts",
)

ROLES = {
    "bf16": "BF16 rollout, no lag, no correction (the reference)",
    "bf16_lag": "BF16 rollout with the weight lag, no correction (the lag alone)",
    "none": "stress FP8 + lag, uncorrected",
    "tis": "stress FP8 + lag, token TIS",
    "acrl": "stress FP8 + lag, ACRL as in the paper",
    "acrl_ext": "stress FP8 + lag, ACRL with our extensions",
}
"""The roles an exact grid's arms can play in its verdicts (``roles: {role: arm}``)."""


@dataclass(frozen=True)
class Grid:
    """One grid file: a base config, common overrides, seeds and named arms."""

    base: str
    common: tuple[str, ...]
    seeds: tuple[int, ...]
    arms: dict[str, tuple[str, ...]]
    ranks: int = 1
    name: str = "grid"
    """File stem; prefixes the grid's figures."""
    title: str = ""
    notes: str = ""
    """Free text for the report (what the setting is)."""
    stress: bool = False
    """A stress setting: the verdict also compares ACRL with TIS and MIS."""
    shared_server: bool = True
    """One SGLang server for the whole grid (see :mod:`megatron_acrl.study`)."""
    kind: str = "reward"
    """``reward`` (verdicts on the sampled reward) or ``exact`` (on the exact metric)."""
    roles: dict[str, str] = field(default_factory=dict)
    """Exact grids: the arm of each role of :data:`ROLES`."""
    pilot: str = ""
    """Exact grids: the pilot's grid file (its numbers go into this grid's report section)."""
    choices: str = ""
    """Exact grids: what was chosen from the pilot, and why (written before the grid ran)."""
    configs: dict[str, Config] = field(default_factory=dict, compare=False, repr=False)
    """Each arm's validated config (seed aside)."""
    arm_seeds: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Arms run on other seeds than :attr:`seeds` (``seeds`` is then the union, for the shards)."""
    reuse: str = ""
    """A grid file whose archived runs stand for this grid's arms of the same name and settings."""
    verdicts: tuple[str, ...] = ()
    """The verdicts, as pre-registered in the grid file."""

    def seeds_of(self, arm: str) -> tuple[int, ...]:
        """The seeds ``arm`` runs on: its ``arm_seeds`` entry (within :attr:`seeds`), else the grid's."""
        own = self.arm_seeds.get(arm)
        return self.seeds if own is None else tuple(s for s in own if s in self.seeds)


def load_grid(path: str | Path) -> Grid:
    """Read and validate a grid file: every arm's config must load before anything runs."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    unknown = set(data) - set(GRID_KEYS)
    if unknown:
        raise ConfigError([(f"{path}", f"unknown grid keys {sorted(unknown)}; use {', '.join(GRID_KEYS)}")])
    if not data.get("arms"):
        raise ConfigError([(f"{path}", "a grid needs arms: {name: [overrides...]}")])
    if "base" not in data:
        raise ConfigError([(f"{path}", "a grid needs base: configs/<file>.yaml")])
    seeds = tuple(int(s) for s in data.get("seeds", [1]))
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError([(f"{path}.seeds", f"need distinct seeds, got {list(seeds)}")])
    configs: dict[str, Config] = {}
    arms = {str(k): tuple(str(o) for o in (v or [])) for k, v in data["arms"].items()}
    for arm, overrides in arms.items():
        try:
            configs[arm] = load_config(str(data["base"]), [*data.get("common", []), *overrides])
        except ConfigError as err:
            raise ConfigError(
                [(f"arms.{arm}.{p}" if p else f"arms.{arm}", m) for p, m in err.errors]
            ) from None
    kind = str(data.get("kind", "reward"))
    roles = {str(k): str(v) for k, v in (data.get("roles") or {}).items()}
    _check_exact(path, kind, roles, arms, configs, str(data.get("pilot", "")))
    arm_seeds = _arm_seeds(path, data.get("arm_seeds") or {}, arms)
    seeds = tuple(dict.fromkeys([*seeds, *(s for ss in arm_seeds.values() for s in ss)]))
    reuse = str(data.get("reuse", ""))
    if reuse:
        _check_reuse(path, reuse, str(data["base"]), tuple(str(o) for o in data.get("common", [])), arms)
    return Grid(
        base=str(data["base"]),
        common=tuple(str(o) for o in data.get("common", [])),
        seeds=seeds,
        arms=arms,
        ranks=int(data.get("ranks", 1)),
        name=Path(path).stem,
        title=str(data.get("title", Path(path).stem)),
        notes=str(data.get("notes", "")).strip(),
        stress=bool(data.get("stress", False)),
        shared_server=bool(data.get("shared_server", True)),
        kind=kind,
        roles=roles,
        pilot=str(data.get("pilot", "")),
        choices=str(data.get("choices", "")).strip(),
        configs=configs,
        arm_seeds=arm_seeds,
        reuse=reuse,
        verdicts=tuple(str(v).strip() for v in data.get("verdicts") or ()),
    )


def _arm_seeds(path: str | Path, raw: dict, arms: dict) -> dict[str, tuple[int, ...]]:
    """``arm_seeds``: known arms, distinct seeds."""
    out = {str(k): tuple(int(s) for s in v) for k, v in raw.items()}
    for arm, ss in out.items():
        if arm not in arms:
            raise ConfigError([(f"{path}.arm_seeds.{arm}", "names no arm of the grid")])
        if not ss or len(set(ss)) != len(ss):
            raise ConfigError([(f"{path}.arm_seeds.{arm}", f"need distinct seeds, got {list(ss)}")])
    return out


def _check_reuse(path: str | Path, reuse: str, base: str, common: tuple[str, ...], arms: dict) -> None:
    """The reused grid exists, and every arm both grids name is the same run in both."""
    if not Path(reuse).is_file():
        raise ConfigError([(f"{path}.reuse", f"no such grid file: {reuse}")])
    other = yaml.safe_load(Path(reuse).read_text()) or {}
    theirs = {str(k): tuple(str(o) for o in (v or [])) for k, v in (other.get("arms") or {}).items()}
    same_base = str(other.get("base")) == base and tuple(str(o) for o in other.get("common", [])) == common
    for arm in set(arms) & set(theirs):
        if not same_base or arms[arm] != theirs[arm]:
            raise ConfigError(
                [
                    (
                        f"{path}.arms.{arm}",
                        f"reuses {reuse}'s runs of {arm!r} but its settings differ: rename it",
                    )
                ]
            )


def _check_exact(
    path: str | Path, kind: str, roles: dict[str, str], arms: dict, configs: dict[str, Config], pilot: str
) -> None:
    """An exact grid: known roles naming its arms, every arm logging the exact metric, a pilot file
    that exists; a reward grid has none of these keys."""
    if kind not in ("reward", "exact"):
        raise ConfigError([(f"{path}.kind", f"must be reward or exact, got {kind!r}")])
    if kind == "reward":
        if roles or pilot:
            raise ConfigError([(f"{path}.roles", "roles and pilot belong to kind: exact grids")])
        return
    errors = []
    for role, arm in roles.items():
        if role not in ROLES:
            errors.append((f"{path}.roles.{role}", f"unknown role; use {', '.join(ROLES)}"))
        elif arm not in arms:
            errors.append((f"{path}.roles.{role}", f"names no arm of the grid: {arm!r}"))
    if "bf16" not in roles:
        errors.append((f"{path}.roles", "an exact grid needs the bf16 role (the reference arm)"))
    for arm, cfg in configs.items():
        if not cfg.training.exact_eval_interval:
            errors.append(
                (
                    f"arms.{arm}.training.exact_eval_interval",
                    "must be > 0 in an exact grid (its verdicts use it)",
                )
            )
    if pilot and not Path(pilot).is_file():
        errors.append((f"{path}.pilot", f"no such grid file: {pilot}"))
    if errors:
        raise ConfigError(errors)


def reused_arms(grid: Grid) -> tuple[str, ...]:
    """The arms of ``grid`` that its ``reuse`` grid also has (same settings, checked on load)."""
    if not grid.reuse:
        return ()
    other = yaml.safe_load(Path(grid.reuse).read_text()) or {}
    return tuple(a for a in grid.arms if a in (other.get("arms") or {}))


def conflicting_arm(grids: Sequence[Grid]) -> str | None:
    """An arm name that several grids use with different settings (None when there is none): a
    shared arm (e.g. the BF16 baseline) must be the same run in every grid, since it runs once."""
    names = [a for g in grids for a in g.arms]
    for a in {a for a in names if names.count(a) > 1}:
        specs = {(g.base, g.common, g.arms[a]) for g in grids if a in g.arms}
        if len(specs) > 1:
            return a
    return None


def grid_groups(grids: Sequence[Grid]) -> list[list[Grid]]:
    """Grids that share an arm name (the shared BF16 baseline run) must run one after the other:
    connected components of the shares-an-arm relation, in file order."""
    groups: list[list[Grid]] = []
    for g in grids:
        joined = [grp for grp in groups if any(set(g.arms) & set(h.arms) for h in grp)]
        merged = [h for grp in joined for h in grp] + [g]
        groups = [grp for grp in groups if grp not in joined] + [merged]
    return groups
