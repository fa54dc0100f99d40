"""``pcast theory``: the paper's closed forms for one (Δ, S), one quantity per line."""

from __future__ import annotations

import argparse
import json
import math

from pcast_jax import numberline
from pcast_jax.errors import check_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--delta", type=float, default=7.0,
                        help="sink strength Δ: sink logit gap over the non-sink mean (default 7)")
    parser.add_argument("--scale", type=float, default=256.0,
                        help="static P-scale S applied before the FP8 cast (default 256)")
    parser.add_argument("--ksink", "--k-sink", dest="k_sink", type=int, default=4,
                        help="number of sink tokens k_sink (default 4)")
    parser.add_argument("--sigma", type=float, default=1.0,
                        help="standard deviation σ of the scores (default 1, the paper's model)")
    parser.add_argument("--n", type=int, default=4096,
                        help="KV length N for the reverse-order bound and the non-sink mass "
                             "(default 4096)")
    parser.add_argument("--fmt", default="e4m3", choices=tuple(dict.fromkeys(numberline.P_FORMATS)),
                        help="format of the P cast: an element format (default e4m3, the paper's) or a "
                             "block-scaled one (mxfp8, mxfp4, nvfp4: their own closed forms)")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="output format: one quantity per line, or one JSON object with the same numbers "
                             "(default text)")


#: The value of a bound an MX format never reaches (its E8M0 scale cannot underflow: the bound lies
#: below float32's range): printed as these words, null in JSON.
NEVER = "never (E8M0 has no zero)"


def _num(value) -> str:
    v = float(value)
    if v != 0.0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.6e}"
    return f"{v:.6f}"


def _text(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return value if isinstance(value, str) else _num(value)


def rows(*, delta: float, scale: float, k_sink: int, sigma: float, n: int, fmt: str):
    """The printed table as ``(label, reference, value text, meaning)`` tuples."""
    return [(label, ref, _text(value), meaning)
            for label, ref, value, meaning in quantities(delta=delta, scale=scale, k_sink=k_sink, sigma=sigma,
                                                         n=n, fmt=fmt)]


def quantities(*, delta: float, scale: float, k_sink: int, sigma: float, n: int, fmt: str):
    """``(label, reference, value, meaning)`` tuples: a float, a bool (power_of_two) or :data:`NEVER`."""
    from pcast_jax import theory  # imports JAX: here, so that `pcast theory --help` does not

    check_int("k_sink", k_sink, min_value=1)
    check_int("n", n, min_value=k_sink + 1)
    if fmt.lower() in numberline.BLOCK_FORMATS:
        return _block_rows(theory, delta=delta, scale=scale, k_sink=k_sink, sigma=sigma, n=n, fmt=fmt.lower())
    f = numberline.get_format(fmt)
    common = dict(k_sink=k_sink, sigma=sigma, fmt=fmt)
    dk = theory.delta_k(k_sink)
    frac = theory.collapse_fraction(delta, scale, **common)
    frac_spread = theory.collapse_fraction_spread(delta, scale, **common)
    delta_c = theory.critical_delta(scale, **common)
    s_thr = theory.underflow_threshold(delta, scale, **common)
    p_thr = theory.underflow_p_threshold(scale, fmt=fmt)
    step = theory.dp(scale, fmt=fmt)
    exact = bool(theory.is_bit_exact_scale(scale))
    coverage = theory.normal_coverage(scale, fmt=fmt)
    rev = theory.reverse_underflow_prob(n, scale, **common)
    rev_mean = theory.reverse_underflow_prob(n, scale, max_model="mean", **common)
    mass = theory.non_sink_mass(delta, n=n, k_sink=k_sink, sigma=sigma)
    rtz_exp = round(-math.log2(f.round_to_zero))
    normal_exp = round(-math.log2(f.smallest_normal))
    best_dp_exp = f.mantissa_bits + 1
    dp_ref = "Def. 1, Eq. (17)" if scale <= f.max else "Remark 3, Eq. (18)"
    return [
        ("delta_k", "Eq. (3)", float(dk),
         f"expected max of the {k_sink} sink scores, in units of sigma"),
        ("F(delta,S)", "Eq. (7)", float(frac),
         "fraction of non-sink P cast to zero, forward order (mean sink max)"),
        ("F_spread(delta,S)", "Eq. (7) + spread", float(frac_spread),
         "same, integrated over the per-row spread of the sink max"),
        ("delta_c", "Eq. (7), Sec. 7.2", float(delta_c),
         f"critical sink strength {rtz_exp} ln2 + ln S - sigma*delta_k, where F = 1/2"),
        ("s_threshold", "Prop. 1, Eq. (6)", float(s_thr),
         "forward order: a non-sink score s below this underflows"),
        ("P_threshold", "Prop. 1, Eq. (5)", float(p_thr),
         f"P <= 2^-{rtz_exp}/S casts to zero"),
        ("dp(S)", dp_ref, float(step),
         f"worst-case quantization step of P in [0,1] (max LSB / S); minimum 2^-{best_dp_exp}"),
        ("power_of_two", "Prop. 5", exact,
         "x*S and x*(1/S) exact in FP32" if exact else "x*S and x*(1/S) round in FP32"),
        ("normal_coverage", "Sec. 5.3 (C3)", float(coverage),
         f"P below 2^-{normal_exp}/S lands in the subnormal range (smaller is better)"),
        ("non_sink_mass", "Table 1", float(mass),
         f"share of softmax mass on the {n - k_sink} non-sink tokens (N={n})"),
        ("reverse_underflow", "Thm. 4, Eq. (14)", float(rev),
         f"reverse order: P(non-sink P zeroed before the sink block), m = sqrt(2 ln(N-k)), N={n}"),
        ("reverse_underflow_mean", "Thm. 4 + Eq. (3)", float(rev_mean),
         "same with m = exact E[max of N-k normals]"),
    ]


def _block_rows(theory, *, delta: float, scale: float, k_sink: int, sigma: float, n: int, fmt: str):
    """The closed forms of a block-scaled P format (theory.block_*), as :func:`rows` prints them."""
    bf = numberline.BLOCK_FORMATS[fmt]
    common = dict(fmt=fmt, k_sink=k_sink, sigma=sigma)
    return [
        ("F_block(delta,S)", "cf. Eq. (7)", float(theory.block_collapse_fraction(delta, scale, n=n, **common)),
         f"fraction of non-sink P the {fmt} cast zeroes, forward order"),
        ("delta_c_block", "cf. Eq. (7)", NEVER if bf.is_mx else float(theory.block_critical_delta(scale, **common)),
         "sink strength at which the typical block's scale underflows"),
        ("scale_underflow", "block scale", NEVER if bf.is_mx else float(theory.block_scale_underflow(scale, fmt=fmt)),
         "a block whose largest P (row max = 1) is at or below this is zeroed whole"),
        ("element_threshold", "block element", float(theory.block_element_threshold(1.0, fmt=fmt)),
         f"in a block whose max is 1, elements at or below this cast to 0 ({bf.block} keys per "
         f"{bf.scale_fmt.name.upper()} scale)"),
        ("dp_block", "cf. Def. 1", float(theory.block_dp(fmt)),
         "worst-case quantization step relative to the block max"),
        ("non_sink_mass", "Table 1", float(theory.non_sink_mass(delta, n=n, k_sink=k_sink, sigma=sigma)),
         f"share of softmax mass on the {n - k_sink} non-sink tokens (N={n})"),
    ]


def run(args: argparse.Namespace) -> int:
    inputs = dict(delta=args.delta, scale=args.scale, k_sink=args.k_sink, sigma=args.sigma, n=args.n, fmt=args.fmt)
    if args.format == "json":
        from pcast_jax import report

        values = {label: {"value": None if value == NEVER else report.json_value(value), "reference": ref,
                          "meaning": meaning}
                  for label, ref, value, meaning in quantities(**inputs)}
        print(json.dumps({"inputs": inputs, "quantities": values}, indent=2, ensure_ascii=False))
        return 0
    table = rows(**inputs)
    print(f"pcast theory: delta={args.delta:g} scale={args.scale:g} k_sink={args.k_sink} "
          f"sigma={args.sigma:g} n={args.n} fmt={args.fmt}")
    w_label = max(len(r[0]) for r in table)
    w_ref = max(len(r[1]) for r in table)
    w_val = max(len(r[2]) for r in table)
    for label, ref, value, meaning in table:
        print(f"{label:<{w_label}}  {ref:<{w_ref}}  {value:>{w_val}}  {meaning}")
    return 0
