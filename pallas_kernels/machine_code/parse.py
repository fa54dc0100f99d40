"""Reading what the compilers print: ``ptxas -v`` reports, PTX listings and SASS listings.

Text in, figures out; nothing here runs a compiler.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from pathlib import Path

from pcast_jax.errors import PcastError

__all__ = [
    "ProductMMA",
    "PtxasResources",
    "SassSummary",
    "parse_ptx_mma",
    "parse_ptxas_log",
    "parse_sass",
    "product_mma",
    "ptx_mma_total",
]


@dataclasses.dataclass(frozen=True)
class PtxasResources:
    """What ``ptxas -v`` reports for the kernel (bytes unless said otherwise)."""

    registers: int
    stack_frame: int
    spill_stores: int
    spill_loads: int
    static_smem: int
    barriers: int


def parse_ptxas_log(log: str) -> PtxasResources:
    """Registers, stack frame, spills, static shared memory and barriers from ``ptxas -v``."""

    def first(pattern: str, default: int | None = 0) -> int:
        match = re.search(pattern, log)
        if match is None:
            if default is None:
                raise PcastError(f"ptxas -v output has no match for {pattern!r}:\n{log}")
            return default
        return int(match.group(1))

    return PtxasResources(
        registers=first(r"Used (\d+) registers", default=None),
        stack_frame=first(r"(\d+) bytes stack frame", default=None),
        spill_stores=first(r"(\d+) bytes spill stores", default=None),
        spill_loads=first(r"(\d+) bytes spill loads", default=None),
        static_smem=first(r"(\d+) bytes smem"),
        barriers=first(r"used (\d+) barriers"),
    )


_SASS_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")
_PTX_MMA = re.compile(r"\b(wgmma\.mma_async(?:\.[a-z0-9_]+)*|mma\.sync(?:\.[a-z0-9_]+)*)")
_PTX_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s")
_PTX_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]*)"', re.M)


def _is_fp8_type(instr: str) -> bool:
    """A PTX or SASS MMA whose operand types are FP8 (e4m3/e5m2)."""
    return re.search(r"e4m3|e5m2", instr, re.I) is not None


@dataclasses.dataclass(frozen=True)
class ProductMMA:
    """The tensor-core instructions one matrix product compiled to (PTX level).

    Attributes:
      product: "Q·Kᵀ" or "P8·V".
      kind: "wgmma" (Hopper warpgroup MMA, SASS HGMMA/QGMMA), "mma.sync" (per-warp MMA, SASS
        HMMA/QMMA) or "none".
      fp8: MMA instructions that take E4M3 (or E5M2) operands on the tensor core.
      converted: MMA instructions of the product on other types: its E4M3 operands were
        converted first (e.g. ``mma.sync…f16.f16`` fed by ``cvt.rn.f16x2.e4m3x2``).
      instructions: every MMA instruction of the product with its count.
    """

    product: str
    kind: str
    fp8: int
    converted: int
    instructions: tuple[tuple[str, int], ...] = ()


def product_mma(product: str, instructions: Counter) -> ProductMMA:
    """The :class:`ProductMMA` of ``product`` from its MMA instructions and their counts."""
    kind = ("wgmma" if any(i.startswith("wgmma") for i in instructions)
            else "mma.sync" if instructions else "none")
    fp8 = sum(n for i, n in instructions.items() if _is_fp8_type(i))
    return ProductMMA(product, kind, fp8, sum(instructions.values()) - fp8, tuple(sorted(instructions.items())))


def parse_ptx_mma(ptx: str, dot_lines: dict[int, str], source: str) -> tuple[ProductMMA, ...]:
    """MMA instructions of a PTX listing per product, attributed through its ``.loc`` lines.

    ``dot_lines`` maps a line of ``source`` (the file the compiler read, by name) to the product
    whose ``tt.dot`` sits on it. PTX keeps each instruction's source line exactly (the SASS line
    table does not: ptxas files a wgmma that reads registers under the line of their producer).
    MMAs on other lines are counted under "other".
    """
    files = {int(i) for i, path in _PTX_FILE.findall(ptx) if Path(path).name == Path(source).name}
    per_product: dict[str, Counter] = {name: Counter() for name in dot_lines.values()}
    line = None
    for text in ptx.splitlines():
        loc = _PTX_LOC.match(text)
        if loc:
            line = int(loc.group(2)) if int(loc.group(1)) in files else None
            continue
        for instr in _PTX_MMA.findall(text):
            per_product.setdefault(dot_lines.get(line, "other"), Counter())[instr] += 1
    return tuple(product_mma(name, instrs) for name, instrs in per_product.items())


@dataclasses.dataclass(frozen=True)
class SassSummary:
    """Kernel-wide instruction counts of a SASS listing."""

    fp8_mma: int  # QGMMA/QMMA with E4M3 (or E5M2) operands
    other_mma: int  # HGMMA/HMMA/IMMA/…: tensor-core instructions on non-FP8 operands
    e4m3_unpacks: int  # F2FP…E4M3…UNPACK: E4M3 pairs widened to F16
    local_stores: int  # STL (spills and stack)
    local_loads: int  # LDL
    opcodes: Counter

    def mma_opcodes(self) -> dict[str, int]:
        return {op: n for op, n in self.opcodes.items() if _is_sass_mma(op)}


def _is_sass_mma(op: str) -> bool:
    return re.match(r"([A-Z]GMMA|HMMA|QMMA|IMMA|DMMA|BMMA)\b", op) is not None


def parse_sass(sass: str) -> SassSummary:
    """Count the instructions of a ``cuobjdump -sass`` / ``nvdisasm`` listing."""
    total: Counter = Counter(m.group(1) for m in map(_SASS_INSTR.search, sass.splitlines()) if m)
    mma = {op: n for op, n in total.items() if _is_sass_mma(op)}
    fp8 = sum(n for op, n in mma.items() if _is_fp8_type(op))
    return SassSummary(
        fp8_mma=fp8,
        other_mma=sum(mma.values()) - fp8,
        e4m3_unpacks=sum(n for op, n in total.items() if op.startswith("F2FP") and "E4M3" in op and "UNPACK" in op),
        local_stores=sum(n for op, n in total.items() if op.startswith("STL")),
        local_loads=sum(n for op, n in total.items() if op.startswith("LDL")),
        opcodes=total,
    )



def ptx_mma_total(ptx: str) -> ProductMMA:
    """Every MMA instruction of a PTX listing, as one product named "all" (no line information needed)."""
    return product_mma("all", Counter(_PTX_MMA.findall(ptx)))
