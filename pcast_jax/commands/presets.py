"""``pcast presets``: the kernel presets and what each does at the P-cast."""

from __future__ import annotations

import argparse

from pcast_jax.presets import FAMILIES, PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--show", default=None, metavar="NAME",
                        help="print one preset as key=value,... (the form --config takes) and its fields")


def rows() -> list[tuple[str, ...]]:
    """(family, name, order, S, scale mode, block_kv, power of two, accumulator, description), one row per
    preset, grouped by kernel family (the module of :mod:`pcast_jax.presets` that holds it)."""
    out = []
    for group, names in FAMILIES.items():
        for name in names:
            cfg = PRESETS[name]
            dynamic = cfg.scale_mode == "dynamic"
            out.append((
                group,
                name,
                cfg.order,
                "2^k per block" if dynamic else f"{cfg.scale:g}",
                cfg.scale_mode,
                str(cfg.block_kv),
                "yes" if dynamic or cfg.scale_is_power_of_two else "no",
                cfg.accumulator,
                cfg.describe(),
            ))
    return out


def show(name: str) -> list[str]:
    """``NAME``'s ``--config`` string, then every field with its value (one per line)."""
    import dataclasses

    from pcast_jax.presets import get_preset

    cfg = get_preset(name)
    lines = [cfg.to_string(), ""]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        mark = "" if f.name == "name" or value != f.default else "  (default)"
        lines.append(f"{f.name:<16} {value!r}{mark}")
    return lines


def run(args: argparse.Namespace) -> int:
    if args.show is not None:
        for line in show(args.show.strip()):
            print(line)
        return 0
    head = ("family", "name", "order", "S", "scale mode", "block_kv", "pow2 S", "PV acc", "description")
    table = rows()
    widths = [max(len(r[i]) for r in (head, *table)) for i in range(len(head))]
    for r in (head, *table):
        print("  ".join(f"{cell:<{w}}" for cell, w in zip(r, widths)).rstrip())
    print("Q, K, V stay FP32 in every preset (the P-cast in isolation); ℓ sums pre-cast P except in the "
          "exponent mode, where it sums the scaled values.")
    print("`pcast presets --show NAME` prints a preset as key=value,...: edit it and pass it to "
          "`pcast sweep --config`.")
    return 0
