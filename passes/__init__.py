"""FX/Inductor passes of dsflash_compile and their manager (see `install`)."""

from torch._inductor import config as inductor_config

from .early_reads import EarlyReadsPass
from .kv_first import KvFirstPass
from .linear_norm import LinearNormPass
from .linear_rope import LinearRopePass
from .linear_scale import LinearScalePass
from .manager import DsflashPassManager
from .mhc_defer import MhcDeferPass
from .mhc_fusion import MhcFusionPass
from .mhc_overlap import MhcOverlapPass
from .rounding import keep_model_rounding
from .router_fusion import RouterFusionPass
from .router_seam import RouterSeamPass
from .seam_norm_gemv import SeamNormGemvPass


def use(manager: DsflashPassManager | None) -> None:
    """Make Inductor run `manager` as its post-grad custom pass for graphs compiled from now on, with the
    settings our patterns need (None: no custom pass, Inductor's online softmax back on)."""
    inductor_config.post_grad_custom_post_pass = manager
    # On CUDA, Inductor's own post-grad passes rewrite a written-out softmax into its online-softmax prim
    # before custom passes run; that turns the Sinkhorn's first softmax into something the mHC pattern
    # does not know. The seam op replaces that softmax anyway.
    inductor_config.online_softmax = manager is None
    if manager is not None:
        keep_model_rounding()  # the patterns hold the model's bf16 rounding points


def install(text_config, mhc_overlap_tokens: int = 0, mhc_defer_tokens: int = 0,
            early_reads: bool = False, router_seam_experts: int = 0, linear_rope: bool = False,
            seam_norm_gemv: bool = False, linear_norm: bool = False, early_gemv: bool = False,
            linear_scale: bool = False, kv_first: bool = False) -> DsflashPassManager:
    """Make Inductor run our passes (post-grad) for graphs compiled from now on; returns the manager,
    whose `matches` counts the rewrites. Patterns use the config's router and mHC constants.
    mhc_overlap_tokens > 0: fused seams of at most that many tokens are split so that their mixes run on a
    side CUDA stream (MhcOverlapPass); 0 keeps every seam one launch. mhc_defer_tokens > 0: fused seams of at
    most that many tokens leave their mixes to a finishing op before the mixes' first reader (MhcDeferPass).
    early_reads: kv_norm_rope reads before its PDL wait where a kernel runs between it and its inputs
    (EarlyReadsPass, after the linear passes); early_gemv: one-row projections do, after a projection streaming a
    weight.
    router_seam_experts > 0 (with the deferral): routers of at most that many experts reading a deferred seam's
    normed rows run inside that seam (RouterSeamPass). linear_rope: a bf16_linear whose only
    reader is the RoPE of its heads takes the rotation in its epilogue (LinearRopePass). seam_norm_gemv (with the
    deferral): a deferred seam read by one bf16_gemv leaves its RMSNorm to it (SeamNormGemvPass). linear_norm: an
    RMSNorm read only by a one-row projection of a TMA-sized weight becomes its norm prologue (LinearNormPass, after
    LinearRopePass). linear_scale: a one-row GEMV whose only reader multiplies it by a constant takes the constant
    in its epilogue (LinearScalePass). kv_first: the attention's key row is made before the query's one-row
    projection (KvFirstPass, last)."""
    manager = DsflashPassManager([
        RouterFusionPass(text_config.num_experts_per_tok, text_config.norm_topk_prob,
                         text_config.routed_scaling_factor),
        MhcFusionPass(text_config.rms_norm_eps, text_config.hc_eps, text_config.hc_sinkhorn_iters,
                      text_config.hc_mult),
        *([MhcOverlapPass(mhc_overlap_tokens)] if mhc_overlap_tokens > 0 else []),
        *([MhcDeferPass(mhc_defer_tokens)] if mhc_defer_tokens > 0 else []),
        *([RouterSeamPass(router_seam_experts)] if mhc_defer_tokens > 0 and router_seam_experts > 0 else []),
        *([SeamNormGemvPass()] if mhc_defer_tokens > 0 and seam_norm_gemv else []),
        *([LinearRopePass()] if linear_rope else []),
        *([LinearScalePass()] if linear_scale else []),
        *([LinearNormPass()] if linear_norm else []),
        # after the epilogue folds: an early GEMV's `after` is a second reader of its anchor's output, which the
        # folds take as a sign of another reader (12-05 f1, H200: before them it kept the query's RoPE out of
        # wq_b's epilogue in the index layers, a RoPE kernel of 1.7 us each)
        *([EarlyReadsPass(early_reads, early_gemv)] if early_reads or early_gemv else []),
        *([KvFirstPass()] if kv_first else []),
    ])
    use(manager)
    return manager


__all__ = ["DsflashPassManager", "EarlyReadsPass", "LinearNormPass", "LinearRopePass", "MhcDeferPass", "MhcFusionPass",
           "MhcOverlapPass", "RouterFusionPass", "RouterSeamPass", "SeamNormGemvPass", "install", "keep_model_rounding",
           "use"]
