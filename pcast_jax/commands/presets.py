"""``pcast presets``: the kernel presets and what each does at the P-cast."""

from __future__ import annotations

import argparse

from pcast_jax.presets import FAMILIES, PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--show", default=None, metavar="NAME",
                        help="print one preset as key=value,... (the form --config takes) and its fields")
    parser.add_argument("--head-dim", default=None, metavar="D",
                        help="with --show: the preset as it runs at head dim D (the KV tile its kernel picks "
                             "there; the name stays the preset's)")


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


def show(name: str, head_dim: int | None = None) -> list[str]:
    """``NAME``'s ``--config`` string, then every field with its value (one per line); with ``head_dim``,
    the preset as it runs at that head dim (:func:`pcast_jax.presets.preset_for`: its KV tile there)."""
    import dataclasses

    from pcast_jax.presets import TILES_BY_HEAD_DIM, resolve

    cfg = resolve(name, head_dim=head_dim)
    lines = [cfg.to_string(), ""]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        mark = "" if f.name == "name" or value != f.default else "  (default)"
        lines.append(f"{f.name:<16} {value!r}{mark}")
    if head_dim is not None:
        tiles = TILES_BY_HEAD_DIM.get(name)
        where = (f"its kernel's tiles by head dim: {', '.join(f'{d}: {b}' for d, b in sorted(tiles.items()))}"
                 if tiles else "the kernel keeps one tile at every head dim read")
        lines += ["", f"At head dim {head_dim} `{name}` runs block_kv = {cfg.block_kv} ({where})."]
    return lines


def run(args: argparse.Namespace) -> int:
    if args.head_dim is not None and args.show is None:
        from pcast_jax.errors import PcastError

        raise PcastError("--head-dim goes with --show NAME (the preset as it runs at that head dim)")
    if args.show is not None:
        from pcast_jax.commands import _options

        head_dim = None if args.head_dim is None else _options.integer("--head-dim", args.head_dim, min_value=1)
        for line in show(args.show.strip(), head_dim):
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
