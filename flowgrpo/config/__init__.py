"""The typed training configuration: YAML is only data, this schema is the contract.

``load_config(path, overrides)`` reads a YAML file, applies dotted ``key=value`` overrides, validates every field,
derives the batch sizes, and raises :class:`ConfigError` with the offending key, what is allowed, and the closest
valid key for a typo. The sections are in :mod:`.schema`, the reading in :mod:`.loading`, the ``--help`` rows in
:mod:`.help`; the settings base (:class:`~flowgrpo.strategies.settings.Section`) in :mod:`flowgrpo.strategies.settings`.
"""

from flowgrpo.config.help import describe_fields
from flowgrpo.config.loading import (
    ALIASES,
    MOVED_KEYS,
    MOVES,
    RENAMED_SECTIONS,
    ConfigError,
    build_config,
    load_config,
    parse_override,
    read_yaml,
)
from flowgrpo.config.schema import (
    SEED_MAX,
    AdvantageConfig,
    CompileConfig,
    Config,
    DataConfig,
    EvalSamplingConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    RewardSpec,
    SamplingConfig,
    TrainConfig,
)
from flowgrpo.strategies.settings import Section, flat_dict, save_config

__all__ = ["describe_fields", "ALIASES", "MOVED_KEYS", "MOVES", "RENAMED_SECTIONS", "ConfigError", "build_config",
           "load_config", "parse_override", "read_yaml", "SEED_MAX", "AdvantageConfig", "CompileConfig", "Config",
           "DataConfig", "EvalSamplingConfig", "LoggingConfig", "ModelConfig", "ParallelConfig", "RewardSpec",
           "SamplingConfig", "TrainConfig", "Section", "flat_dict", "save_config"]
