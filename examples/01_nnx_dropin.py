"""Drop-in FP8 attention in a Flax NNX model

A small two-block Flax NNX transformer takes its attention from ``pcast_jax.nn.attention_fn``.
Its input tokens share a common direction and token 0 is a scaled copy of it, so in some heads
every query attends mostly to token 0: an attention sink, the case where the P-cast matters.
With the same weights it runs once with exact FP32 attention (``config=None``) and once per
simulated FP8 kernel preset; the script prints how far each kernel's output is from the exact
one. It then swaps in a :class:`pcast_jax.analysis.Recorder`, captures the Q/K/V every layer
sees, and lets :func:`pcast_jax.analysis.analyze` say, per layer and head, what each kernel
does to this model (sink heads, zeroed P, lost mass, the safe static scale). The analysis
report (markdown, CSVs, a figure) is written to ``--out``.

Run it with::

    .venv/bin/python examples/01_nnx_dropin.py [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pcast_jax.analysis import Recorder, analyze, load_trace, write_report
from pcast_jax.nn import attention_fn

FEATURES, HEADS, TOKENS = 64, 4, 256
PRESETS = ("fwd_s1", "rev_s256")


class Block(nnx.Module):
    """Transformer block: causal multi-head attention (on the raw residual stream, so a token's norm
    reaches its key) and a pre-norm MLP, each residual."""

    def __init__(self, attn_fn, *, rngs: nnx.Rngs):
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False,
                                           attention_fn=attn_fn, rngs=rngs)
        self.norm2 = nnx.LayerNorm(FEATURES, rngs=rngs)
        self.up = nnx.Linear(FEATURES, 4 * FEATURES, rngs=rngs)
        self.down = nnx.Linear(4 * FEATURES, FEATURES, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(x, is_causal=True)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TinyModel(nnx.Module):
    """Two blocks; every block gets its attention_fn from ``make_attn`` (one call per block)."""

    def __init__(self, make_attn, *, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.blocks = nnx.List([Block(make_attn(), rngs=rngs) for _ in range(2)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def inputs(sink_gain: float) -> jax.Array:
    """Tokens that share a common direction c plus noise; token 0 is ``sink_gain``·c. In a head whose
    query and key projections of c point the same way, every query then scores token 0 far above the
    rest: an attention sink, as trained models grow them."""
    kc, kn = jax.random.split(jax.random.key(1))
    c = jax.random.normal(kc, (FEATURES,))
    x = c + jax.random.normal(kn, (1, TOKENS, FEATURES))
    return x.at[:, 0].set(sink_gain * c)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the analysis report (default: a temp dir)")
    parser.add_argument("--sink-gain", type=float, default=6.0, help="norm of the sink token over the others'")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="pcast_example01_"))
    out.mkdir(parents=True, exist_ok=True)
    x = inputs(args.sink_gain)

    # 1. The drop-in: the same model (same seed, same weights) with exact and with FP8 attention.
    exact = TinyModel(lambda: attention_fn(None))(x)
    print(f"model: 2 blocks x {HEADS} heads, {FEATURES} features, {TOKENS} tokens; |exact output| max "
          f"{float(jnp.max(jnp.abs(exact))):.3f}")
    for preset in PRESETS:
        y = TinyModel(lambda p=preset: attention_fn(p))(x)
        err = float(jnp.max(jnp.abs(y - exact)))
        rel = float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact))
        if not np.isfinite([err, rel]).all():
            raise SystemExit(f"{preset}: non-finite output")
        print(f"{preset:>9}: max |FP8 - exact| = {err:.3e}, relative L2 error = {rel:.3e}")

    # 2. Capture Q/K/V (the swap: a Recorder's attention_fn) and analyse every kernel on them.
    rec = Recorder()
    TinyModel(rec.attention_fn)(x)
    trace_path = out / "trace.npz"
    rec.trace().save(trace_path)
    result = analyze(load_trace(trace_path), [*PRESETS, "fa3"])
    print("\n".join(result.summary_lines()))
    write_report(result, out / "analysis")
    print(f"OK: trace in {trace_path}, report in {out / 'analysis'}")


if __name__ == "__main__":
    main()
