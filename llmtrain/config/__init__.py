"""The config tree (schema.py: Config, the sections every recipe shares), how a run's YAML
and overrides load into it (load.py), and the checks its sections make (validate.py). A
method's own section and tree live in its wing (preference/config.py, rl/config.py). The
names most modules import are here."""

from .load import load_config, to_yaml
from .schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DataSource,
    EvalConfig,
    ExportConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DataSource",
    "EvalConfig",
    "ExportConfig",
    "LogConfig",
    "LoraConfig",
    "ModelConfig",
    "TrainConfig",
    "load_config",
    "to_yaml",
]
