"""SGLang's Triton decode attention with an FP8 KV cache."""

from __future__ import annotations

import math

from pcast_jax.config import KernelConfig
from pcast_jax.errors import check_int

#: The most KV splits per request: SGLang's server default for ``--triton-attention-num-kv-splits`` (an
#: assumption, not read from the stored source; ``TritonAttnBackend.__init__`` reads it as ``max_kv_splits``).
SGLANG_MAX_KV_SPLITS = 8


def sglang_num_kv_splits(*, batch: int, num_heads: int, num_kv_heads: int, sms: int, seq_len: int,
                         max_kv_splits: int = SGLANG_MAX_KV_SPLITS) -> int:
    """KV splits SGLang's Triton decode picks for each of ``batch`` requests of ``seq_len`` keys.

    sgl-project/sglang ``python/sglang/srt/layers/attention/triton_ops/metadata.py`` (commit bdd1bcd),
    ``get_num_kv_splits_triton`` lines 12-60, called per batch by ``TritonAttnBackend.get_num_kv_splits``
    (``triton_backend.py``, commit 0085842) in its default dynamic mode, with one decode token per request
    (``num_group`` 1). With equal request lengths the length-ratio bound gives one split, and the count is
    the device bound: ``ext = int(sms · max(log2(seq_len / 64), 1))``, ``token_grid = batch · num_heads``
    without GQA, else ``batch · ⌈num_heads / min(16, num_heads / num_kv_heads)⌉``;
    ``m = min(⌈ext / token_grid⌉, max_kv_splits)`` and splits = ⌈seq_len / ⌈seq_len / m⌉⌉.
    (``SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS`` fills ``max_kv_splits`` instead; the deterministic mode
    takes ⌈seq_len / 256⌉; neither is modelled here.)
    """
    batch = check_int("batch", batch, min_value=1)
    num_heads = check_int("num_heads", num_heads, min_value=1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, min_value=1, max_value=num_heads)
    sms = check_int("sms", sms, min_value=1)
    seq_len = check_int("seq_len", seq_len, min_value=1)
    max_kv_splits = check_int("max_kv_splits", max_kv_splits, min_value=1)
    ext = int(sms * max(math.log2(seq_len / 64.0), 1.0))  # tl.cast(..., tl.int32) truncates toward zero
    group = num_heads // num_kv_heads
    heads = num_heads if group == 1 else -(-num_heads // min(16, group))
    token_grid = batch * heads
    most = min(-(-ext // token_grid), max_kv_splits)
    chunk = -(-seq_len // most)
    return -(-seq_len // chunk)


#: The launch the ``sglang_triton_decode`` preset stands for (an assumption, as ``XQA_DECODE_LAUNCH`` is for
#: XQA): an H100 SXM (132 SMs), batch 2 of Llama-3-8B's 32 query and 8 KV heads, 4096 keys each:
#: :func:`sglang_num_kv_splits` gives 8 (the maximum). The same model at 4096 keys gets 7 splits at batch 16,
#: 4 at batch 32, 2 at batch 64 and 1 from batch 128 on; token-sink zeroing scales as 1 / splits.
SGLANG_DECODE_LAUNCH = {"batch": 2, "num_heads": 32, "num_kv_heads": 8, "sms": 132, "seq_len": 4096}

PRESETS: dict[str, KernelConfig] = {
    # sgl-project/sglang python/sglang/srt/layers/attention/triton_ops/decode_attention.py (at 03cd2ec), the
    # grouped (GQA) kernel: BLOCK_N = 32, exact softmax per tile, p.to(v.dtype) casts P to the FP8 KV dtype
    # with no scale (S = 1); contiguous splits (each split's length rounded up to a multiple of 32), forward
    # order within a split; a learned sink enters once in the stage-2 merge, e_sum += exp(sink − e_max): the
    # denominator only ("epilogue"). (The MHA kernel, BLOCK_N = 64, multiplies P·V in FP32: no P-cast.)
    # Splits: sglang_num_kv_splits for SGLANG_DECODE_LAUNCH (8; fewer at larger batches).
    "sglang_triton_decode": KernelConfig(order="forward", scale=1.0, scale_mode="multiply", block_kv=32,
                                         kv_splits=sglang_num_kv_splits(**SGLANG_DECODE_LAUNCH),
                                         name="sglang_triton_decode"),
}
