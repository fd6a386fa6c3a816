"""The candidate-only scoring kernel (custom_ops/indexer_triton.py) against the reference op, under the
Triton interpreter on CPU (in a subprocess, see interp.py). Not yet checked on a GPU."""

import pytest
import torch

from interp import interpreter_skip_reason, report, run_interpreted

CASES = {  # name: (batch, seq, heads, dim, rows, blocks kept, block size, key format)
    "bf16": (2, 3, 8, 64, 40, 4, 4, "bf16"),
    "mxfp4": (2, 3, 8, 64, 40, 4, 4, "mxfp4"),
    "release_heads": (1, 2, 32, 128, 70, 5, 8, "mxfp4"),
}


def make_case(batch, seq, heads, dim, rows, kept, block_size, fmt, seed=0):
    from dsflash_compile.custom_ops import records

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=g).bfloat16()
    weights = (torch.randn(batch, seq, heads, generator=g) * 0.1).bfloat16()
    keys = torch.randn(batch, rows, dim, generator=g).bfloat16()
    if fmt == "mxfp4":
        keys = records.encode_reference(keys, "mxfp4")
    n_blocks = -(-rows // block_size)
    blocks = torch.stack([torch.randperm(n_blocks, generator=g)[:kept].sort().values for _ in range(batch * seq)])
    blocks = blocks.view(batch, seq, kept).to(torch.int32)
    blocks[0, 0, -1] = -1  # a query that kept fewer blocks
    visible = torch.randint(rows // 2, rows + 1, (batch, seq), generator=g)
    return q, weights, keys, blocks, block_size, visible, fmt


def interpreter_checks():
    """Entry point of the subprocess: kernel vs reference for every case."""
    from dsflash_compile.custom_ops.indexer import candidate_scores_reference
    from dsflash_compile.custom_ops.indexer_triton import candidate_scores_triton

    for name, shape in CASES.items():
        args = make_case(*shape)
        ref = candidate_scores_reference(*args)
        out = candidate_scores_triton(*args)
        finite = ref.isfinite()
        scale = ref[finite].float().abs().max().item()
        report(dict(name=name, same_masked=bool(torch.equal(finite, out.isfinite())),
                    max_err=(out[finite].float() - ref[finite].float()).abs().max().item(), scale=scale))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_indexer_triton", "interpreter_checks")


@pytest.mark.skipif(interpreter_skip_reason() is not None, reason=str(interpreter_skip_reason()))
@pytest.mark.parametrize("name", list(CASES))
def test_candidate_scores_kernel_matches_reference(interpreted, name):
    """Same -inf pattern (invalid blocks, rows past visibility); finite scores within 4 bf16 ulps of the
    score scale (the interpreter truncates where the GPU rounds, and sums in another order)."""
    result = interpreted[name]
    assert result["same_masked"], result
    assert result["max_err"] <= 4 * 2 ** -8 * result["scale"], result
