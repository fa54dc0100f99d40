"""``pcast fingerprint``: read a closed kernel's P-cast from its outputs on designed probes.

``pcast fingerprint probe --head-dim D --out probes.npz`` writes the probes; run the kernel on them
(q, k, v and, with ``--sinks``, sinks; ``jax.nn``'s (batch, tokens, heads, dim) layout) and save its
output as ``out`` in an ``.npz`` (or as a ``.npy``); ``pcast fingerprint fit probes.npz outputs.npz``
prints what the outputs say about the kernel. ``pcast fingerprint --preset NAME`` fits a preset's own
simulated outputs: which of its fields the probes decide, and which they leave open.
"""

from __future__ import annotations

import argparse
import json

from pcast_jax.commands import _options

#: Largest outputs file read: 256 MiB.
MAX_OUTPUTS_BYTES = 1 << 28


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None, metavar="NAME",
                        help="fit a preset's simulated outputs: which of its fields the probes decide")
    parser.add_argument("--head-dim", dest="head_dim", type=int, default=64,
                        help="head dim of the probes with --preset (default 64)")
    parser.add_argument("--sinks", action="store_true", help="with --preset: probes with learned sink logits")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    sub = parser.add_subparsers(dest="action", metavar="ACTION")

    p = sub.add_parser("probe", help="write the probes (q, k, v, sinks) as an .npz",
                       description="Write the probes (q, k, v and sinks) as an .npz for your kernel.")
    _options.add_probe_arguments(p, min_head_dim=36)
    p.add_argument("--out", required=True, metavar="FILE", help="where the probes go (.npz)")

    p = sub.add_parser("fit", help="fit a kernel's outputs on the probes",
                       description="Fit a kernel's outputs on the probes: its P-cast, field by field.")
    p.add_argument("probes", metavar="PROBES", help="the .npz 'pcast fingerprint probe' wrote")
    p.add_argument("outputs", metavar="OUTPUTS", help="the kernel's output: .npz with 'out' (or one array), or .npy")
    p.add_argument("--output-dtype", dest="output_dtype", default=None,
                   choices=("float32", "float16", "bfloat16", "e4m3", "e5m2"),
                   help="the type the kernel returned its output in, before you saved it (default: the saved "
                        "array's own type); each candidate is rounded to it")
    p.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")


def load_outputs(path: str):
    """The kernel's output array from ``path`` (.npy, or .npz holding ``out`` or a single array)."""
    from pcast_jax.errors import PcastError
    from pcast_jax.fileio import load_npy, load_npz

    what = f"outputs file {path!r}"
    if path.endswith(".npy"):
        return load_npy(path, what=what, max_bytes=MAX_OUTPUTS_BYTES)
    data = load_npz(path, what=what, max_bytes=MAX_OUTPUTS_BYTES)
    if "out" in data:
        return data["out"]
    if len(data) == 1:
        return next(iter(data.values()))
    raise PcastError(f"{what} holds {', '.join(sorted(data)) or 'nothing'}: save the kernel's output as 'out'")


def _print(fp, fmt: str) -> None:
    from pcast_jax import report

    if fmt == "json":
        print(json.dumps(report.json_value(fp.to_dict()), indent=2))
    else:
        print(fp.summary())


def run(args: argparse.Namespace) -> int:
    from pcast_jax import fingerprint
    from pcast_jax.errors import PcastError

    if args.action == "probe":
        from pcast_jax import report

        report.check_out_file(args.out)
        ps = fingerprint.probes(args.head_dim, scale=args.scale, causal=args.causal, sinks=args.sinks,
                                seed=args.seed)
        ps.save(args.out)
        names = "q, k, v" + (", sinks" if ps.sinks is not None else "")
        print(f"wrote {args.out}: {names}; q {ps.q.shape}, k/v {ps.k.shape} (batch, tokens, heads, dim), "
              f"scale {ps.scale:g}{', causal' if ps.causal else ''}")
        return 0
    if args.action == "fit":
        ps = fingerprint.ProbeSet.load(args.probes)
        fp = fingerprint.fit(ps, load_outputs(args.outputs), output_dtype=args.output_dtype, calls=1)
        _print(fp, args.format)
        return 0
    if args.preset is None:
        raise PcastError("pcast fingerprint needs an action (probe, fit) or --preset NAME")
    _print(fingerprint.explain_preset(args.preset, head_dim=args.head_dim, sinks=args.sinks), args.format)
    return 0
