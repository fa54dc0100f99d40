"""GPU measurements of the Pallas FP8 attention kernels (called by ``benchmarks/gpu_check.sh``).

Parts:

* ``timing`` — forward time and TFLOP/s (4·B·H·Lq·N·d flops, non-causal) of the Mosaic GPU and
  Triton kernels (FP8, V already transposed) and of ``jax.nn.dot_product_attention`` in bf16
  with ``implementation="cudnn"`` and ``"xla"``, in one run, for N = Lq ∈ {4096, 16384}, d = 128.
* ``table2`` — the paper's Table 2 configurations (Δ = 7, N = 4096, d = 128, k_sink = 4) through
  each kernel and through the scan-engine simulator on the same FP8 inputs; prints both MSEs
  against the exact FP32 softmax of the same scores.
* ``mma`` — fits the FP8 MMA accumulator model (``KernelConfig.mma_acc_bits``) to the Mosaic GPU
  kernel: flat scores (Δ = 0), S = 448, forward, B = 128, so each KV block's P8·V partial sums are
  large and the accumulator's truncation shows. The kernel adds a fresh wgmma accumulator per KV
  block to FP32 O (promotion per tile), so the simulator runs ``mma_promote_keys = block_kv`` with
  ``mma_acc_bits`` over 10..23 and exact FP32 (0); the fitted value is the one whose output is
  closest (mean squared difference) to the kernel's. Until this has run on Hopper the 14 bits used
  elsewhere are an assumption (DeepSeek-V3 technical report §3.3.2).

* ``cudnn`` — JAX's own FP8 attention (cuDNN FP8 SDPA through
  ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(..., fp8_params, use_fp8=True)``)
  on FP8 sink inputs at scale_s ∈ {1, 16, 128}, beside the simulator's cuDNN presets (τ = 0 and τ = 4
  nats) on the same inputs: MSE against the exact FP32 softmax and the mean squared difference between
  the kernel and each preset (both rounded to E4M3, the kernel's output type), so the τ that fits is
  the one with the smaller difference. On CPU (``--cpu-smoke``) the comparison runs with the τ = 4
  preset standing in for the kernel: the harness is checked, cuDNN is not.

``--cpu-smoke`` runs the parts at a tiny size with the kernels in interpret mode (no GPU
needed; the timings are then meaningless and cuDNN is skipped). Usage (repo root)::

    PYTHONPATH=. python benchmarks/gpu_bench.py --part all
    PYTHONPATH=. python benchmarks/gpu_bench.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels.workloads import sink_qkv
from pcast_jax import engine
from pcast_jax.config import KernelConfig
from pcast_jax.presets import preset_for, tagged

#: The paper's Table 2, N = 4096 column (MSE × 1e-5; Q, K, V in FP32, B = 64, q_len = 32).
PAPER_TABLE2_N4096 = {"fwd_s1": 5.65, "rev_s1": 1.70, "fwd_s448": 1.81, "fwd_s256": 1.64, "rev_s256": 1.64}
#: Accumulator mantissa bits the ``mma`` part tries (0 = exact FP32 accumulation).
MMA_FIT_BITS = (0,) + tuple(range(10, 24))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("timing", "table2", "mma", "cudnn", "fingerprint", "all"), default="all")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, interpret mode, no GPU")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384], help="N = Lq for timing")
    parser.add_argument("--tokens", type=int, default=131072, help="batch·heads·N for timing (fills the chip)")
    parser.add_argument("--heads", type=int, default=16, help="heads for timing")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per kernel")
    parser.add_argument("--seeds", type=int, default=20, help="independent heads for table2")
    parser.add_argument("--backends", nargs="+", choices=pk.BACKENDS, default=list(pk.BACKENDS))
    args = parser.parse_args(argv)
    for name in ("tokens", "heads", "reps", "seeds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(n < 128 or n % 128 for n in args.seq_lens):
        parser.error("--seq-lens must be multiples of 128")
    if args.cpu_smoke:
        args.seq_lens, args.tokens, args.heads, args.reps, args.seeds = [256], 256, 1, 1, 2
    return args


def _time(fn, *args, reps: int) -> float:
    """Mean seconds per call after compilation and two warm-up calls."""
    jax.block_until_ready(fn(*args))
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def run_timing(args) -> None:
    interpret = args.cpu_smoke
    d = 128
    print(f"\n== timing: forward, d={d}, non-causal, FP8 kernels vs bf16 dot_product_attention "
          f"(interpret={interpret}) ==")
    print(f"{'N':>6} {'B':>3} {'H':>3}  {'implementation':<38} {'ms':>9} {'TFLOP/s':>8}")
    for n in args.seq_lens:
        heads = args.heads
        batch = max(1, args.tokens // (n * heads))
        flops = 4.0 * batch * heads * n * n * d
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (batch, heads, n, d), jnp.float32)
        k = jax.random.normal(keys[1], (batch, heads, n, d), jnp.float32)
        v = jax.random.normal(keys[2], (batch, heads, n, d), jnp.float32)
        q8, k8, v8, descales = pk.quantize_qkv(q, k, v)
        v8_t = jnp.swapaxes(v8, -1, -2)
        cases = []
        for backend in args.backends:
            for name in ("fa3", "hpc_ops"):
                cfg = preset_for(name, d)  # the kernel's own KV block at this head dim
                label = f"{backend} fp8 {name} ({cfg.scale_mode}, B={cfg.block_kv})"
                fn = jax.jit(
                    lambda q, k, v, dq, dk, dv, cfg=cfg, backend=backend: pk.fp8_attention(
                        q, k, v, config=cfg, implementation=backend, interpret=interpret, v_transposed=True,
                        q_descale=dq, k_descale=dk, v_descale=dv,
                    )
                )
                scales = (descales["q_descale"], descales["k_descale"], descales["v_descale"])
                cases.append((label, fn, (q8, k8, v8_t) + scales))
        qb, kb, vb = (jnp.swapaxes(x, 1, 2).astype(jnp.bfloat16) for x in (q, k, v))  # (B, T, H, d)
        for impl in ("cudnn", "xla"):
            if impl == "cudnn" and jax.default_backend() != "gpu":
                print(f"{n:>6} {batch:>3} {heads:>3}  {'bf16 dot_product_attention cudnn':<38} skipped (needs a GPU)")
                continue
            fn = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(q, k, v, implementation=impl))
            cases.append((f"bf16 dot_product_attention {impl}", fn, (qb, kb, vb)))
        for label, fn, fargs in cases:
            try:
                sec = _time(fn, *fargs, reps=args.reps)
                print(f"{n:>6} {batch:>3} {heads:>3}  {label:<38} {sec * 1e3:>9.3f} {flops / sec / 1e12:>8.1f}")
            except Exception as err:  # keep measuring the others; report why this one failed
                print(f"{n:>6} {batch:>3} {heads:>3}  {label:<38} FAILED: {type(err).__name__}: {str(err)[:400]}")
            sys.stdout.flush()


def _mse(out, ref) -> float:
    return float(jnp.mean((jnp.asarray(out, jnp.float32) - ref) ** 2))


def run_table2(args) -> list[dict]:
    """Prints the table; returns its rows (config, backend, block_kv, MSEs, zero counts)."""
    interpret = args.cpu_smoke
    n = 512 if args.cpu_smoke else 4096
    q_len = 64  # the Mosaic GPU kernel's query block (the paper uses 32 rows)
    delta = 7.0
    w = sink_qkv(jax.random.key(2026), deltas=[delta], heads=args.seeds, kv_heads=args.seeds, q_len=q_len, n=n)
    q32, k32 = (x.astype(jnp.float32) for x in (w.q, w.k))
    scores = jnp.einsum("bhqd,bhnd->bhqn", q32, k32, precision=jax.lax.Precision.HIGHEST) * w.softmax_scale
    ref = engine.reference_attention(scores, w.v.astype(jnp.float32))
    print(f"\n== table2: Δ={w.delta[0]:.3f}, N={n}, d=128, q_len={q_len}, k_sink=4, {args.seeds} independent heads, "
          f"FP8 Q/K/V (exact scores), interpret={interpret} ==")
    print("MSE ×1e-5 against the exact FP32 softmax of the same scores")
    print(f"{'config':<10} {'backend':<8} {'B':>4} {'kernel':>9} {'simulator':>10} {'rel.diff':>9} "
          f"{'zeroed(kernel)':>15} {'zeroed(sim)':>12} {'paper(B=64,FP32 QKV)':>21}")
    rows = []
    for name, cfg in tagged("paper").items():  # at the paper's B = 64 on both backends
        for backend in args.backends:
            try:
                out, stats = pk.fp8_attention(
                    w.q, w.k, w.v, config=cfg, implementation=backend, interpret=interpret,
                    scale=w.softmax_scale, return_stats=True,
                )
                sim = pk.simulate_fp8_attention(w.q, w.k, w.v, config=cfg, scale=w.softmax_scale)
                mk, ms = _mse(out, ref), _mse(sim.out, ref)
                rows.append({
                    "config": name, "backend": backend, "block_kv": cfg.block_kv, "mse_kernel": mk,
                    "mse_simulator": ms, "zeroed_kernel": int(jnp.sum(stats.n_zeroed)),
                    "zeroed_simulator": int(jnp.sum(sim.n_zeroed)),
                })
                print(f"{name:<10} {backend:<8} {cfg.block_kv:>4} {mk * 1e5:>9.4f} {ms * 1e5:>10.4f} "
                      f"{abs(mk - ms) / ms:>9.2e} {int(jnp.sum(stats.n_zeroed)):>15} "
                      f"{int(jnp.sum(sim.n_zeroed)):>12} {PAPER_TABLE2_N4096[name]:>21.2f}")
            except Exception as err:
                print(f"{name:<10} {backend:<8} FAILED: {type(err).__name__}: {str(err)[:400]}")
            sys.stdout.flush()
    return rows


#: Relative mean squared mismatch below which a model counts as a perfect fit: (2^-20)², about the
#: FP32 rounding of a kernel's and the simulator's sums taken in different orders.
FIT_RESOLUTION = 2.0**-40


def fit_accumulator_bits(kernel_out, simulated: dict, *, resolution: float = FIT_RESOLUTION) -> tuple[int, dict]:
    """The accumulator model closest to a kernel's output.

    ``simulated`` maps mantissa bits (0 = exact FP32) to the simulator's output on the same inputs.
    Returns ``(best bits, {bits: mean squared difference from kernel_out})``: the smallest
    difference, except that every model within ``resolution`` × mean(kernel_out²) counts as a
    perfect fit, and among those exact FP32 wins, then the most bits (the simplest model).
    """
    if not simulated:
        raise ValueError("simulated must hold at least one model output")
    k = np.asarray(kernel_out, np.float64)
    err = {}
    for bits, out in simulated.items():
        o = np.asarray(out, np.float64)
        if o.shape != k.shape:
            raise ValueError(f"simulated[{bits}] has shape {o.shape}, kernel_out {k.shape}")
        err[bits] = float(np.mean((o - k) ** 2))
    floor = resolution * float(np.mean(k**2))
    best = min(err, key=lambda b: (max(err[b], floor), b != 0, -b))
    return best, err


def mma_fit_config(bits: int, block_kv: int = 128) -> KernelConfig:
    """The ``mma`` part's workload config: forward, S = 448 (multiply), per-tile promotion."""
    base = KernelConfig(order="forward", scale=448.0, scale_mode="multiply", block_kv=block_kv)
    return base if not bits else base.replace(mma_acc_bits=bits, mma_promote_keys=block_kv)


def run_mma(args) -> tuple[int, dict]:
    """Fits the accumulator bits to the Mosaic kernel; prints every candidate's mismatch."""
    interpret = args.cpu_smoke
    n, heads = (256, 1) if args.cpu_smoke else (4096, 8)
    q_len = 64 if args.cpu_smoke else 128
    w = sink_qkv(jax.random.key(7), deltas=[0.0], heads=heads, kv_heads=heads, q_len=q_len, n=n)
    base = mma_fit_config(0)
    out = pk.fp8_attention(w.q, w.k, w.v, config=base, implementation="mosaic", interpret=interpret,
                           scale=w.softmax_scale)
    grid = (0, 12, 14, 23) if args.cpu_smoke else MMA_FIT_BITS
    sims = {b: pk.simulate_fp8_attention(w.q, w.k, w.v, config=mma_fit_config(b), scale=w.softmax_scale,
                                         implementation="xla").out for b in grid}
    best, err = fit_accumulator_bits(out, sims)
    scale = float(jnp.mean(jnp.asarray(out, jnp.float32) ** 2))
    print(f"\n== mma: accumulator fit, mosaic kernel, Δ=0, N={n}, heads={heads}, q_len={q_len}, d=128, "
          f"forward S=448, B=128 (fresh accumulator per block), interpret={interpret} ==")
    print(f"{'bits':>5} {'mean sq. diff':>14} {'rel. to mean sq. out':>21}")
    for b in grid:
        print(f"{'exact' if b == 0 else b:>5} {err[b]:>14.4e} {err[b] / scale:>21.3e}")
    tied = [b for b in grid if err[b] <= FIT_RESOLUTION * scale]
    print(f"fitted accumulator: {'exact FP32' if best == 0 else f'{best} mantissa bits (truncation)'}"
          + (f" (within FP32 rounding: {', '.join('exact' if b == 0 else str(b) for b in tied)})" if tied else ""))
    return best, err


#: The ``fp8_params`` keys of JAX's FP8 attention (``FP8Params`` in fused_attention_stablehlo.py).
FP8_PARAM_KEYS = ("amax_dQ", "amax_dK", "amax_dV", "amax_dP", "descale_q", "descale_k", "descale_v", "descale_s",
                  "scale_s", "scale_o", "descale_o", "descale_dO", "descale_dP", "scale_dQ", "scale_dK", "scale_dV",
                  "scale_dP")
#: scale_s values the ``cudnn`` part runs: JAX's tests' 1, FA4-like 16, the saturation-free 128 at τ = 4.
CUDNN_SCALES = (1.0, 16.0, 128.0)


def fp8_params(scale_s: float) -> dict:
    """JAX's ``fp8_params`` with every scale 1 (as its tests build them) except ``scale_s`` and its inverse."""
    params = {k: jnp.ones((1, 1, 1, 1), jnp.float32) for k in FP8_PARAM_KEYS}
    params["scale_s"] = jnp.full((1, 1, 1, 1), scale_s, jnp.float32)
    params["descale_s"] = jnp.full((1, 1, 1, 1), 1.0 / scale_s, jnp.float32)
    return params


def compare_cudnn(kernel_out, sims: dict, ref) -> dict:
    """MSE of the kernel and of each simulated preset against ``ref``, and kernel − preset mismatch.

    Everything is compared after rounding to E4M3 (the FP8 kernel's output type) so that the output
    rounding is common to both; returns {"kernel": mse, name: (mse, mismatch)}.
    """
    from pcast_jax import formats

    def r(x):
        return formats.cast(jnp.asarray(x, jnp.float32), "e4m3")

    k = r(kernel_out)
    out = {"kernel": _mse(k, ref)}
    for name, sim in sims.items():
        s = r(sim)
        out[name] = (_mse(s, ref), float(jnp.mean((s - k) ** 2)))
    return out


def run_cudnn(args) -> dict:
    """JAX's cuDNN FP8 attention beside the cuDNN presets on the same FP8 inputs (BTNH layout)."""
    from pcast_jax.jax_fp8 import cudnn_config

    n, heads = (256, 2) if args.cpu_smoke else (4096, 8)
    w = sink_qkv(jax.random.key(11), deltas=[9.0], heads=heads, kv_heads=heads, q_len=n, n=n)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (w.q, w.k, w.v))
    scores = jnp.einsum("bhqd,bhnd->bhqn", q32, k32, precision=jax.lax.Precision.HIGHEST) * w.softmax_scale
    ref = engine.reference_attention(scores, v32)
    print(f"\n== cudnn: JAX's FP8 attention (cuDNN) vs the cuDNN presets, Δ={w.delta[0]:.3f}, N={n}, heads={heads}, "
          f"d=128, 4 sink tokens, output compared in E4M3 ==")
    results = {}
    for scale_s in CUDNN_SCALES:
        sims = {f"tau{t:g}": engine.attention(scores, v32, cudnn_config(scale_s, rescale_threshold=t)).out
                for t in (0.0, 4.0)}
        if args.cpu_smoke:
            kernel = sims["tau4"]  # the harness against a stand-in: cuDNN needs a GPU
        else:
            from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

            def bthd(x):
                return jnp.swapaxes(x, 1, 2)

            out, _, _ = cudnn_attention(bthd(w.q), bthd(w.k), bthd(w.v), fp8_params=fp8_params(scale_s),
                                        scale=w.softmax_scale, use_fp8=True, qkv_layout="BTNH")
            kernel = bthd(out)
        res = compare_cudnn(kernel, sims, ref)
        results[scale_s] = res
        fit = min(sims, key=lambda name: res[name][1])
        print(f"scale_s={scale_s:g}: kernel MSE {res['kernel']:.4e}; " + "; ".join(
            f"preset {name}: MSE {res[name][0]:.4e}, mean sq. diff to kernel {res[name][1]:.3e}" for name in sims)
            + f" -> closer: {fit}" + (" (stand-in: cuDNN not run)" if args.cpu_smoke else ""))
    return results


#: ``scale_s`` values the fingerprint step reads JAX's cuDNN FP8 attention at.
FINGERPRINT_SCALES = (1.0, 32.0)


def cudnn_black_box(scale_s: float, scale: float, *, stand_in: bool):
    """``fn(q, k, v)`` running JAX's cuDNN FP8 attention on FP8 copies of the probes (BTNH layout), its
    output as cuDNN returns it (E4M3); ``stand_in``: the ``cudnn_fp8`` preset through the simulator
    instead, its output rounded to E4M3 likewise (the harness without a GPU)."""
    import ml_dtypes

    from pcast_jax import fingerprint
    from pcast_jax.jax_fp8 import cudnn_config

    if stand_in:
        cfg = cudnn_config(scale_s)

        def fn(q, k, v):
            ps = fingerprint.ProbeSet(q=q, k=k, v=v, sinks=None, scale=scale, causal=False, seed=0)
            return fingerprint.simulate_outputs(ps, cfg).astype(ml_dtypes.float8_e4m3fn)

        return fn
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

    def fn(q, k, v):
        q8, k8, v8 = (jnp.asarray(x).astype(jnp.float8_e4m3fn) for x in (q, k, v))
        out, _, _ = cudnn_attention(q8, k8, v8, fp8_params=fp8_params(scale_s), scale=scale, use_fp8=True,
                                    qkv_layout="BTNH")
        return np.asarray(out)

    return fn


def run_fingerprint(args) -> dict:
    """Fingerprints JAX's cuDNN FP8 attention at ``scale_s`` 1 and 32, beside the ``cudnn_fp8`` preset's
    assumptions (B, τ, S_eff); on CPU (``--cpu-smoke``) a simulated stand-in takes its place."""
    from pcast_jax import fingerprint
    from pcast_jax.jax_fp8 import cudnn_config

    head_dim = 64 if args.cpu_smoke else 128
    scale = 0.125  # a power of two: the probes' logits stay exact
    found = {}
    for scale_s in FINGERPRINT_SCALES:
        fn = cudnn_black_box(scale_s, scale, stand_in=args.cpu_smoke)
        fp = fingerprint.identify(fn, head_dim=head_dim, scale=scale)
        want = cudnn_config(scale_s)
        found[scale_s] = fp
        print(f"\n== fingerprint: JAX's cuDNN FP8 attention, scale_s={scale_s:g}, head dim {head_dim}"
              + (" (stand-in: cuDNN not run)" if args.cpu_smoke else "") + " ==")
        print(fp.summary())
        print(f"cudnn_fp8 preset assumes: B={want.block_kv}, tau={want.rescale_threshold:g} ({want.rescale_unit}, "
              f"compensation {want.rescale_compensation}), sink {want.sink_mode}, S_eff={want.effective_scale:g}; "
              f"read: B={fp.config.block_kv}, tau={fp.config.rescale_threshold:g}, "
              f"S_eff={fp.config.effective_scale:g}")
    return found


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    status = 0
    for part, fn in (("timing", run_timing), ("table2", run_table2), ("mma", run_mma), ("cudnn", run_cudnn),
                     ("fingerprint", run_fingerprint)):
        if args.part in (part, "all"):
            try:
                fn(args)
            except Exception:
                traceback.print_exc(file=sys.stdout)
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
