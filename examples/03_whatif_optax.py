"""Learning the static P scale with jax.grad and optax

What static scale S should a forward-order FP8 attention kernel multiply P by before the E4M3
cast? This example learns log2 S by gradient descent: the objective is the expected output
error σ_V²·Σ(W − P)² of :mod:`pcast_jax.whatif` on synthetic sink workloads at one sink
strength Δ, made differentiable in log2 S by the smooth surrogate of the cast, and optax's Adam
takes the steps. The learned S is then checked with the exact (non-surrogate) simulator at the
neighbouring powers of two and compared with what the closed forms of :mod:`pcast_jax.theory`
call safe: the smallest power of two at which Eq. (7) zeroes almost no non-sink P, and the
largest at which P = 1 cannot saturate E4M3 (S = 256).

Run it with::

    .venv/bin/python examples/03_whatif_optax.py [--out DIR] [--delta 7] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pcast_jax import theory
from pcast_jax.whatif import Scenario, Surrogate, expected_mse

#: A forward-order kernel's collapse is "gone" once Eq. (7) zeroes less than this share of non-sink P.
COLLAPSE_LIMIT = 1e-3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for result.json (default: a temp dir)")
    parser.add_argument("--delta", type=float, default=7.0, help="sink strength Δ (logits)")
    parser.add_argument("--steps", type=int, default=60, help="Adam steps")
    parser.add_argument("--seeds", type=int, default=4, help="synthetic instances averaged per step")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="pcast_example03_"))
    out.mkdir(parents=True, exist_ok=True)

    scenario = Scenario(config="fwd_s1", n=1024, q_len=8, seeds=args.seeds)
    smooth = Surrogate(atoms="representable")  # the surrogate's P = 1 costs nothing below E4M3's max

    def loss(log2_scale):
        return jnp.mean(expected_mse(scenario, delta=args.delta, log2_scale=log2_scale, surrogate=smooth))

    start = float(loss(jnp.float32(0.0)))
    opt = optax.adam(0.3)

    @jax.jit
    def step(l2, state):
        value, grad = jax.value_and_grad(lambda v: loss(v) / start)(l2)  # normalised: Adam sees O(1)
        updates, state = opt.update(grad, state, l2)
        return jnp.clip(optax.apply_updates(l2, updates), 0.0, 8.5), state, value

    l2 = jnp.float32(0.0)
    state = opt.init(l2)
    for i in range(args.steps):
        l2, state, value = step(l2, state)
        if i % 20 == 0 or i == args.steps - 1:
            print(f"step {i:3d}: log2 S = {float(l2):5.2f}, surrogate MSE / MSE at S=1 = {float(value):.3f}")
    learned = float(l2)
    if not math.isfinite(learned):
        raise SystemExit("the search ended at a non-finite log2 S")

    # Exact check at the powers of two around the learned S (and at S = 1 and 256).
    powers = sorted({0, math.floor(learned), math.ceil(learned), 8})
    values = np.asarray(expected_mse(scenario, delta=args.delta, log2_scale=np.asarray([*powers, learned], np.float32),
                                     surrogate="exact")).mean(axis=-1)
    exact = {2**k: float(v) for k, v in zip(powers, values)}
    at_learned = float(values[-1])
    best = min(exact, key=exact.get)

    # What the closed forms call safe at this Δ.
    scales = 2.0 ** np.arange(0, 9)
    frac = np.asarray(theory.collapse_fraction(args.delta, scales))
    no_collapse = float(scales[np.argmax(frac < COLLAPSE_LIMIT)]) if np.any(frac < COLLAPSE_LIMIT) else None
    no_saturation = float(theory.saturation_free_scale(0.0))

    print(f"learned S = 2^{learned:.2f} = {2**learned:.1f} at delta = {args.delta:g} (fwd, N = {scenario.n})")
    for s, v in exact.items():
        print(f"  exact expected MSE at S = {s:5g}: {v:.3e} ({v / exact[1]:.3f} x S = 1)")
    print(f"  exact expected MSE at the learned S itself: {at_learned:.3e} ({at_learned / exact[1]:.3f} x S = 1): "
          "an S that is not an E4M3 value rounds the sink's P = 1")
    rounded = min((2.0 ** math.floor(learned), 2.0 ** math.ceil(learned)), key=exact.get)
    print(f"best power of two (exact): S = {best:g}; the learned S rounded to a power of two, {rounded:g}, is within "
          f"{abs(exact[rounded] / exact[best] - 1):.2%} of it: the objective is flat between them, "
          "so its gradient vanishes and the descent stops")
    collapse_text = f"from S = {no_collapse:g} on" if no_collapse is not None else "at no S <= 256"
    print(f"theory: Eq. (7) zeroes < {COLLAPSE_LIMIT:g} of non-sink P {collapse_text}; "
          f"P = 1 cannot saturate up to S = {no_saturation:g}")
    result = {"delta": args.delta, "learned_log2_scale": learned, "exact_mse": exact,
              "exact_mse_at_learned": at_learned, "best_power": best, "learned_rounded": rounded,
              "theory_no_collapse_scale": no_collapse, "theory_saturation_free_scale": no_saturation}
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    inside = no_collapse is not None and no_collapse <= rounded <= no_saturation
    print(f"OK: S = {rounded:g} costs {exact[rounded] / exact[1]:.3f}x the error of S = 1 and lies "
          f"{'inside' if inside else 'below' if no_collapse and rounded < no_collapse else 'outside'} the range "
          f"theory calls safe ({collapse_text}, up to {no_saturation:g}); result in {out / 'result.json'}")


if __name__ == "__main__":
    main()
