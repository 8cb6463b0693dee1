"""``scripts/mutate.py``, the scoring side of ``make mutate``: the score's denominator leaves out the
equivalent mutants docs/correction.md lists, and the survivors' report groups them by function."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mutate():
    spec = importlib.util.spec_from_file_location("mutate_script", ROOT / "scripts" / "mutate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_score_leaves_out_listed_equivalents_and_counts_timeouts_as_killed() -> None:
    m = _mutate()
    statuses = {"a__mutmut_1": "killed", "a__mutmut_2": "timeout", "a__mutmut_3": "survived"}
    statuses |= {"a__mutmut_4": "survived", "a__mutmut_5": "skipped", "a__mutmut_6": "suspicious"}
    value, survivors, stale = m.score(statuses, {"a__mutmut_4": "why", "gone__mutmut_1": "why"})
    assert value == 2 / 4 and survivors == ["a__mutmut_3", "a__mutmut_6"] and stale == ["gone__mutmut_1"]
    listed = m.equivalent_mutants()
    assert listed and all(reason for reason in listed.values())  # every listed one says why


def test_a_mutant_name_names_its_function() -> None:
    m = _mutate()
    assert (
        m.function_of("megatron_acrl.algo.losses.x_aggregate__mutmut_3")
        == "megatron_acrl.algo.losses.aggregate"
    )
    name = "megatron_acrl.correction.mismatch.xǁMismatchTensorsǁ_token_rows__mutmut_5"
    assert m.function_of(name) == "megatron_acrl.correction.mismatch.MismatchTensors._token_rows"
    assert (
        m.function_of("megatron_acrl.algo.advantages.x__gae__mutmut_2")
        == "megatron_acrl.algo.advantages._gae"
    )
