"""JAX's TPU ragged paged attention (vLLM-TPU): P taken against each KV block's own maximum.

Read in jax-ml/jax at commit cec06d1, ``jax/experimental/pallas/ops/tpu/ragged_paged_attention/kernel.py``:

* each KV block's P is taken against the block's own max, ``m_curr = jnp.max(qk, axis=1)`` and
  ``s_curr = jnp.exp(qk - m_curr)`` (L538-539), multiplied by V (L540), and only then rescaled to the
  running max: ``beta = jnp.exp(m_curr - m_next)`` (L553), ``l_next = l_alpha + beta * l_curr`` (L555),
  ``out = (l_alpha * o_curr + beta * qkv) / l_next_safe`` (L580-581) — ``p_offset="block_max"``. Every
  block's largest P is 1, so a sink in one block cannot push another block's P below the cast's
  threshold: P-collapse across blocks cannot happen by construction. (The kernel renormalises the
  accumulator by ℓ every block; that equals one division at the end up to FP32 rounding.)
* **P is not FP8 in this kernel**: ``s_curr`` is float32 and the product is
  ``jnp.dot(s_curr, v, preferred_element_type=jnp.float32)`` (L540) with V in Q's dtype (bf16 or f32,
  K/V dequantized by ``k_scale``/``v_scale`` first). The preset below is the FP8-cast variant of this
  mechanism, the control a sweep carries: the same block-local P cast to E4M3 with S = 256 (an
  assumption: any S ≤ 448 keeps each block's largest P in range; 256 is the paper's power of two).
* block size: ``num_kv_pages_per_block`` × ``page_size``, chosen per shape from an autotuned table
  (``tuned_block_sizes.py`` L1473: the default 128 pages; L84: 4 pages of 32 tokens on TPU v6 for one
  bf16 shape). B = 128 is an assumption (one tuned value; the mechanism does not depend on B).
"""

from __future__ import annotations

from pcast_jax.config import KernelConfig

PRESETS: dict[str, KernelConfig] = {
    "tpu_ragged_paged_fp8p": KernelConfig(order="forward", scale=256.0, scale_mode="multiply", block_kv=128,
                                          p_offset="block_max"),
}
