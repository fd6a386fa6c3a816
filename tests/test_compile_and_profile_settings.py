"""scripts/compile_and_profile.py's KERNEL_SETTINGS: module constants a variant sets while it compiles and captures
(its CUDA graphs keep the kernels the ops picked then), restored afterwards, on the CPU."""

import pytest
from script_module import load_script

from dsflash_compile.custom_ops import bf16_linear_tma_triton as tma


def test_kernel_settings_set_and_restore_module_constants():
    script = load_script("compile_and_profile")
    default = tma.MIN_K
    settings = script.KERNEL_SETTINGS["tiled-big-linear"]
    with script.kernel_settings(settings):
        assert tma.MIN_K == 1 << 30
    assert tma.MIN_K == default
    with pytest.raises(RuntimeError), script.kernel_settings(settings):
        raise RuntimeError("a failed compile")
    assert tma.MIN_K == default


def test_every_kernel_setting_names_a_variant_and_existing_constants():
    script = load_script("compile_and_profile")
    for variant, settings in script.KERNEL_SETTINGS.items():
        assert variant in script.VARIANTS
        for module_name, values in settings.items():
            module = __import__(module_name, fromlist=["_"])
            assert all(hasattr(module, constant) for constant in values), (variant, module_name)


def test_every_variant_sets_compile_options_fields():
    """A variant's options are CompileOptions fields with valid values (a typo would fail only on the device)."""
    from dsflash_compile.compiled import CompileOptions

    script = load_script("compile_and_profile")
    for variant, options in script.VARIANTS.items():
        CompileOptions(**options)  # raises on an unknown field or a refused value
