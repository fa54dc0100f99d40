"""One row per compiled kernel and the table ``pcast kernels`` prints."""

from __future__ import annotations

import dataclasses
from typing import Iterable

from pallas_kernels.machine_code.lowering import PRODUCTS
from pallas_kernels.machine_code.parse import ProductMMA

__all__ = ["KernelReport", "format_table"]


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """One row of the report: a backend × config × warps × stages compiled for Hopper.

    Machine-code fields are ``None`` where no cubin could be built (``note`` says why).
    """

    backend: str
    config: str
    shape: str
    num_warps: int | None
    num_stages: int | None
    registers: int | None
    spill_stores: int | None
    spill_loads: int | None
    stack_frame: int | None
    shared: int | None
    products: tuple[ProductMMA, ...]
    sass_fp8_mma: int | None
    sass_other_mma: int | None
    e4m3_unpacks: int | None
    compiler: str
    max_num_imprecise_acc: tuple[int, ...] = ()
    note: str = ""

    @property
    def mma_kind(self) -> str:
        kinds = {p.kind for p in self.products if p.product in PRODUCTS}
        return kinds.pop() if len(kinds) == 1 else "/".join(p.kind for p in self.products)

    def product(self, name: str) -> ProductMMA:
        return next(p for p in self.products if p.product == name)


def _cell(value, unit: str = "") -> str:
    return "—" if value is None else f"{value}{unit}"


def format_table(reports: Iterable[KernelReport]) -> str:
    """The reports as an aligned text table, then one line per distinct compiler and note.

    Columns: registers per thread; spill stores/loads and stack frame (bytes, ``ptxas -v``);
    shared memory per CTA (bytes); the MMA kind of each product and its FP8 / converted-operand
    MMA instructions (PTX, per ``tt.dot``); the FP8 and other tensor-core instructions of the
    whole SASS; the E4M3→F16 unpacks in the SASS.
    """
    head = ("backend", "config", "shape", "warps", "stages", "regs", "spill st/ld", "stack", "smem",
            "MMA Q·Kᵀ", "MMA P8·V", "FP8 MMA QK/PV", "conv. MMA QK/PV", "SASS FP8/other MMA", "E4M3→F16",
            "compiler")
    rows, compilers, notes = [], [], []
    for r in reports:
        if r.compiler not in compilers:
            compilers.append(r.compiler)
        if r.note and r.note not in notes:
            notes.append(r.note)
        names = [p.product for p in r.products]
        if PRODUCTS[0] in names and PRODUCTS[1] in names:
            qk, pv = r.product(PRODUCTS[0]), r.product(PRODUCTS[1])
            kinds = (qk.kind, pv.kind)
            fp8, conv = f"{qk.fp8}/{pv.fp8}", f"{qk.converted}/{pv.converted}"
        else:  # the kernel's MMAs in total (no line information to split them by product)
            total = r.products[0]
            kinds = (total.kind, total.kind)
            fp8, conv = f"Σ {total.fp8}", f"Σ {total.converted}"
            note = "Σ: MMAs of the whole kernel (XLA's PTX carries no line information to split them by product)"
            if note not in notes:
                notes.append(note)
        spills = "—" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
        sass_mma = "—" if r.sass_fp8_mma is None else f"{r.sass_fp8_mma}/{r.sass_other_mma}"
        rows.append((
            r.backend, r.config, r.shape, _cell(r.num_warps), _cell(r.num_stages), _cell(r.registers), spills,
            _cell(r.stack_frame), _cell(r.shared), *kinds, fp8, conv, sass_mma, _cell(r.e4m3_unpacks),
            f"[{compilers.index(r.compiler) + 1}]",
        ))
    widths = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (head, *rows)]
    lines += [f"[{i}] {c}" for i, c in enumerate(compilers, start=1)]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)

