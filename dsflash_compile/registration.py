"""Registration of `deepseek_v41` with transformers' AutoConfig / AutoModel / AutoModelForCausalLM.

Policy when the installed transformers already ships a `deepseek_v41` (none does as of 5.24): importing
dsflash_compile replaces the mapping with our classes (logged once), because every tool of this package
(passes, ops, cache, replay) acts on our model; the transformers class stays importable by its own path.
"""

import logging

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from .configuration_deepseek_v41 import DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig

log = logging.getLogger(__name__)


def register_auto_classes() -> None:
    from .modeling_deepseek_v41 import DeepseekV41ForCausalLM, DeepseekV41Model

    for config_class in (DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig):
        existing = CONFIG_MAPPING._extra_content.get(config_class.model_type) or (
            CONFIG_MAPPING[config_class.model_type] if config_class.model_type in CONFIG_MAPPING else None)
        if existing is not None and existing is not config_class:
            log.warning("transformers already maps %r to %s.%s; dsflash_compile replaces it with its own %s",
                        config_class.model_type, existing.__module__, existing.__name__, config_class.__name__)
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(DeepseekV41Config, DeepseekV41Model, exist_ok=True)
    AutoModelForCausalLM.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)
