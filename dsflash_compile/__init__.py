"""dsflash_compile: DeepSeek-V4.1-Flash as a Hugging Face model, compiled for Hopper."""

from pathlib import Path as _Path

# Run from a source checkout without installing: `custom_ops/` and `passes/` sit at the repository root
# and install as subpackages of this one (pyproject's package-dir), so make them importable the same way.
_root = _Path(__file__).resolve().parent.parent
if (_root / "custom_ops" / "__init__.py").is_file() and str(_root) not in __path__:
    __path__.append(str(_root))

from . import custom_ops  # noqa: E402,F401  (registers torch.ops.dsflash.*)
