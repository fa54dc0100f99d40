"""An independent float64 NumPy implementation of the paper's Algorithm 1 (the test oracle).

Written from the paper (§2.1 Eq. (1)–(2) for the number line, Algorithm 1 for the kernel, §6.1 for
ℓ from pre-cast P) and from each kernel's documented P-cast placement; it imports nothing from
``pcast_jax`` or ``pallas_kernels`` and not even ``ml_dtypes``: the FP8 number line is built from the
bit layout and rounding is a search on it. The engines and the Pallas kernels share
``pcast_jax.block``, so a test that they agree says nothing about that shared code; agreement with
this oracle does.

Because the oracle computes in float64 and the package in float32, a value lying within float32
rounding of a decision point (an FP8 rounding midpoint, the round-to-zero boundary, an f16
midpoint) may be decided differently. :func:`attention` returns the slack such values can explain,
so a comparison stays exact everywhere else.
"""

from __future__ import annotations

import dataclasses

import numpy as np

#: Relative distance from a decision point below which float32 and float64 may decide differently.
NEAR = 2.0**-20
#: The unit roundoff of float32.
U32 = 2.0**-24


@dataclasses.dataclass(frozen=True)
class Fp8Line:
    """A sign-magnitude 8-bit float: every non-negative finite value, sorted (index = code)."""

    exponent_bits: int
    mantissa_bits: int
    bias: int
    values: np.ndarray  # non-negative finite values in code order: 0, subnormals, normals
    special: float = np.nan  # what "nan" overflow gives past the range (None: saturates, no such code)

    @property
    def max(self) -> float:
        return float(self.values[-1])


def _line(exponent_bits: int, mantissa_bits: int, bias: int, *, fn: bool, finite: bool = False) -> Fp8Line:
    """Eq. (1): subnormals 2^(1−b)·M/2^m, normals 2^(E−b)·(1 + M/2^m); ``fn``: only all-ones is NaN;
    ``finite``: every code is a number (E2M1: no NaN, no infinity)."""
    vals = []
    top = 2**exponent_bits - 1
    for e in range(0, top + 1):
        for mant in range(2**mantissa_bits):
            if finite:
                pass
            elif fn and e == top and mant == 2**mantissa_bits - 1:
                continue  # E4M3FN: S.1111.111 is NaN, no infinities
            if not fn and e == top:
                continue  # IEEE-like E5M2: the top exponent holds inf and NaN
            if e == 0:
                vals.append(2.0 ** (1 - bias) * mant / 2**mantissa_bits)
            else:
                vals.append(2.0 ** (e - bias) * (1 + mant / 2**mantissa_bits))
    special = None if finite else (np.nan if fn else np.inf)
    return Fp8Line(exponent_bits, mantissa_bits, bias, np.array(vals, np.float64), special)


E4M3 = _line(4, 3, 7, fn=True)  # max 448 = 1.75 · 2^8, smallest subnormal 2^-9
E5M2 = _line(5, 2, 15, fn=False)  # max 57344
E2M1 = _line(2, 1, 1, fn=True, finite=True)  # 0, 0.5, 1, 1.5, 2, 3, 4, 6
#: E4M3FNUZ (ROCm): bias 8, every code but the negative-zero pattern (NaN) is a number: max 240.
E4M3FNUZ = dataclasses.replace(_line(4, 3, 8, fn=True, finite=True), special=np.nan)
#: Fixed-point P (TensorRT's INT8 quantize: roundWithTiesToEven(clip(x, −128, 127)); LiteRT's softmax
#: output, int8 codes with zero point −128, is 0 … 255 for P ≥ 0): the integers, which saturate.
INT8 = Fp8Line(0, 7, 0, np.arange(128, dtype=np.float64), special=None)
UINT8 = Fp8Line(0, 8, 0, np.arange(256, dtype=np.float64), special=None)
LINES = {"e4m3": E4M3, "e4m3fnuz": E4M3FNUZ, "e5m2": E5M2, "e2m1": E2M1, "int8": INT8, "uint8": UINT8}

#: Block-scaled P formats: (element line, keys per scale, scale kind). MX: OCP Microscaling v1.0
#: (E8M0 power of two); NVFP4: UE4M3 scale of block amax / 6 (NVIDIA Model Optimizer).
BLOCKED = {"mxfp8": (E4M3, 32, "e8m0"), "mxfp4": (E2M1, 32, "e8m0"), "nvfp4": (E2M1, 16, "ue4m3")}


def round_fp8(x, line: Fp8Line, overflow: str = "satfinite"):
    """Round float64 ``x`` to the nearest value of ``line``, ties to the even code.

    Returns (rounded values, mask of inputs within ``NEAR`` of a rounding midpoint or of max).
    ``"satfinite"`` saturates to ±max; ``"nan"`` gives NaN (E4M3FN) or ±inf (E5M2) past the
    midpoint above max (a tie there rounds to max when max has an even code).
    """
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    vals = line.values
    idx = np.clip(np.searchsorted(vals, a), 1, len(vals) - 1)
    lo, hi = vals[idx - 1], vals[idx]
    mid = (lo + hi) / 2
    pick_hi = (a > mid) | ((a == mid) & (idx % 2 == 0))
    r = np.where(pick_hi, hi, lo)
    near = np.abs(a - mid) <= NEAR * np.maximum(a, vals[1])
    top_lsb = vals[-1] - vals[-2]
    over = a > line.max
    if overflow == "satfinite":
        r = np.where(over, line.max, r)
    else:
        past = (a > line.max + top_lsb / 2) | ((a == line.max + top_lsb / 2) & ((len(vals) - 1) % 2 == 1))
        if line.special is None:  # no NaN or infinity to give: saturates either way
            past = np.zeros_like(past)
        r = np.where(past, line.special if line.special is not None else 0.0, np.where(over, line.max, r))
        near |= np.abs(a - (line.max + top_lsb / 2)) <= NEAR * a
    return np.sign(x) * r, near


def _emax(line: Fp8Line) -> int:
    """Exponent of the line's largest normal (8 for E4M3, 2 for E2M1), from its bit layout."""
    return int(np.floor(np.log2(line.max)))


def block_cast(x, p_format: str, overflow: str = "satfinite"):
    """A block-scaled cast of float64 ``x`` (..., n) along the last axis, from the specifications.

    MX (OCP Microscaling v1.0 §6.3): per 32 values X = 2^(floor(log2 amax) − emax_elem), the exponent
    held in [−126, 127] (E8M0 reaches −127, a float32 subnormal the package's XLA flushes; X = 1 for an
    all-zero block); elements rounded to the element
    line, clamped to its max normal. NVFP4 (Model Optimizer): per 16 values s = E4M3(amax / 6)
    (saturating, 1 for an all-zero block), elements E2M1(x / s); s = 0 zeroes the block.

    Returns (dequantized values, their rounding step there, mask of values within ``NEAR`` of a
    rounding decision of element or scale, mask of values whose zero/non-zero decision is near).
    """
    line, bs, kind = BLOCKED[p_format]
    x = np.asarray(x, np.float64)
    xb = x.reshape(x.shape[:-1] + (x.shape[-1] // bs, bs))
    amax = np.abs(xb).max(axis=-1)
    rtz = line.values[1] / 2
    with np.errstate(divide="ignore", invalid="ignore"):
        if kind == "e8m0":
            _, e = np.frexp(amax)  # amax = f 2^e, f in [0.5, 1): floor(log2 amax) = e − 1
            scale = np.where(amax > 0, 2.0 ** np.clip(e - 1 - _emax(line), -126, 127), 1.0)
            near_s = np.zeros(amax.shape, bool)
            over = "satfinite"
        else:
            scale, near_s = round_fp8(amax / line.max, E4M3, "satfinite")
            near_s |= np.abs(amax / line.max - E4M3.values[1] / 2) <= NEAR * E4M3.values[1]
            scale = np.where(amax > 0, scale, 1.0)
            over = overflow
        y = xb / np.where(scale > 0, scale, 1.0)[..., None]
        q, near = round_fp8(y, line, over)
        q = np.where((scale > 0)[..., None], q, 0.0)
        step = _step(y, line) * scale[..., None]
        near_zero = (np.abs(np.abs(y) - rtz) <= NEAR * rtz) | near_s[..., None]
        near = near | near_s[..., None]
        step = np.where(near_s[..., None], np.abs(xb) / 4 + step, step)  # a scale one E4M3 step away
        deq = q * scale[..., None]
    shape = x.shape
    return deq.reshape(shape), step.reshape(shape), near.reshape(shape), near_zero.reshape(shape)


@dataclasses.dataclass
class OracleResult:
    out: np.ndarray  # (q, d)
    row_sum: np.ndarray  # (q,)
    n_zeroed: np.ndarray  # (q,)
    zeroed_mass: np.ndarray  # (q,)
    out_slack: np.ndarray  # (q, d): largest |Δout| near-ties can explain
    zeroed_slack: np.ndarray  # (q,): how many zeroed decisions sit at the boundary
    n_saturated: np.ndarray | None = None  # (q,): visible P·S above the element max (element formats)
    saturated_mass: np.ndarray | None = None  # (q,): their exact probability
    zeroed_mass_slack: np.ndarray | None = None  # (q,): the mass of the zeroed decisions at the boundary
    saturated_mass_slack: np.ndarray | None = None  # (q,): the mass of the saturated decisions at the max

    n_keys: int = 0  # the keys of a row

    def mass_tolerance(self, which: str = "zeroed") -> np.ndarray:
        """(q,): what a float32 kernel's zeroed (or ``"saturated"``) mass may differ by from this one: the
        slack (every key within float32 error of its decision counts whole) plus float32 accumulation over N
        keys, (2N + 8)u of the mass (the mass and ℓ each summed over N keys, exp and the division a few ulp),
        plus 2^-60 where both are zero."""
        mass, slack = ((self.zeroed_mass, self.zeroed_mass_slack) if which == "zeroed"
                       else (self.saturated_mass, self.saturated_mass_slack))
        return (2 * self.n_keys + 8) * U32 * np.abs(mass) + slack + 2.0**-60


def attention(scores, v, *, order="forward", scale=1.0, scale_mode="multiply", block_kv=64,
              p_format="e4m3", overflow="satfinite", accumulator="f32", causal=False,
              count_mask=None, kv_splits=1, split_layout="contiguous", f16_round_keys=0,
              v_channel_max=0.0, mma_acc_bits=0, mma_promote_keys=0, visible=None, sink_logit=None,
              sink_mode="epilogue", rescale_threshold=0.0, rescale_unit="log2",
              rescale_compensation="none", sink_prescale="exp2", p_offset="running_max", softmax="f32",
              # query tiles: the tile-amax scale and skip-softmax
              block_q=0, skip_softmax_threshold=0.0) -> OracleResult:
    """Algorithm 1 for every query row of ``scores`` (q, N) against ``v`` (N, d), in float64.

    ``scale_mode``: ``"multiply"`` casts P·S and divides by S·ℓ (ℓ of unscaled P);
    ``"exponent"`` scales P itself by S (so ℓ holds S) and divides by ℓ; ``"dynamic"`` scales
    each row of each block by the largest 2^k with rowmax(P)·2^k ≤ max, divides that block's
    product by 2^k, and divides by ℓ. ``accumulator="f16"`` rounds each block's P8·V to float16.
    Causal masks are bottom-right aligned (query i sits at position N − q + i). ``visible`` (q, N)
    bool hides keys besides (False = masked: its score is −inf). A row that sees no key outputs 0
    with ℓ = 0 and zeroed mass 0, as a FlashAttention epilogue gives (1/ℓ taken as 1 for ℓ = 0).

    Split-KV (``kv_splits`` > 1): the blocks are dealt to the splits, ``"contiguous"`` (split s takes
    blocks s·c … s·c + c − 1, c = ceil(n_blocks / kv_splits)) or ``"strided"`` (split s takes blocks
    s, s + kv_splits, …); each split runs the loop below on its blocks in ``order`` and ends with its
    own O_s / (S ℓ_s); the splits are then combined with weights exp(m_s − max m)·ℓ_s normalised to 1.
    ``f16_round_keys`` > 0: inside a block the f16 accumulator adds that many keys' exact product at a
    time and rounds the running block sum to float16 after each. ``v_channel_max`` > 0 (f16 only):
    V is divided per column by max|V[:, c]| / v_channel_max before the products and the output
    multiplied back by it.

    FP8 MMA accumulator model (``mma_acc_bits`` = b > 0, FP32 accumulator only): the MMA adds
    32 keys' exact products at a time to its running sum and keeps b mantissa bits of it, cut
    toward zero (:func:`truncate`). ``mma_promote_keys`` = 0: that running sum is O itself, across
    blocks (it starts each block as α·O); k > 0: every k keys a fresh running sum starts at 0 and
    its final value is added to O exactly.

    Learned sink ``sink_logit`` s_L (a number; the reference is softmax over [s_L, scores] without the
    sink's column): ``"epilogue"`` adds exp(s_L − m) (×S in the exponent mode) to the merged ℓ once;
    ``"init_max"`` starts split 0 at m = s_L, ℓ = 1 (×S); ``"block_max"`` raises every block's max to
    s_L (blocks with a visible key) and adds the sink to ℓ once, like ``"epilogue"``.
    Lazy rescale: with ``rescale_threshold`` τ > 0 the running max moves only when a block's max exceeds
    it by more than τ (times ln 2 for ``rescale_unit="log2"``); ``rescale_compensation="pow2"`` makes
    the scale S·2^-τ. P·S above the element max saturates (counted for element formats).
    ``sink_prescale="exp"`` (exponent mode): the sink's ×S is e^(log2 S) instead (fmha_v2's non-exp2f path).

    Query tiles: rows 0..block_q−1, block_q..2·block_q−1, … of ``scores`` form one tile each.
    ``scale_mode="tile_amax"`` (aiter's Triton MHA FP8): per tile and block a = max(10^-9, the largest P
    of the tile's rows), P·(max/a) is cast and the block's product multiplied by a/max; a last partial
    tile is filled with rows whose logits are 0 (zero Q) on every key the tile's last row sees, each
    run like a row of its own (its running max from the sink where the split starts there, the sink in
    its block maxima with ``"block_max"``): P = 1 without a sink, exp(−max(s_L, 0)) with one.
    ``skip_softmax_threshold`` λ > 0: a row votes to skip a block when it sees no key of it
    or exp(block max − m) < λ with its running max m before the block (m = −inf: no vote); when every
    row of the tile votes (filling rows do), the block is dropped from those rows.

    ``p_offset="block_max"``: each block's P is exp(Z − its own max), and its ΣP and P8·V are multiplied
    by β = exp(block max − running max) when added (JAX's TPU ragged paged attention). ``"row_lse"``:
    P = exp(Z − m_row) / Σ_row exp(Z − m_row), the normalised softmax of the whole row (a learned sink one
    more column of it), is cast, and the output is Σ P8·V / S (no division by ℓ). ``softmax="f16"``: P
    (S·P in the exponent mode) is rounded to float16, then P·S is, before the cast; ℓ sums the float16 P.
    """
    if rescale_compensation == "pow2":
        scale = scale * 2.0**-rescale_threshold
    gap = rescale_threshold * (np.log(2.0) if rescale_unit == "log2" else 1.0)
    line = BLOCKED[p_format][0] if p_format in BLOCKED else LINES[p_format]
    s = np.asarray(scores, np.float64)
    v = np.asarray(v, np.float64)
    q, n = s.shape
    d = v.shape[1]
    counted = np.ones((q, n), bool) if count_mask is None else np.broadcast_to(count_mask, (q, n)).copy()
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    if causal:
        visible = np.arange(n)[None, :] <= np.arange(q)[:, None] + (n - q)
        s = np.where(visible, s, -np.inf)
        counted &= visible
    pad = (-n) % block_kv
    s = np.pad(s, ((0, 0), (0, pad)), constant_values=-np.inf)
    v = np.pad(v, ((0, pad), (0, 0)))
    counted = np.pad(counted, ((0, 0), (0, pad)))
    n_blocks = s.shape[1] // block_kv
    colscale = np.ones(d)
    if accumulator == "f16" and v_channel_max:
        amax = np.abs(v).max(axis=0)
        colscale = np.where(amax > 0, amax / v_channel_max, 1.0)
        v = v / colscale
    if kv_splits == 1:
        members = [list(range(n_blocks))]
    elif split_layout == "contiguous":
        c = -(-n_blocks // kv_splits)
        members = [list(range(i * c, min(i * c + c, n_blocks))) for i in range(kv_splits)]
    else:
        members = [list(range(i, n_blocks, kv_splits)) for i in range(kv_splits)]
    group = f16_round_keys or block_kv
    mma = (mma_acc_bits, mma_promote_keys)
    sink_factor = 1.0
    if scale_mode == "exponent":
        sink_factor = np.exp(np.log2(scale)) if sink_prescale == "exp" else scale
    sink = (sink_logit, sink_mode, gap, sink_factor)
    tiles = (block_q, skip_softmax_threshold)
    row = None
    if p_offset == "row_lse":  # the first pass: the row's max and sum (the sink a column of it), in float64
        with np.errstate(invalid="ignore"):
            m_row = s.max(axis=1) if sink_logit is None else np.maximum(s.max(axis=1), sink_logit)
            m_row_ok = np.where(m_row == -np.inf, 0.0, m_row)
            ell_row = np.exp(s - m_row_ok[:, None]).sum(axis=1)
            if sink_logit is not None:
                ell_row = ell_row + np.exp(sink_logit - m_row_ok)
        row = (m_row, np.where(ell_row > 0, ell_row, 1.0))
    runs = [_one_split(s, v, counted, blks[::-1] if order == "reverse" else blks, line, block_kv, group,
                       scale, scale_mode, overflow, accumulator, p_format, mma, sink=sink, first=i == 0,
                       tiles=tiles, p_offset=p_offset, row=row, f16=softmax == "f16")
            for i, blks in enumerate(members)]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m_all = np.max([r[0] for r in runs], axis=0)
        m_ok = np.where(m_all == -np.inf, 0.0, m_all)
        out = np.zeros((q, d))
        out_slack = np.zeros((q, d))
        ell = np.zeros(q)
        lz = np.zeros(q)
        ls = np.zeros(q)
        ell_sl = np.zeros(q)
        lz_sl = np.zeros(q)
        ls_sl = np.zeros(q)
        wsum = []
        for m, ell_s, o, _nz, lz_s, slack, _zs, _ns, ls_s, ell_slack, lz_slack, ls_slack in runs:
            w = np.where(ell_s > 0, np.exp(m - m_ok) * ell_s, 0.0)
            div = scale * ell_s if scale_mode == "multiply" else ell_s
            if p_offset == "row_lse":  # P was normalised before the cast: O / S
                div = np.where(ell_s > 0, scale, 0.0)
            div = np.where(div > 0, div, 1.0)
            wsum.append((w, o / div[:, None], slack / div[:, None]))
            ell += np.where(ell_s > 0, np.exp(m - m_ok), 0.0) * ell_s
            ell_sl += np.where(ell_s > 0, np.exp(m - m_ok), 0.0) * ell_slack
            lz += np.where(ell_s > 0, np.exp(m - m_ok), 0.0) * lz_s
            ls += np.where(ell_s > 0, np.exp(m - m_ok), 0.0) * ls_s
            lz_sl += np.where(ell_s > 0, np.exp(m - m_ok), 0.0) * lz_slack
            ls_sl += np.where(ell_s > 0, np.exp(m - m_ok), 0.0) * ls_slack
        if sink_logit is not None and sink_mode != "init_max":  # the sink's column, once, at the merged max
            ell += np.exp(sink_logit - m_ok) * sink_factor / (
                row[1] if row is not None else 1.0)  # row_lse: its share of the normalised softmax
        share = np.where(ell > 0, ell, 1.0)  # a row with nothing visible: every w is 0, the output 0
        for w, o_s, sl in wsum:
            if p_offset == "row_lse":  # one split whose P already holds the row's normalisation (the sink's too)
                w = np.where(ell > 0, share, 0.0)
            out += (w / share)[:, None] * o_s
            out_slack += (w / share)[:, None] * sl
        nz = sum(r[3] for r in runs)
        zslack = sum(r[6] for r in runs)
        if len(runs) > 1:  # the merge's own FP32 rounding, a few ulps of the output
            out_slack = out_slack + 4 * 2.0**-24 * np.abs(out)
        out_slack = out_slack + np.abs(out) * (ell_sl / share)[:, None]  # ℓ of float16 P near a midpoint
        ns = sum(r[7] for r in runs)
        return OracleResult(out * colscale, ell, nz, lz / share, out_slack * colscale, zslack, ns, ls / share,
                            lz_sl / share, ls_sl / share, n)


def _f16(x):
    """float64 ``x`` rounded to float16 (ties to even), and the mask of values within NEAR of a midpoint."""
    h = np.asarray(x, np.float64).astype(np.float16).astype(np.float64)
    ulp = np.spacing(np.abs(h).astype(np.float16)).astype(np.float64)
    off = np.abs(np.abs(x) - np.abs(h))
    tol = NEAR * np.maximum(np.abs(x), 2.0**-24)
    near = (np.abs(off - ulp / 2) <= tol) | (np.abs(off - ulp / 4) <= tol)  # ulp / 4: below a power of two
    return h, near, ulp


def _one_split(s, v, counted, blocks, line, block_kv, group, scale, scale_mode, overflow, accumulator, p_format,
               mma=(0, 0), sink=(None, "epilogue", 0.0, 1.0), first=True, tiles=(0, 0.0), p_offset="running_max",
               row=None, f16=False):
    """Algorithm 1 over ``blocks`` (in visiting order): (m, ℓ, O, zeroed, zeroed mass, slack, zeroed slack,
    saturated, saturated mass, ℓ slack)."""
    q = s.shape[0]
    d = v.shape[1]
    sink_logit, sink_mode, gap, sink_factor = sink
    block_q, lam = tiles
    m = np.full(q, -np.inf)
    ell = np.zeros(q)
    if sink_logit is not None and sink_mode == "init_max" and first:
        m = np.full(q, float(sink_logit))
        ell = np.full(q, sink_factor)
    ns = np.zeros(q, np.int64)
    ls = np.zeros(q)
    o = np.zeros((q, d))
    nz = np.zeros(q, np.int64)
    lz = np.zeros(q)
    slack = np.zeros((q, d))  # in units of the accumulator, carried by α like O
    zslack = np.zeros(q, np.int64)
    ell_slack = np.zeros(q)  # |Δℓ| that float16 near-ties can explain, carried by α like ℓ
    lz_slack = np.zeros(q)  # the zeroed mass of decisions at the boundary, carried by α like the mass
    ls_slack = np.zeros(q)  # likewise, the saturated mass of decisions at the max
    if row is not None:  # P normalised by the row's own max and sum: the running max is the row's throughout
        m = row[0].copy()
    m_fill = m[-1] if q else -np.inf  # a filling row of a partial query tile starts where every row does
    rtz = line.values[1] / 2  # values at or below this round to zero (the tie goes to the even 0)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for j in blocks:
            cols = slice(j * block_kv, (j + 1) * block_kv)
            z, vj = s[:, cols], v[cols]
            if lam:  # skip-softmax: the tile's rows all vote, against the max before this block
                zmax = z.max(axis=1)
                vote = (zmax == -np.inf) | ((m > -np.inf) & (np.exp(zmax - np.where(m > -np.inf, m, 0.0)) < lam))
                drop = _per_tile(vote.astype(np.float64), block_q, 1.0, np.min) > 0
                z = np.where(drop[:, None], -np.inf, z)
            bmax = z.max(axis=1)
            if sink_logit is not None and sink_mode == "block_max":
                bmax = np.where(bmax > -np.inf, np.maximum(bmax, sink_logit), bmax)
            m_new = np.maximum(m, bmax)
            if gap:  # lazy rescale: keep the old max unless the block's exceeds it by more than τ
                m_new = np.where(bmax - m > gap, m_new, m)
            m_safe = np.where(m_new == -np.inf, 0.0, m_new)
            a = np.exp(m - m_safe)
            beta = np.ones(q)
            m_p = m_safe
            if p_offset == "block_max":  # P against the block's own max, β applied after the product
                m_p = np.where(bmax == -np.inf, 0.0, bmax)
                beta = np.exp(bmax - m_safe)
            p = np.exp(z - m_p[:, None])
            if row is not None:
                p = p / row[1][:, None]
            unscale = np.ones(q)
            f16_near = np.zeros(p.shape, bool)
            f16_ulp = np.zeros(p.shape)
            if f16:
                p, f16_near, f16_ulp = _f16(p * scale if scale_mode == "exponent" else p)
            if scale_mode == "multiply":
                ps = p * scale
                if f16:
                    ps, near2, _ = _f16(ps)
                    f16_near |= near2
            elif scale_mode == "exponent":
                p = p if f16 else p * scale
                ps = p
            elif scale_mode == "tile_amax":  # one scale per tile of block_q rows, not a power of two
                # a zero-Q filling row, run like any row: logit 0 on the keys the last row sees
                z_fill = np.where(z[-1] > -np.inf, 0.0, -np.inf)
                b_fill = z_fill.max()
                if sink_logit is not None and sink_mode == "block_max" and b_fill > -np.inf:
                    b_fill = max(b_fill, sink_logit)
                if b_fill > m_fill and (not gap or b_fill - m_fill > gap):
                    m_fill = b_fill
                filler = np.exp(z_fill - (m_fill if m_fill > -np.inf else 0.0)).max()
                amax = np.maximum(_per_tile(p.max(axis=1), block_q, filler, np.max), 1e-9)
                ps = p * (line.max / amax)[:, None]
                unscale = amax / line.max
            else:  # dynamic power of two per row
                pmax = p.max(axis=1)
                k = np.floor(np.log2(line.max / np.where(pmax > 0, pmax, 1.0)))
                sc = 2.0 ** np.clip(k, 0, 126)
                ps = p * sc[:, None]
                unscale = 1.0 / sc
            ell = a * ell + beta * p.sum(axis=1)
            ell_slack = a * ell_slack + beta * (f16_near * f16_ulp).sum(axis=1)
            unscale = unscale * beta
            m = m_new
            if p_format in BLOCKED:  # the block scales are multiplied back after the product: same sum
                p8, step, near, near_zero = block_cast(ps, p_format, overflow)
                y_slack = (near * step) @ np.abs(vj)
            else:
                p8, near = round_fp8(ps, line, overflow)
                near = near | f16_near  # a float16 P one ulp apart may round to the next code
                key_slack = near * _step(ps, line)
                y_slack = key_slack @ np.abs(vj)
                near_zero = np.abs(ps - rtz) <= NEAR * rtz
            bits, promote = mma
            if bits:  # the FP8 MMA accumulator model
                groups = [(g, g + (promote or block_kv)) for g in range(0, block_kv, promote or block_kv)]
                start, start_slack = (a[:, None] * o, a[:, None] * slack) if not promote else (0.0, 0.0)
                y, y_slack = np.zeros((q, d)), np.zeros((q, d))
                for lo, hi in groups:
                    acc, acc_slack = start, start_slack
                    for k in range(lo, hi, MMA_K):
                        keys = slice(k, k + MMA_K)
                        acc, acc_slack = _mma_step(acc, acc_slack, p8[:, keys], vj[keys], key_slack[:, keys], bits)
                    y, y_slack = y + acc, y_slack + acc_slack
                if not promote:  # the chain already holds α·O
                    o, slack = y, y_slack
                else:
                    o = a[:, None] * o + y * unscale[:, None]
                    slack = a[:, None] * slack + y_slack * unscale[:, None]
            elif accumulator == "f16":  # one f16 MMA per group of keys, chained in f16
                y = np.zeros((q, d))
                for g in range(0, block_kv, group):
                    part = y + p8[:, g:g + group] @ vj[g:g + group]
                    y = part.astype(np.float16).astype(np.float64)
                    y_slack = y_slack + np.abs(part) * 2.0**-10  # one f16 ulp: f32 and f64 may round apart
            else:
                y = p8 @ vj
            if not bits:
                o = a[:, None] * o + y * unscale[:, None]
                slack = a[:, None] * slack + y_slack * unscale[:, None]
            zero = counted[:, cols] & (ps > 0) & (p8 == 0)
            nz += zero.sum(axis=1)
            lz = a * lz + beta * np.where(zero, p, 0.0).sum(axis=1)
            sat = (z > -np.inf) & (ps > line.max) & (p_format not in BLOCKED) & (scale_mode != "tile_amax")
            ns += sat.sum(axis=1)
            ls = a * ls + beta * np.where(sat, p, 0.0).sum(axis=1)
            near_zero = near_zero | (f16_near & (np.abs(ps - rtz) <= 2.0**-9 * rtz))
            zslack += (counted[:, cols] & (ps > 0) & near_zero).sum(axis=1)
            lz_slack = a * lz_slack + beta * np.where(counted[:, cols] & (ps > 0) & near_zero, p, 0.0).sum(axis=1)
            near_max = np.abs(ps - line.max) <= NEAR * line.max
            near_sat = (z > -np.inf) & near_max & (p_format not in BLOCKED) & (scale_mode != "tile_amax")
            ls_slack = a * ls_slack + beta * np.where(near_sat, p, 0.0).sum(axis=1)
    return m, ell, o, nz, lz, slack, zslack, ns, ls, ell_slack, lz_slack, ls_slack


def _per_tile(x, block_q: int, filler: float, reduce):
    """Each row's ``reduce`` over its tile of ``block_q`` rows (from row 0); a short last tile is filled
    with rows of value ``filler``."""
    out = np.empty_like(x)
    for t0 in range(0, len(x), block_q):
        part = list(x[t0:t0 + block_q])
        out[t0:t0 + block_q] = reduce(part + [filler] * (block_q - len(part)))
    return out


#: Keys per FP8 MMA instruction (Hopper wgmma / mma.sync with 8-bit operands: K = 32).
MMA_K = 32


def truncate(x, bits: int):
    """float64 ``x`` cut toward zero to ``bits`` mantissa bits after the leading one (frexp form)."""
    m, e = np.frexp(x)  # x = m 2^e, 0.5 <= |m| < 1
    return np.ldexp(np.trunc(np.ldexp(m, bits + 1)), e - bits - 1)


def _mma_step(acc, acc_slack, p8, v, key_slack, bits):
    """One MMA K-step: acc + P8·V (exact here), truncated to ``bits``; returns (acc, slack).

    The slack bounds |acc − the float32 simulator's acc|. Before truncating, the two sums differ by
    at most δ = (slack carried in) + (FP8 near-ties of these keys) + 2^-20·(|acc| + Σ|P8||V|)
    (float32 rounding of α·O and of the 32-term sum). Truncation snaps both to multiples of one
    unit u; they then differ by ⌊δ/u⌋ units, plus one more if a multiple of u lies within δ mod u of
    the exact sum.
    """
    x = acc + p8 @ v
    delta = acc_slack + key_slack @ np.abs(v) + NEAR * (np.abs(acc) + np.abs(p8) @ np.abs(v))
    _, e = np.frexp(np.abs(x) + delta)
    unit = np.ldexp(1.0, e - bits - 1)
    r = np.mod(np.abs(x), unit)
    whole = np.floor(delta / unit)
    crossing = np.minimum(r, unit - r) <= delta - whole * unit
    return truncate(x, bits), (whole + crossing) * unit


def _step(x, line: Fp8Line):
    """Spacing of ``line`` at |x| (the most a near-tie can move a rounded value)."""
    vals = line.values
    idx = np.clip(np.searchsorted(vals, np.abs(x)), 1, len(vals) - 1)
    return vals[idx] - vals[idx - 1]


def config_kwargs(cfg) -> dict:
    """The oracle's keyword arguments for a config-like object with the usual field names."""
    return {"order": cfg.order, "scale": cfg.scale, "scale_mode": cfg.scale_mode, "block_kv": cfg.block_kv,
            "p_format": cfg.p_format, "overflow": cfg.overflow, "accumulator": cfg.accumulator,
            "causal": cfg.causal, "kv_splits": cfg.kv_splits, "split_layout": cfg.split_layout,
            "f16_round_keys": cfg.f16_round_keys, "v_channel_max": cfg.v_channel_max,
            "mma_acc_bits": cfg.mma_acc_bits, "mma_promote_keys": cfg.mma_promote_keys,
            "sink_mode": getattr(cfg, "sink_mode", "epilogue"),
            "rescale_threshold": getattr(cfg, "rescale_threshold", 0.0),
            "rescale_unit": getattr(cfg, "rescale_unit", "log2"),
            "rescale_compensation": getattr(cfg, "rescale_compensation", "none"),
            "sink_prescale": getattr(cfg, "sink_prescale", "exp2"),
            "block_q": getattr(cfg, "block_q", 0),
            "skip_softmax_threshold": getattr(cfg, "skip_softmax_threshold", 0.0),
            "p_offset": getattr(cfg, "p_offset", "running_max"), "softmax": getattr(cfg, "softmax", "f32")}


def sink_scores(rng: np.random.Generator, *, q: int, n: int, d: int, delta: float, k_sink: int = 4):
    """Paper §3.1 scores: non-sink N(0, 1), the first ``k_sink`` keys Δ + N(0, 1); V ~ N(0, 1).

    Returns float32 scores (q, n), float32 v (n, d) and the non-sink mask (n,).
    """
    s = rng.standard_normal((q, n))
    s[:, :k_sink] += delta
    v = rng.standard_normal((n, d))
    mask = np.ones(n, bool)
    mask[:k_sink] = False
    return s.astype(np.float32), v.astype(np.float32), mask


__all__ = ["E2M1", "E4M3", "E4M3FNUZ", "E5M2", "INT8", "UINT8",
           "BLOCKED", "MMA_K", "block_cast", "Fp8Line", "HeadMasses", "OracleResult", "attention",
           "config_kwargs", "round_fp8", "sink_scores", "truncate"]


@dataclasses.dataclass(frozen=True)
class HeadMasses:
    """Per scale and query head (``[len(scales), Hq]`` each): the zeroed and clipped mass, and the slack."""

    zeroed: np.ndarray
    clipped: np.ndarray
    zeroed_slack: np.ndarray  # the largest |Δ zeroed| a float32 kernel can differ by from these float64 values
    clipped_slack: np.ndarray  # likewise for the clipped mass


def causal_head_masses(q, k, *, block_kv: int, scales, min_keys: int, rescale_gap: float = 0.0,
                       line: Fp8Line = E4M3) -> HeadMasses:
    """Per query head of one causal self-attention layer, the zeroed and clipped mass of a forward-order
    kernel with P·S cast to ``line`` (multiply mode), at every applied scale of ``scales`` in one pass.

    ``q [T, Hq, D]``, ``k [T, Hkv, D]`` (query head h reads KV head h // (Hq / Hkv)); logits q·k/√D rounded to
    float32 (what a kernel multiplies out), everything after in float64. A head's sink is the key receiving
    the most attention (the column sum of the causal softmax); the zeroed mass is the exact softmax
    probability of the non-sink keys whose P·S was positive and rounds to 0 (|P·S| at or below half the
    smallest subnormal, the tie to the even 0), the clipped mass that of every visible key whose P·S exceeds
    the line's max; each a mean over the query rows with at least ``min_keys`` visible non-sink keys.
    ``rescale_gap`` > 0: the lazy rescale, the running max moves only when a block's max exceeds it by more
    than that many logits (P may then exceed 1).

    The slack bounds what a float32 kernel may differ by, on any CPU and in any summation order. Its logit
    q·k/√D is off the float64 one by at most e = γ_D·Σ|q_i k_i|/√D + 1.5u|s| (γ_D = Du/(1 − Du), u = 2^-24:
    the dot product in any order, the division, this oracle's own rounding to float32), so ln(P·S) =
    s − m + ln S is off by at most ε = e_s + e_m + u|s − m| + 5u (the subtraction; exp and ×S, a few ulp).
    A key whose ln(P·S) lies within ε of ln(round-to-zero) or ln(max) may be decided either way: its whole
    exact probability is slack. A lazy-rescale test within ε of the gap may move the running max either way:
    every later key of that row is slack. Every other probability is off by at most (2ε + 3Tu) of itself
    (the exact softmax in float32, its sums over T keys and over rows).
    """
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    t, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    kx = np.repeat(k, group, axis=1)
    s = np.einsum("ihd,jhd->hij", q, kx) / np.sqrt(head_dim)
    s = s.astype(np.float32).astype(np.float64)
    gamma = head_dim * U32 / (1 - head_dim * U32)
    err = gamma * np.einsum("ihd,jhd->hij", np.abs(q), np.abs(kx)) / np.sqrt(head_dim) + 1.5 * U32 * np.abs(s)
    visible = np.tril(np.ones((t, t), bool))[None]
    s = np.where(visible, s, -np.inf)
    err = np.where(visible, err, 0.0)
    err_m = err.max(axis=-1)  # [Hq, T]: bounds the error of any running max of the row
    exact = np.exp(s - s.max(axis=-1, keepdims=True))
    exact /= exact.sum(axis=-1, keepdims=True)
    sink = np.argmax(exact.sum(axis=1), axis=-1)  # [Hq]
    counted = visible & (np.arange(t)[None, None, :] != sink[:, None, None])
    rows = counted.sum(axis=-1) >= min_keys  # [Hq, T]
    scales = np.asarray(scales, np.float64)[:, None, None, None]
    rtz = line.values[1] / 2
    zeroed = np.zeros((scales.shape[0], num_heads, t))
    clipped, zeroed_near, clipped_near = (np.zeros_like(zeroed) for _ in range(3))
    m = np.full((num_heads, t), -np.inf)
    unsure = np.zeros((num_heads, t), bool)  # a lazy-rescale test so far could have gone either way
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for b0 in range(0, t, block_kv):
            cols = slice(b0, b0 + block_kv)
            z = s[..., cols]
            bmax = z.max(axis=-1)
            if rescale_gap > 0:
                tie = np.abs(bmax - m - rescale_gap) <= 2 * err_m + U32 * np.abs(bmax - m) + 2 * U32
                unsure |= np.isfinite(m) & np.isfinite(bmax) & tie
            m = np.where(bmax - m > rescale_gap, np.maximum(m, bmax), m)
            m_safe = np.where(m == -np.inf, 0.0, m)
            p = np.exp(z - m_safe[..., None])
            ps = p[None] * scales
            eps = (err[..., cols] + err_m[..., None] + U32 * np.abs(z - m_safe[..., None]) + 5 * U32)[None]
            log_ps = np.log(ps)
            near_zero = (np.abs(log_ps - np.log(rtz)) <= eps) | unsure[None, ..., None]
            near_max = (np.abs(log_ps - np.log(line.max)) <= eps) | unsure[None, ..., None]
            zero = counted[None, ..., cols] & (ps > 0) & (ps <= rtz)
            over = visible[None, ..., cols] & (ps > line.max)
            mass = exact[None, ..., cols]
            zeroed += np.where(zero, mass, 0.0).sum(axis=-1)
            clipped += np.where(over, mass, 0.0).sum(axis=-1)
            zeroed_near += np.where(counted[None, ..., cols] & near_zero & ~zero, mass, 0.0).sum(axis=-1)
            clipped_near += np.where(visible[None, ..., cols] & near_max & ~over, mass, 0.0).sum(axis=-1)
    rel = 2 * np.where(visible, err + err_m[..., None], 0.0).max(axis=(-1, -2)) + 3 * t * U32  # [Hq]
    mean = np.where(rows, 1.0, np.nan)

    def per_head(x):
        with np.errstate(invalid="ignore"):
            return np.nanmean(x * mean, axis=-1)

    # a near key counts fully whichever way it went: the slack is its mass on the other side too
    zeroed_slack = per_head(zeroed_near) + per_head(np.where(unsure, zeroed, 0.0)) + rel * per_head(zeroed)
    clipped_slack = per_head(clipped_near) + per_head(np.where(unsure, clipped, 0.0)) + rel * per_head(clipped)
    return HeadMasses(per_head(zeroed), per_head(clipped), zeroed_slack, clipped_slack)
