"""The real presets' architecture configs (JSON, one folder per model); the logic that reads,
checks and writes them is :mod:`speechbrain_fl.models.preset_configs`, re-exported here.
"""

from speechbrain_fl.models.preset_configs import (
    CONFIG_ROOT,
    EXPECTED,
    HUB_KEYS,
    LAYER_KEYS,
    PresetConfigError,
    check_preset,
    config_folder,
    feature_extractor,
    hub_ids,
    load_json,
    model_config,
    offline_preset,
    standin_tokenizer,
    write_checkpoint,
)

__all__ = [
    "CONFIG_ROOT",
    "EXPECTED",
    "HUB_KEYS",
    "LAYER_KEYS",
    "PresetConfigError",
    "check_preset",
    "config_folder",
    "feature_extractor",
    "hub_ids",
    "load_json",
    "model_config",
    "offline_preset",
    "standin_tokenizer",
    "write_checkpoint",
]
