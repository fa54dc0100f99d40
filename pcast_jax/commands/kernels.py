"""``pcast kernels``: the Pallas FP8 kernels compiled for Hopper on a machine without a GPU.

Per backend × config (× warps × stages): registers, spill bytes, stack frame, shared memory, the
MMA kind of Q·Kᵀ and P8·V, their FP8 tensor-core instructions against MMAs on converted operands,
and the compiler that produced the figures (see :mod:`pallas_kernels.machine_code`). The Triton kernel is
compiled by the ``triton`` wheel (``pip install triton==3.9.0``). ``--xla`` compiles both kernels with
XLA's own compilers, ahead of time for an H100 (``pip install jax-cuda12-plugin``, no GPU needed);
without it the Mosaic GPU kernel's row holds the wgmma of its lowered module only (the CPU jaxlib
cannot assemble it).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

from pcast_jax.commands import _options
from pcast_jax.presets import preset_for

HELP = "Compile the Pallas FP8 kernels for Hopper without a GPU: registers, spills, FP8 wgmma use."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sass", action="store_true",
                        help="accepted for clarity: the report always compiles to SASS where it can")
    _options.add_list_argument(parser, "--backends", choices=("triton", "mosaic"), default=["triton", "mosaic"],
                               metavar="B[,B]", help="triton, mosaic or both (default triton,mosaic)")
    _options.add_list_argument(parser, "--configs", default=["fa3", "fwd_s1"], metavar="PRESET[,PRESET]",
                               help="comma-separated kernel presets or paper configs (default fa3,fwd_s1)")
    parser.add_argument("--causal", action="store_true", help="compile the causal variant")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2, help="query heads (default 2)")
    parser.add_argument("--kv-heads", type=int, default=1, help="K/V heads (default 1: GQA 2:1)")
    parser.add_argument("--q-len", type=int, default=128)
    parser.add_argument("--n", type=int, default=512, help="keys N (default 512)")
    parser.add_argument("--head-dim", type=int, default=128)
    _options.add_list_argument(parser, "--num-warps", item_type=int, default=[None], metavar="W[,W]",
                               help="Triton warps to compile with, e.g. 4,8 (default: the kernel's own setting)")
    _options.add_list_argument(parser, "--num-stages", item_type=int, default=[None], metavar="S[,S]",
                               help="Triton pipeline stages, e.g. 2,3 (default: the kernel's own setting)")
    parser.add_argument("--max-num-imprecise-acc", type=int, default=None, metavar="K",
                        help="what-if: set this attribute of every tt.dot (Pallas emits 0; tl.dot uses 2^30 "
                             "on sm_90 for FP8)")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="keep TTIR, TTGIR, PTX, cubin, ptxas log and SASS of each Triton build here")
    parser.add_argument("--xla", action="store_true",
                        help="also compile both kernels with XLA's own compilers (its Triton, the Mosaic GPU "
                             "pipeline), ahead of time for an H100: needs jax-cuda12-plugin, no GPU")
    parser.add_argument("--format", choices=("table", "json"), default="table",
                        help="printed output: the aligned table, or one JSON object per row (default table)")
    _options.renamed(parser, "--json", "--format json")


def run(args: argparse.Namespace) -> int:
    import os

    import jax

    from pallas_kernels import machine_code as mc

    if mc.xla_available() and not os.environ.get("JAX_PLATFORMS"):
        # nothing here runs on a device; keeps the CUDA plugin from trying to start on a machine without one
        jax.config.update("jax_platforms", "cpu")

    shape = mc.KernelShape(batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, q_len=args.q_len,
                           n=args.n, head_dim=args.head_dim)
    reports = []
    for name in args.configs:
        cfg = preset_for(name, args.head_dim)  # the kernel's own KV block at this head dim
        if args.causal:
            cfg = cfg.replace(causal=True, name=f"{cfg.name}_causal")
        for backend in args.backends:
            cfg_b = cfg
            if backend == "mosaic":
                if args.xla:
                    reports.append(mc.xla_report("mosaic", cfg_b, shape)[0])
                else:
                    reports.append(mc.mosaic_report(cfg_b, shape))
                continue
            if args.xla:
                reports.append(mc.xla_report("triton", cfg_b, shape)[0])
            for warps, stages in itertools.product(args.num_warps, args.num_stages):
                keep = None
                if args.keep is not None:
                    keep = args.keep / f"{cfg_b.name}_w{warps or 'def'}_s{stages or 'def'}"
                report, _ = mc.triton_report(cfg_b, shape, num_warps=warps, num_stages=stages,
                                             max_num_imprecise_acc=args.max_num_imprecise_acc, workdir=keep)
                reports.append(report)
    if args.format == "json":
        for r in reports:
            print(json.dumps(dataclasses.asdict(r), ensure_ascii=False))
    else:
        print(mc.format_table(reports))
    return 0
