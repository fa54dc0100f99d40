"""Table 3 — the production kernels the paper names, and our simulated MSE for each preset.

Design choices (order, S, 2^k?) come from :data:`pcast_jax.config.KERNEL_PRESETS`, which follow
each kernel's public source; the paper's Table 3 entry sits beside them, with a note wherever the
preset follows the source rather than the paper. MSE at Δ = 7 for N = 4096 and 16384 (20 seeds,
Q/K/V in FP32, the same draws for every preset). Presets whose semantics equal one of the paper's
five configurations reuse that configuration's sweep; presets equal to each other run once.
"""

from __future__ import annotations

import numpy as np

from pcast_jax.config import KERNEL_PRESETS, PAPER_CONFIGS
from pcast_jax.stats import mean_sem

from .common import SINK_DELTA, Column, Context, Finding, Section, Table, mse_by_length, spec_for

NAME = "table3_kernels"
TITLE = "Table 3 — production FP8 attention kernels"

#: preset → (implementation as the paper names it, paper's order, paper's S, paper's status,
#: where the preset follows the kernel's source rather than the paper).
PAPER = {
    "fa3": ("FlashAttention-3", "Rev", "256", "Optimal",
            "S folded into exp2 (ℓ holds S), B = 224 at d = 128; P·S equals multiply mode up to FP32 rounding"),
    "fa4": ("FlashAttention-4", "Rev", "256", "Optimal",
            "as FlashAttention-3 (paper lists FA3/4 as one row)"),
    "hpc_ops": ("hpc-ops (updated)", "Fwd", "256", "Optimal", ""),
    "hpc_ops_prior": ("hpc-ops (prior)", "Fwd", "1", "S=1 baseline", ""),
    "flashinfer_sm90": ("FlashInfer", "Rev", "448", "Near-optimal",
                        "order: reverse, from the source and this table; the paper's Table 2 / Fig. 2 "
                        "label \"Forward, S=448 — FlashInfer/TRT\" implies forward. B = 192 at d = 128"),
    "trtllm_xqa": ("TensorRT-LLM XQA", "Fwd", "448", "Suboptimal scale", "one CTA per row (multi-block off)"),
    "trtllm_xqa_multiblock": ("TensorRT-LLM XQA, multi-block decode", "Fwd", "448", "Suboptimal scale",
                              "8 sub-sequences dealt KV tiles round-robin, each forward with its own max, "
                              "LSE-merged: only one sees the sink tile first"),
    "fa3_splitkv": ("FlashAttention-3, split-KV (num_splits = 8)", "Rev", "256", "Optimal",
                    "contiguous KV ranges, each reverse, LSE-merged"),
    "sageattn2": ("SageAttention2", "Fwd", "448", "Suboptimal scale",
                  "S = 2^8.807 ≈ 447.9 folded into exp2 (source); INT8 Q/K not modelled"),
    "sageattn2pp": ("SageAttention2++ (§2.2, not in Table 3)", "—", "112", "—",
                    "S: the source keeps 2^8.807 ≈ 448 with an FP16 PV accumulator (V scaled per channel "
                    "to 2.25, f16 rounded per 32 keys); the paper's S = 112 is not in the released code"),
    "dynamic_pow2": ("per-block dynamic 2^k (§7.4 future work)", "—", "—", "—",
                     "no released kernel; per row and block the largest 2^k with max P·2^k ≤ 448"),
}


#: preset → where its KV tile B (at head dim d = 128) comes from (see pcast_jax/config.py).
TILE_SOURCE = {
    "fa3": "hopper/tile_size.h tile_size_fwd_sm90, FP8 branch, d ≤ 128 (160 at d = 64)",
    "fa4": "assumption (not read from source)",
    "flashinfer_sm90": "hopper/quantization/prefill_sm90.cuh CTA_KV, d = 128 (128 at d = 64/256)",
    "trtllm_xqa": "xqa/mha_sm90.cu gemm0CtaTileNbTokens = 64",
    "trtllm_xqa_multiblock": "xqa/mha_sm90.cu gemm0CtaTileNbTokens = 64; 8 strided sub-sequences (assumed launch)",
    "fa3_splitkv": "as fa3; 8 contiguous splits (assumed num_splits)",
    "sageattn2": "assumption (not re-read from source)",
    "sageattn2pp": "assumption (not re-read from source); f16 rounded per 32 keys",
    "hpc_ops": "assumption (not re-read from source)",
    "hpc_ops_prior": "assumption (not re-read from source)",
    "dynamic_pow2": "the paper's B = 64",
}


def _order(cfg):
    return "Rev" if cfg.order == "reverse" else "Fwd"


def _scale(cfg):
    return "dynamic" if cfg.scale_mode == "dynamic" else f"{cfg.scale:.4g}"


def run(ctx: Context) -> Section:
    s = ctx.sizes
    presets = dict(KERNEL_PRESETS)
    # which presets are one of the paper's configs, which equal an earlier preset, which must run
    source: dict[str, tuple[str, str]] = {}  # preset -> ("paper" | "kernels", config name)
    to_run = []
    for name, cfg in presets.items():
        paper = next((p for p, pc in PAPER_CONFIGS.items() if cfg == pc), None)
        twin = next((u for u in to_run if cfg == presets[u]), None)
        if paper is not None:
            source[name] = ("paper", paper)
        elif twin is not None:
            source[name] = ("kernels", twin)
        else:
            to_run.append(name)
            source[name] = ("kernels", name)
    res = None
    if to_run:
        res = ctx.sweep("kernels", spec_for(s, configs=tuple(presets[n] for n in to_run),
                                             deltas=(SINK_DELTA,), ns=s.ns_table3, seeds=s.seeds,
                                             expected_mse=False))

    def values(metric, name, n):
        kind, cfg = source[name]
        if kind == "paper":
            return mse_by_length(ctx, metric, cfg)[n]
        return np.asarray(res.get(metric, config=cfg, n=n, delta=SINK_DELTA), np.float64)

    rows, md_rows = [], []
    mean = {}
    for name, cfg in presets.items():
        impl, p_order, p_scale, p_status, note = PAPER[name]
        kind, cfg_from = source[name]
        row = {"preset": name, "implementation": impl, "order": _order(cfg), "scale": _scale(cfg),
               "power_of_two": cfg.scale_mode != "dynamic" and cfg.scale_is_power_of_two,
               "scale_mode": cfg.scale_mode, "block_kv": cfg.block_kv, "accumulator": cfg.accumulator,
               "kv_splits": cfg.kv_splits, "split_layout": cfg.split_layout if cfg.kv_splits > 1 else "",
               "tile_source": f"B = {cfg.block_kv}: {TILE_SOURCE.get(name, 'assumption')}",
               "paper_order": p_order, "paper_scale": p_scale, "paper_status": p_status,
               "follows_source_not_paper": note,
               "computed_as": cfg_from if kind == "paper" else (cfg_from if cfg_from != name else "")}
        md = {k: row[k] for k in ("implementation", "preset", "order", "scale", "paper_order", "paper_scale",
                                  "paper_status", "follows_source_not_paper", "tile_source")}
        md["power_of_two"] = "dyn. 2^k" if cfg.scale_mode == "dynamic" else ("✓" if row["power_of_two"] else "×")
        for n in s.ns_table3:
            m, se = mean_sem(values("mse", name, n))
            mean[name, n] = m
            row[f"mse_n{n}"] = m
            row[f"mse_sem_n{n}"] = se
            row[f"frac_zeroed_n{n}"] = float(np.mean(values("frac_zeroed", name, n)))
            md[f"mse_n{n}"] = f"{m * 1e5:.3f} ± {se * 1e5:.3f}"
        rows.append(row)
        md_rows.append(md)
    for n in s.ns_table3:
        best = min(mean[p, n] for p in presets)
        for row, md in zip(rows, md_rows):
            row[f"ratio_to_best_n{n}"] = mean[row["preset"], n] / best
            md[f"ratio_n{n}"] = f"{mean[row['preset'], n] / best:.2f}×"

    cols = [Column("implementation", "Implementation"), Column("preset", "preset"),
            Column("order", "order"), Column("scale", "S"), Column("power_of_two", "2^k?"),
            Column("paper_order", "paper order"), Column("paper_scale", "paper S"),
            Column("paper_status", "paper status")]
    for n in s.ns_table3:
        cols += [Column(f"mse_n{n}", f"MSE ×10⁻⁵ N={n}"), Column(f"ratio_n{n}", "/ best")]
    cols.append(Column("follows_source_not_paper", "preset vs paper (from the source)"))
    cols.append(Column("tile_source", "KV tile and its source"))

    # the paper's ranking in MSE terms: S=256 kernels < S≈448 kernels < the S=1 baseline
    findings = []
    groups = {"Optimal": ("fa3", "fa4", "hpc_ops"),
              "S=448": ("flashinfer_sm90", "trtllm_xqa", "sageattn2"),
              "S=1 baseline": ("hpc_ops_prior",)}
    for n in s.ns_table3:
        g = {k: [mean[p, n] for p in v] for k, v in groups.items()}
        ordered = max(g["Optimal"]) < min(g["S=448"]) and max(g["S=448"]) < min(g["S=1 baseline"])
        gain_xqa = mean["trtllm_xqa", n] / mean["hpc_ops", n]
        gain_fi = mean["flashinfer_sm90", n] / mean["fa3", n]
        near_vs_sub = mean["flashinfer_sm90", n] / mean["trtllm_xqa", n]
        findings.append(Finding(
            f"Table 3 (N={n}): S=256 kernels beat the S=448 ones, which beat S=1; switching "
            "S=448 → 256 gains 10–15%",
            "Optimal < Near-optimal < Suboptimal < S=1 baseline; 10–15%",
            ("S=256 < S=448 < S=1 holds" if ordered else "S=256 < S=448 < S=1 does not hold")
            + f"; XQA (fwd 448) / hpc-ops (fwd 256) = {gain_xqa:.2f}×, FlashInfer (rev 448) / FA3 "
              f"(rev 256) = {gain_fi:.2f}×; Near-optimal FlashInfer / Suboptimal XQA = {near_vs_sub:.3f} "
              "(reverse order adds nothing once S=448 prevents the collapse)",
            "yes" if ordered and all(1.08 <= x <= 1.2 for x in (gain_xqa, gain_fi)) else
            ("partly" if ordered else "no")))
    reused = [f"{p} = {source[p][1]}" for p in presets if source[p][0] == "paper" or source[p][1] != p]
    intro = (f"Kernel presets (`pcast presets`) at Δ = 7, {s.seeds} seeds, q_len = {s.q_len}, d = {s.d}, "
             f"Q/K/V in FP32, every preset on the same draws. MSE × 10⁻⁵ ± standard error; \"/ best\" "
             "divides by the lowest MSE in the column. The paper's columns are its Table 3; the last "
             "column says where our preset follows the kernel's released source rather than the paper. "
             f"Computed once and shared: {', '.join(reused)}.")
    return Section(NAME, TITLE, intro, tables=[Table("table3_kernels", rows, cols, md_rows=md_rows)],
                   findings=findings)


if __name__ == "__main__":
    from .command import main

    raise SystemExit(main([NAME]))
