"""dsflash_compile: DeepSeek-V4.1-Flash as a Hugging Face model, compiled for Hopper.

Importing the package registers the `dsflash` ops and the `deepseek_v41` model type with transformers'
Auto classes (see `register_auto_classes` for what happens if transformers already knows the type).
"""

from pathlib import Path as _Path

# Run from a source checkout without installing: `custom_ops/` and `passes/` sit at the repository root
# and install as subpackages of this one (pyproject's package-dir), so make them importable the same way.
_root = _Path(__file__).resolve().parent.parent
if (_root / "custom_ops" / "__init__.py").is_file() and str(_root) not in __path__:
    __path__.append(str(_root))

from . import custom_ops  # noqa: E402,F401  (registers torch.ops.dsflash.*)
from .cache import DeepseekV41Cache  # noqa: E402
from .compiled import CompileOptions, compile  # noqa: E402
from .configuration_deepseek_v41 import (  # noqa: E402
    DeepseekV41Config,
    DeepseekV41TextConfig,
    DeepseekV41VisionConfig,
)
from .modeling_deepseek_v41 import DeepseekV41ForCausalLM, DeepseekV41Model  # noqa: E402
from .presets import PRESETS, preset_config  # noqa: E402
from .registration import register_auto_classes  # noqa: E402

register_auto_classes()

__all__ = ["CompileOptions", "compile", "DeepseekV41Cache", "DeepseekV41Config", "DeepseekV41TextConfig", "DeepseekV41VisionConfig",
           "DeepseekV41ForCausalLM", "DeepseekV41Model", "PRESETS", "preset_config", "register_auto_classes"]
