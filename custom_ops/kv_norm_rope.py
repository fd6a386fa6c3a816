"""`dsflash::kv_norm_rope`: the attention's key/value row from its projection, in one launch;
`dsflash::kv_norm_rope_write_`: the same, its rows also written to the window ring (one-token steps);
`dsflash::qkv_norm_rope` (`qkv_norm_rope_write_`: and the ring write): the same with the query's RMSNorm in that
launch (one program a row of each: at decode batch 1 the query's norm was an Inductor kernel of its own, 1.2 us of
the H200 step's path a layer, 12-03 a1).

    kv = RMSNorm(kv_a) with weight w                     (fp32, rounded to bf16: layers.RMSNorm)
    kv = RoPE of kv's trailing 2 * r/2 dims by rot       (fp32, rounded to bf16: rope.apply_rope)
    kv = fp8_qdq(kv) in groups of 32                     (quantize: the window's K = V is FP8, quant.fp8_qdq)

Why an op: Inductor split this chain into three kernels (the norm's sum of squares, the norm and RoPE, the
FP8 group maxima and rounding), each a single program on a decode row of 512 values: on the H200 (12-02 m,
flash-40l-e8 B1) 1.06 + 1.31 + 1.73 us and two launch gaps per layer. The kernel (kv_norm_rope_triton.py)
runs one program per row. The reference is the model's own functions (CPU, and CUDA inputs the kernel does not
take).
"""

from typing import Optional

import torch
from torch import Tensor

from dsflash_compile.quant import fp8_qdq
from dsflash_compile.rope import apply_rope

from . import records
from .mhc import rms_norm


@torch.library.custom_op("dsflash::kv_norm_rope", mutates_args=())
def kv_norm_rope(kv: Tensor, weight: Tensor, eps: float, rot: Tensor, quantize: bool,
                 after: Optional[Tensor] = None, early: bool = False) -> Tensor:
    """kv bf16 [..., T, D] (any row stride); weight bf16 [D]; rot fp32 [..., T, r/2, 2] (rope.rotation).
    Returns bf16 [..., T, D], contiguous. after (never read) and early: set by passes/early_reads.py, after a
    tensor a kernel computed from the inputs' producers (so that kernel runs between them and this op); early,
    the kernel reads and computes before its PDL wait (kv_norm_rope_triton.py)."""
    return kv_norm_rope_reference(kv, weight, eps, rot, quantize)


def check_inputs(kv: Tensor, weight: Tensor, rot: Tensor, quantize: bool) -> None:
    """Errors that name the problem."""
    if kv.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or rot.dtype != torch.float32:
        raise TypeError(f"kv_norm_rope: kv and weight must be bf16 and rot fp32, got {kv.dtype}, {weight.dtype}, "
                        f"{rot.dtype}")
    dim = kv.shape[-1]
    if tuple(weight.shape) != (dim,):
        raise ValueError(f"kv_norm_rope: weight has shape {tuple(weight.shape)}; expected ({dim},) for kv "
                         f"{tuple(kv.shape)}")
    if rot.dim() != kv.dim() + 1 or rot.shape[:-2] != kv.shape[:-1] or rot.shape[-1] != 2 or 2 * rot.shape[-2] > dim:
        raise ValueError(f"kv_norm_rope: rot has shape {tuple(rot.shape)}; expected {tuple(kv.shape[:-1])} + "
                         f"(pairs, 2) with 2 * pairs <= {dim}")
    if quantize and dim % 32:
        raise ValueError(f"kv_norm_rope: quantize needs the row ({dim}) to be a multiple of the FP8 group (32)")


def kv_norm_rope_reference(kv, weight, eps, rot, quantize):
    check_inputs(kv, weight, rot, quantize)
    out = apply_rope(rms_norm(kv, weight, eps), rot)
    return (fp8_qdq(out) if quantize else out).contiguous()


@kv_norm_rope.register_fake
def _(kv, weight, eps, rot, quantize, after=None, early=False):
    check_inputs(kv, weight, rot, quantize)
    return kv.new_empty(kv.shape)


@torch.library.custom_op("dsflash::kv_norm_rope_write_", mutates_args=("ring",))
def kv_norm_rope_write_(ring: Tensor, slots: Tensor, fmt: str, kv: Tensor, weight: Tensor, eps: float, rot: Tensor,
                        quantize: bool) -> Tensor:
    """kv_norm_rope's rows, each also written to the window ring as record_write_(ring, rows, slots, fmt) writes it,
    in the same launch: kv [B, T, D], slots [B, T], ring and fmt as record_write_'s. For one-token steps, where the
    row's ring slot holds no key the step's attention reads (Attention.forward): the ring write's own launch,
    1.0-1.1 us of every layer's path in the H200's B1 step (12-04 d5), goes."""
    out = kv_norm_rope_reference(kv, weight, eps, rot, quantize)
    records.record_write_reference(ring, out, slots, fmt)
    return out


@kv_norm_rope_write_.register_fake
def _(ring, slots, fmt, kv, weight, eps, rot, quantize):
    check_inputs(kv, weight, rot, quantize)
    records._check_write(ring, kv, slots, fmt)
    return kv.new_empty(kv.shape)


@torch.library.custom_op("dsflash::qkv_norm_rope", mutates_args=())
def qkv_norm_rope(q: Tensor, q_weight: Tensor, kv: Tensor, weight: Tensor, eps: float, rot: Tensor,
                  quantize: bool) -> tuple[Tensor, Tensor]:
    """The query's RMSNorm beside kv_norm_rope, in its launch (the attention's two norms after its input
    projection, CompileOptions.qkv_norm_op; both take the config's eps): q bf16 [..., T, Q] (any row stride),
    q_weight bf16 [Q]; the rest as kv_norm_rope. Returns (RMSNorm(q) bf16 [..., T, Q], kv_norm_rope's output),
    contiguous."""
    return qkv_norm_rope_reference(q, q_weight, kv, weight, eps, rot, quantize)


def check_query(q: Tensor, q_weight: Tensor, kv: Tensor) -> None:
    """The query's errors that name the problem."""
    if q.dtype != torch.bfloat16 or q_weight.dtype != torch.bfloat16:
        raise TypeError(f"qkv_norm_rope: q and q_weight must be bf16, got {q.dtype} and {q_weight.dtype}")
    if tuple(q_weight.shape) != (q.shape[-1],) or q.shape[:-1] != kv.shape[:-1]:
        raise ValueError(f"qkv_norm_rope: q {tuple(q.shape)} and q_weight {tuple(q_weight.shape)} must be "
                         f"{tuple(kv.shape[:-1])} + (Q,) and (Q,), as kv {tuple(kv.shape)}")


def qkv_norm_rope_reference(q, q_weight, kv, weight, eps, rot, quantize):
    check_query(q, q_weight, kv)
    return rms_norm(q, q_weight, eps).contiguous(), kv_norm_rope_reference(kv, weight, eps, rot, quantize)


@qkv_norm_rope.register_fake
def _(q, q_weight, kv, weight, eps, rot, quantize):
    check_query(q, q_weight, kv)
    check_inputs(kv, weight, rot, quantize)
    return q.new_empty(q.shape), kv.new_empty(kv.shape)


@torch.library.custom_op("dsflash::qkv_norm_rope_write_", mutates_args=("ring",))
def qkv_norm_rope_write_(ring: Tensor, slots: Tensor, fmt: str, q: Tensor, q_weight: Tensor, kv: Tensor,
                         weight: Tensor, eps: float, rot: Tensor, quantize: bool) -> tuple[Tensor, Tensor]:
    """qkv_norm_rope, with kv's rows also written to the window ring as kv_norm_rope_write_ writes them (both
    options on: CompileOptions.qkv_norm_op and decode_ring_write_op)."""
    qr, out = qkv_norm_rope_reference(q, q_weight, kv, weight, eps, rot, quantize)
    records.record_write_reference(ring, out, slots, fmt)
    return qr, out


@qkv_norm_rope_write_.register_fake
def _(ring, slots, fmt, q, q_weight, kv, weight, eps, rot, quantize):
    check_query(q, q_weight, kv)
    check_inputs(kv, weight, rot, quantize)
    records._check_write(ring, kv, slots, fmt)
    return q.new_empty(q.shape), kv.new_empty(kv.shape)


try:  # Triton is optional on CPU machines
    from . import kv_norm_rope_triton
except ImportError:  # pragma: no cover - CPU machines without triton
    kv_norm_rope_triton = None

if kv_norm_rope_triton is not None:
    @kv_norm_rope.register_kernel("cuda")
    def _(kv, weight, eps, rot, quantize, after=None, early=False):
        check_inputs(kv, weight, rot, quantize)
        if not kv_norm_rope_triton.kernel_fits(kv):
            return kv_norm_rope_reference(kv, weight, eps, rot, quantize)
        return kv_norm_rope_triton.kv_norm_rope_triton(kv, weight, eps, rot, quantize, early)

    @kv_norm_rope_write_.register_kernel("cuda")
    def _(ring, slots, fmt, kv, weight, eps, rot, quantize):
        check_inputs(kv, weight, rot, quantize)
        records._check_write(ring, kv, slots, fmt)
        if not (kv_norm_rope_triton.kernel_fits(kv) and fmt in kv_norm_rope_triton.RING_FORMATS):
            out = torch.ops.dsflash.kv_norm_rope(kv, weight, eps, rot, quantize)
            torch.ops.dsflash.record_write_(ring, out, slots, fmt)
            return out
        return kv_norm_rope_triton.kv_norm_rope_triton(kv, weight, eps, rot, quantize, ring=ring, slots=slots, fmt=fmt)

    def _joint_fits(q, kv) -> bool:
        return kv_norm_rope_triton.kernel_fits(kv) and q.shape[-1] <= kv_norm_rope_triton.MAX_DIM

    @qkv_norm_rope.register_kernel("cuda")
    def _(q, q_weight, kv, weight, eps, rot, quantize):
        check_query(q, q_weight, kv)
        check_inputs(kv, weight, rot, quantize)
        if not _joint_fits(q, kv):
            return qkv_norm_rope_reference(q, q_weight, kv, weight, eps, rot, quantize)
        return kv_norm_rope_triton.qkv_norm_rope_triton(q, q_weight, kv, weight, eps, rot, quantize)

    @qkv_norm_rope_write_.register_kernel("cuda")
    def _(ring, slots, fmt, q, q_weight, kv, weight, eps, rot, quantize):
        check_query(q, q_weight, kv)
        check_inputs(kv, weight, rot, quantize)
        records._check_write(ring, kv, slots, fmt)
        if not (_joint_fits(q, kv) and fmt in kv_norm_rope_triton.RING_FORMATS):
            qr, out = torch.ops.dsflash.qkv_norm_rope(q, q_weight, kv, weight, eps, rot, quantize)
            torch.ops.dsflash.record_write_(ring, out, slots, fmt)
            return qr, out
        return kv_norm_rope_triton.qkv_norm_rope_triton(q, q_weight, kv, weight, eps, rot, quantize, ring, slots, fmt)
