"""Typed, frozen configuration: the single source of truth for a run.

Every field carries an attribute docstring (Megatron-Core style) that ``--explain`` prints.
Configs are loaded from YAML files in ``configs/`` with dotted command-line overrides::

    cfg = load_config("configs/tiny_dense.yaml", ["correction.gamma=0.8", "parallel.tp=2"])

Validation happens up front, before anything starts: an unknown key (with the nearest valid one
suggested), a wrong type and an out-of-range value all raise :class:`ConfigError`, whose message
names every offending key path and how to fix it.

    python -m megatron_acrl.config --explain            # every field, its default and its doc
    python -m megatron_acrl.config configs/X.yaml k=v    # validate and print the resolved config
    python -m megatron_acrl.config configs/X.yaml --explain  # its values; marks what algorithm.name set

``algorithm.name`` applies its algorithm's values (:data:`ALGORITHMS`) to every algorithm field the
YAML and the overrides leave unset.
"""

from megatron_acrl.config._base import ConfigError
from megatron_acrl.config.agent import BUILTIN_ENVS, AgentConfig, resolve_import_path
from megatron_acrl.config.algorithm import (
    ALGORITHMS,
    Algorithm,
    AlgorithmConfig,
    AlgorithmName,
    CorrectionConfig,
    CorrectionKernel,
    CorrectionMethod,
    LossAgg,
)
from megatron_acrl.config.loader import (
    config_from_dict,
    config_to_dict,
    explain,
    load_config,
    load_config_with_sources,
    parse_overrides,
)
from megatron_acrl.config.model import ModelConfig, ModelFamily, ParallelConfig
from megatron_acrl.config.rollout import Quantization, RolloutConfig, RouterPolicy
from megatron_acrl.config.run import Config
from megatron_acrl.config.training import LoggingConfig, TaskConfig, TrainingConfig

__all__ = [
    "ALGORITHMS",
    "BUILTIN_ENVS",
    "AgentConfig",
    "Algorithm",
    "AlgorithmConfig",
    "AlgorithmName",
    "Config",
    "ConfigError",
    "CorrectionConfig",
    "CorrectionKernel",
    "CorrectionMethod",
    "LoggingConfig",
    "LossAgg",
    "ModelConfig",
    "ModelFamily",
    "ParallelConfig",
    "Quantization",
    "RolloutConfig",
    "RouterPolicy",
    "TaskConfig",
    "TrainingConfig",
    "config_from_dict",
    "config_to_dict",
    "explain",
    "load_config",
    "load_config_with_sources",
    "parse_overrides",
    "resolve_import_path",
]
