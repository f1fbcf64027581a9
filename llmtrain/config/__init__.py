"""The config tree (schema.py), how a run's YAML and overrides load into it (load.py), and
the checks its sections make (validate.py). The names recipes and most modules import are
here."""

from .load import load_config, to_yaml
from .schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DataSource,
    DPOConfig,
    EvalConfig,
    ExportConfig,
    GRPOConfig,
    GRPOSection,
    LogConfig,
    LoraConfig,
    ModelConfig,
    PreferenceConfig,
    RewardConfig,
    RewardSection,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "DPOConfig",
    "DataConfig",
    "DataSource",
    "EvalConfig",
    "ExportConfig",
    "GRPOConfig",
    "GRPOSection",
    "LogConfig",
    "LoraConfig",
    "ModelConfig",
    "PreferenceConfig",
    "RewardConfig",
    "RewardSection",
    "TrainConfig",
    "load_config",
    "to_yaml",
]
