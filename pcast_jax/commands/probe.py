"""``pcast probe``: the P-collapse check (:mod:`pcast_jax.testing`) for a kernel run elsewhere.

``pcast probe write --head-dim D --out probes.npz`` writes the probes (q, k, v and, with ``--sinks``, sinks;
``jax.nn``'s (batch, tokens, heads, dim) layout); run the kernel on them and save its output as ``out`` in
an ``.npz`` (or as a ``.npy``); ``pcast probe check probes.npz outputs.npz`` prints the report: per Δ the
mass the cast lost and the output error, and the verdict with ``pcast doctor``'s criterion. With
``--fingerprint FP_PROBES FP_OUTPUTS`` (the kernel's output on ``pcast fingerprint probe``'s probes) it
also names the nearest preset and its closed-form Δc. Exit status 0 when the check passes, 1 when it
fails or is within noise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json

from pcast_jax.commands import _options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    p = sub.add_parser("write", help="write the P-collapse probes (q, k, v, sinks) as an .npz",
                       description="Write the P-collapse probes (q, k, v and sinks) as an .npz for your kernel.")
    _options.add_probe_arguments(p, min_head_dim=16)
    p.add_argument("--n-keys", dest="n_keys", type=int, default=None,
                   help="KV length of the probes (64 to 65536; default 4096: many KV blocks and splits)")
    p.add_argument("--delta", default=None,
                   help="sink strengths Δ, one query row each: 5,7,9 or start:stop:step (default 2:14:1)")
    p.add_argument("--replicates", type=int, default=None,
                   help="batch elements, each its own draw (2 to 256; default 16): the s.e. is over them")
    p.add_argument("--out", required=True, metavar="FILE", help="where the probes go (.npz)")

    p = sub.add_parser("check", help="the P-collapse report from a kernel's outputs on the probes",
                       description="The P-collapse report from a kernel's outputs on the probes 'pcast probe write' "
                                   "wrote: lost mass and output error per Δ, and the verdict. Exit status 1 unless "
                                   "it passes.")
    p.add_argument("probes", metavar="PROBES", help="the .npz 'pcast probe write' wrote")
    p.add_argument("outputs", metavar="OUTPUTS", help="the kernel's output: .npz with 'out' (or one array), or .npy")
    p.add_argument("--fingerprint", nargs=2, default=None, metavar=("FP_PROBES", "FP_OUTPUTS"),
                   help="the probes 'pcast fingerprint probe' wrote (same head dim, scale, causal and sinks) "
                        "and the kernel's output on them: names the nearest preset and its closed-form Δc")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="output format: the markdown report or JSON (default text)")


def _write(args: argparse.Namespace) -> int:
    from pcast_jax import report, testing

    report.check_out_file(args.out)
    kw = {}
    if args.delta is not None:
        kw["deltas"] = _options.floats("--delta", args.delta, max_count=64)
    if args.n_keys is not None:
        kw["n_keys"] = args.n_keys
    if args.replicates is not None:
        kw["replicates"] = args.replicates
    ps = testing.collapse_probes(args.head_dim, scale=args.scale, causal=args.causal, sinks=args.sinks,
                                 seed=args.seed, **kw)
    ps.save(args.out)
    names = "q, k, v" + (", sinks" if ps.sinks is not None else "")
    print(f"wrote {args.out}: {names}; q {ps.q.shape}, k/v {ps.k.shape} (batch, tokens, heads, dim), "
          f"scale {ps.scale:g}{', causal' if ps.causal else ''}")
    return 0


def _fingerprint(files, probes):
    """The kernel's Fingerprint from the fingerprint's probes and outputs (or None and why not)."""
    from pcast_jax import fingerprint
    from pcast_jax.commands.fingerprint import load_outputs
    from pcast_jax.errors import PcastError

    path, out_path = files
    try:
        ps = fingerprint.ProbeSet.load(path)
        outputs = load_outputs(out_path)
    except PcastError as exc:
        raise PcastError(f"--fingerprint: {exc}") from None
    mine = (probes.head_dim, probes.scale, probes.causal, probes.sinks is not None)
    theirs = (ps.head_dim, ps.scale, ps.causal, ps.sinks is not None)
    if mine != theirs:
        raise PcastError(f"--fingerprint {path!r}: its probes are for head dim, scale, causal, sinks = {theirs}, "
                         f"the P-collapse probes for {mine}; write both for the same kernel")
    try:
        return fingerprint.fit(ps, outputs, calls=1), None
    except PcastError as exc:
        if str(exc).startswith("outputs fit no candidate"):
            return None, str(exc)
        raise PcastError(f"--fingerprint: {exc}") from None


def _check(args: argparse.Namespace) -> int:
    from pcast_jax import report, testing
    from pcast_jax.commands.fingerprint import load_outputs

    probes = testing.CollapseProbes.load(args.probes)
    outputs = load_outputs(args.outputs)
    fp, why = (None, "not read: no --fingerprint files") if args.fingerprint is None else _fingerprint(
        args.fingerprint, probes)
    check = testing.evaluate(probes, outputs, fingerprint=fp, fingerprint_error=why)
    if args.format == "json":
        print(json.dumps(report.json_value(check.to_dict()), indent=2))
    else:
        print(check.summary())
    return 0 if check.safe is True else 1


def run(args: argparse.Namespace) -> int:
    from pcast_jax.errors import PcastError

    if args.action == "write":
        return _write(args)
    if args.action == "check":
        return _check(args)
    raise PcastError("pcast probe needs an action: write (the probes) or check (a kernel's outputs on them)")
