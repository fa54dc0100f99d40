"""SGLang's Triton decode attention with an FP8 KV cache."""

from __future__ import annotations

import math

from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError, check_int

#: The most KV splits per request: SGLang's server default ``ServerArgs.triton_attention_num_kv_splits: int = 8``
#: (``python/sglang/srt/server_args.py``), read as ``max_kv_splits`` by ``TritonAttnBackend.__init__``
#: (``triton_backend.py`` line 165, commit 0085842).
SGLANG_MAX_KV_SPLITS = 8


#: Keys per split in SGLang's deterministic mode (``--enable-deterministic-inference``):
#: ``SGLANG_TRITON_DECODE_SPLIT_TILE_SIZE``, default 256 (``triton_backend.py`` lines 197-201, commit 0085842).
SGLANG_DETERMINISTIC_SPLIT_KEYS = 256


def sglang_num_kv_splits(*, batch: int, num_heads: int, num_kv_heads: int, sms: int, seq_len: int,
                         max_kv_splits: int = SGLANG_MAX_KV_SPLITS, deterministic: bool = False) -> int:
    """KV splits SGLang's Triton decode picks for each of ``batch`` requests of ``seq_len`` keys.

    sgl-project/sglang ``python/sglang/srt/layers/attention/triton_ops/metadata.py`` (commit bdd1bcd),
    ``get_num_kv_splits_triton`` lines 12-60, called per batch by ``TritonAttnBackend.get_num_kv_splits``
    (``triton_backend.py``, commit 0085842) in its default dynamic mode, with one decode token per request
    (``num_group`` 1). With equal request lengths the length-ratio bound gives one split, and the count is
    the device bound: ``ext = int(sms · max(log2(seq_len / 64), 1))``, ``token_grid = batch · num_heads``
    without GQA, else ``batch · ⌈num_heads / min(16, num_heads / num_kv_heads)⌉``;
    ``m = min(⌈ext / token_grid⌉, max_kv_splits)`` and splits = ⌈seq_len / ⌈seq_len / m⌉⌉.
    ``deterministic=True``: SGLang's deterministic mode, one split per
    :data:`SGLANG_DETERMINISTIC_SPLIT_KEYS` keys whatever the batch or device, ⌈seq_len / 256⌉
    (``get_num_kv_splits``, ``triton_backend.py`` lines 277-288; its cap ``max_kv_splits`` becomes
    ⌈context_len / 256⌉, lines 209-212). (``SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS`` fills
    ``max_kv_splits`` instead, lines 270-275; not modelled.) Token-sink zeroing scales as 1 / splits:
    only the split holding the sinks takes its keys against the sinks' max.
    """
    batch = check_int("batch", batch, min_value=1)
    num_heads = check_int("num_heads", num_heads, min_value=1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, min_value=1, max_value=num_heads)
    sms = check_int("sms", sms, min_value=1)
    seq_len = check_int("seq_len", seq_len, min_value=1)
    max_kv_splits = check_int("max_kv_splits", max_kv_splits, min_value=1)
    if not isinstance(deterministic, bool):
        raise PcastError(f"deterministic={deterministic!r} must be True or False")
    if deterministic:
        return -(-seq_len // SGLANG_DETERMINISTIC_SPLIT_KEYS)
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
#: 4 at batch 32, 2 at batch 64 and 1 from batch 128 on; the deterministic mode gives 16 at 4096 keys
#: (``deterministic=True``). The preset's verdict holds for this launch: token-sink zeroing scales as
#: 1 / splits, so a batch of 128 or more (one split) zeroes 8× what the preset does, 16 splits half.
SGLANG_DECODE_LAUNCH = {"batch": 2, "num_heads": 32, "num_kv_heads": 8, "sms": 132, "seq_len": 4096}

PRESETS: dict[str, KernelConfig] = {
    # sgl-project/sglang python/sglang/srt/layers/attention/triton_ops/decode_attention.py (at 03cd2ec), the
    # grouped (GQA) kernel: BLOCK_N = 32, exact softmax per tile, p.to(v.dtype) casts P to the FP8 KV dtype
    # with no scale (S = 1); contiguous splits (each split's length rounded up to a multiple of 32), forward
    # order within a split; a learned sink enters once in the stage-2 merge, e_sum += exp(sink − e_max): the
    # denominator only ("epilogue"). (The MHA kernel, BLOCK_N = 64, multiplies P·V in FP32: no P-cast.)
    # Splits: sglang_num_kv_splits for SGLANG_DECODE_LAUNCH (8; fewer at larger batches).
    "sglang_triton_decode": KernelConfig(order="forward", scale=1.0, scale_mode="multiply", block_kv=32,
                                         kv_splits=sglang_num_kv_splits(**SGLANG_DECODE_LAUNCH)),
}
