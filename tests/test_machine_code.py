"""The Pallas kernels compiled for Hopper on a machine without a GPU (``pallas_kernels.machine_code``).

The Triton tests need the ``triton`` wheel (the ``test`` extra installs it; they are skipped
without it): the kernel's Triton IR is compiled by the wheel's pipeline and ptxas to a cubin for
sm_90a, at the launch settings XLA would use. XLA compiles the custom call with its own Triton
build, so these are facts about a close stand-in of the compiler a GPU run uses.

Shape: q_len 128, N 512, d 128, 2 query heads per K/V head (the fa3 figures of docs/guides/pallas.md).
"""

from __future__ import annotations

import pytest

import pallas_kernels as pk
from pallas_kernels import machine_code as mc
from pcast_jax.presets import get_preset, preset_for

#: the Hopper lowering is proven under each jax version in full (see tests/conftest.py, HALF_VAR)
pytestmark = pytest.mark.every_half

#: FA3's P-cast at a 128-key block (the preset's own block at d = 128 is 224; see OWN_TILES).
FA3_128 = get_preset("fa3").replace(block_kv=128, name="fa3")
SHAPE = mc.KernelShape(batch=1, heads=2, kv_heads=1, q_len=128, n=512, head_dim=128)
QK, PV = mc.PRODUCTS
#: Presets at their own KV blocks, which no 128-key tile holds: FA3's 224 at d = 128 and 160 at
#: d = 64, FlashInfer's 192, the paper's 64 (N = 512 is a multiple of none of 224, 192, 160).
OWN_TILES = {
    "fa3_b224": (preset_for("fa3", 128), SHAPE),
    "fa3_d64_b160": (preset_for("fa3", 64), mc.KernelShape(batch=1, heads=2, kv_heads=1, q_len=128, n=512,
                                                          head_dim=64)),
    "flashinfer_sm90_b192": (get_preset("flashinfer_sm90"), SHAPE),
    "fwd_s1_b64": (get_preset("fwd_s1"), SHAPE),
}


# ----------------------------------------------------------------------------------------------
# Parsers (no compiler needed)
# ----------------------------------------------------------------------------------------------


def test_parse_ptxas_log():
    log = (
        "ptxas info    : 11 bytes gmem\n"
        "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
        "ptxas info    : Function properties for k\n"
        "    1040 bytes stack frame, 1820 bytes spill stores, 1600 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 1040 bytes cumulative stack size, 16 bytes smem\n"
    )
    res = mc.parse_ptxas_log(log)
    assert res == mc.PtxasResources(registers=255, stack_frame=1040, spill_stores=1820, spill_loads=1600,
                                    static_smem=16, barriers=1)
    with pytest.raises(ValueError, match="Used"):
        mc.parse_ptxas_log("ptxas info    : 11 bytes gmem\n")


def test_parse_sass_counts_fp8_and_converted_mma():
    listing = "\n".join([
        "        /*0d50*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT ;",
        "        /*0da0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, R88, gdesc[UR8], R24, gsb0 ;",
        "        /*0e40*/              @!P0 HMMA.16816.F32 R24, R156, R160, R24 ;",
        "        /*0e50*/                   F2FP.F16.E4M3.UNPACK_B R2, R4 ;",
        "        /*0e60*/                   F2FP.F16.E4M3.UNPACK_B R3, R4.H1 ;",
        "        /*0e70*/                   STL [R1+0x4], R2 ;",
        "        /*0e80*/                   LDL.LU R2, [R1+0x4] ;",
    ])
    s = mc.parse_sass(listing)
    assert (s.fp8_mma, s.other_mma, s.e4m3_unpacks, s.local_stores, s.local_loads) == (2, 1, 2, 1, 1)
    assert s.mma_opcodes() == {"QGMMA.64x128x32.F32.E4M3.E4M3": 2, "HMMA.16816.F32": 1}


def test_parse_ptx_attributes_mma_to_their_dot_line():
    ptx = "\n".join([
        "\t.loc\t1 202 10",
        "\twgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%r1}, %rd1, %rd2, 0, 1, 1;",
        "\t.loc\t1 250 3",
        "\tcvt.rn.f16x2.e4m3x2 %r7, %rs1;",
        "\t.loc\t1 317 12",
        "\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f1};",
        "\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f2}, {%r1}, {%r2}, {%f2};",
        "\t.loc\t2 317 12",  # another file: not the kernel's IR
        "\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f3}, {%r1}, {%r2}, {%f3};",
        '\t.file\t1 "build/kernel.ttir"',
        '\t.file\t2 "build/other.py"',
    ])
    qk, pv, other = mc.parse_ptx_mma(ptx, {202: QK, 317: PV}, "kernel.ttir")
    assert (qk.product, qk.kind, qk.fp8, qk.converted) == (QK, "wgmma", 1, 0)
    assert (pv.product, pv.kind, pv.fp8, pv.converted) == (PV, "mma.sync", 0, 2)
    assert (other.product, other.converted) == ("other", 1)


# ----------------------------------------------------------------------------------------------
# Mosaic GPU: lowered module (no compiler needed); no cubin with the CPU jaxlib
# ----------------------------------------------------------------------------------------------


def test_mosaic_kernel_issues_fp8_wgmma_for_both_products():
    products = mc.mosaic_wgmma(mc.lower_for_hopper("mosaic", FA3_128, SHAPE))
    assert [p.product for p in products] == [QK, PV]
    for p in products:
        # per compute warpgroup: K / 32 wgmma of 64 rows; d = block_kv = 128
        assert p.kind == "wgmma" and p.fp8 == 4 and p.converted == 0, p
        assert dict(p.instructions) == {"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3": 4}


@pytest.mark.parametrize("case", list(OWN_TILES))
def test_mosaic_issues_fp8_wgmma_at_the_presets_own_blocks(case):
    """Q·Kᵀ: d / 32 wgmma N = block_kv wide; P8·V: block_kv / 32 wgmma N = d wide (all FP8)."""
    cfg, shape = OWN_TILES[case]
    tile, d = pk.kv_tile("mosaic", cfg.block_kv), shape.head_dim
    assert tile == cfg.block_kv  # every preset's block is a multiple of 32: no masked tile keys
    qk, pv = mc.mosaic_wgmma(mc.lower_for_hopper("mosaic", cfg, shape))
    assert (qk.product, pv.product) == (QK, PV)
    assert dict(qk.instructions) == {f"wgmma.mma_async.sync.aligned.m64n{tile}k32.f32.e4m3.e4m3": d // 32}
    assert dict(pv.instructions) == {f"wgmma.mma_async.sync.aligned.m64n{d}k32.f32.e4m3.e4m3": tile // 32}
    assert qk.converted == pv.converted == 0


@pytest.mark.xfail(
    strict=True,
    reason="the CPU jaxlib registers the Mosaic GPU dialect and its serde pass only; the pipeline to PTX "
    "(convert-gpu-to-nvvm, convert-nvvm-to-llvm, mosaic-gpu-module-to-assembly, …) is built into the CUDA "
    "PJRT plugin's mosaic_gpu_v2 custom call alone (see the XLA tests below)",
)
def test_cpu_jaxlib_runs_the_mosaic_pipeline():
    assert mc.mosaic_offline_blockers() == ()


# ----------------------------------------------------------------------------------------------
# Triton: compiled by the triton wheel to a cubin for sm_90a
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton_wheel():
    return pytest.importorskip("triton")


@pytest.fixture(scope="module")
def wheel_builds(triton_wheel):
    """The Triton kernel at its shipped settings (the custom call's warps and stages), by preset."""
    cache = {}

    def build(name):
        if name not in cache:
            cache[name] = mc.triton_report(FA3_128 if name == "fa3" else get_preset(name), SHAPE)
        return cache[name]

    return build


@pytest.fixture(scope="module", params=["fa3", "fwd_s1"])
def shipped(request, wheel_builds):
    return wheel_builds(request.param)


def test_triton_builds_for_hopper_at_the_custom_call_settings(shipped, triton_wheel):
    report, build = shipped
    assert (report.num_warps, report.num_stages) == (build.call.num_warps, build.call.num_stages) == (8, 2)
    assert build.cubin and ".target sm_90a" in build.ptx
    assert 0 < report.registers <= 255
    assert 0 < report.shared <= 232448  # one Hopper CTA's shared memory
    assert report.compiler.startswith(f"triton {triton_wheel.__version__} wheel")
    # every tensor-core instruction in the SASS comes from the two products
    assert report.sass_fp8_mma + report.sass_other_mma == sum(p.fp8 + p.converted for p in report.products)
    assert [p.product for p in report.products] == [QK, PV]


def test_triton_spills_nothing_at_shipped_settings(shipped):
    report, build = shipped
    assert (report.spill_stores, report.spill_loads, report.stack_frame) == (0, 0, 0), build.ptxas_log
    assert build.summary.local_stores == build.summary.local_loads == 0


def test_triton_uses_fp8_tensor_cores_for_both_products(shipped):
    """The kernel's tt.dots carry maxNumImpreciseAcc = 2^30, so Triton picks wgmma on E4M3 operands."""
    report, build = shipped
    assert build.call.max_num_imprecise_acc == (2**30, 2**30)
    assert build.mma_versions == (3, 3)
    for p in report.products:
        assert p.kind == "wgmma" and p.fp8 > 0 and p.converted == 0, p
    assert report.sass_fp8_mma > 0 and report.sass_other_mma == 0 and report.e4m3_unpacks == 0


@pytest.mark.parametrize("case", list(OWN_TILES))
def test_triton_reaches_fp8_wgmma_without_spills_at_the_presets_own_blocks(case, triton_wheel):
    """Each block on its power-of-two tile (224, 192, 160 on 256 keys), at the custom call's settings."""
    cfg, shape = OWN_TILES[case]
    report, build = mc.triton_report(cfg, shape)
    assert (report.num_warps, report.num_stages) == (build.call.num_warps, build.call.num_stages)
    assert build.mma_versions == (3, 3)
    for p in report.products:
        assert p.kind == "wgmma" and p.fp8 > 0 and p.converted == 0, p
    assert report.sass_fp8_mma > 0 and report.sass_other_mma == 0 and report.e4m3_unpacks == 0
    assert (report.spill_stores, report.spill_loads, report.stack_frame) == (0, 0, 0), build.ptxas_log
    assert build.summary.local_stores == build.summary.local_loads == 0
    assert 0 < report.registers <= 255 and 0 < report.shared <= 232448


def test_plain_dot_general_falls_back_to_mma_sync(triton_wheel):
    """Why the kernel sets the attribute: the same IR with Pallas' default maxNumImpreciseAcc = 0."""
    report, build = mc.triton_report(FA3_128, SHAPE, max_num_imprecise_acc=0)
    assert build.mma_versions == (2, 2)
    assert {p.kind for p in report.products} == {"mma.sync"}
    assert report.sass_fp8_mma == 0 and report.e4m3_unpacks > 0
    assert {op.split(".")[0] for op in build.summary.mma_opcodes()} == {"HMMA"}


def test_triton_reaches_fp8_wgmma_without_spills_with_tl_dot_accumulation(triton_wheel):
    """The same IR with maxNumImpreciseAcc = 2^30 (what tl.dot sets on sm_90): FP8 QGMMA, no spills."""
    report, build = mc.triton_report(
        FA3_128, SHAPE, max_num_imprecise_acc=mc.TL_DOT_SM90_MAX_NUM_IMPRECISE_ACC
    )
    assert build.mma_versions == (3, 3)
    for p in report.products:
        assert p.kind == "wgmma" and p.fp8 > 0 and p.converted == 0, p
        assert all(".e4m3.e4m3" in instr for instr, _ in p.instructions)
    assert report.sass_fp8_mma == sum(p.fp8 for p in report.products) and report.sass_other_mma == 0
    assert all("E4M3.E4M3" in op for op in build.summary.mma_opcodes())
    assert report.e4m3_unpacks == 0
    assert (report.spill_stores, report.spill_loads, report.stack_frame) == (0, 0, 0), build.ptxas_log


# ----------------------------------------------------------------------------------------------
# XLA's own compilers (the ones a GPU run uses), ahead of time for an H100, no GPU
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def xla_plugin(triton_wheel):
    if not mc.xla_available():
        pytest.skip("needs the jax CUDA plugin (pip install jax-cuda12-plugin==<jax version>)")


@pytest.fixture(scope="module")
def xla_mosaic(xla_plugin):
    return mc.xla_report("mosaic", FA3_128, SHAPE)


@pytest.fixture(scope="module")
def xla_triton(xla_plugin):
    return mc.xla_report("triton", FA3_128, SHAPE)


def test_mosaic_compiles_with_xla_to_fp8_wgmma_without_spills(xla_mosaic):
    report, build = xla_mosaic
    assert "sm_90a" in build.ptxas_log and build.sass, build.ptxas_log
    for p in report.products:
        assert p.kind == "wgmma" and p.fp8 > 0 and p.converted == 0, p
    # the SASS runs each wgmma of the module on the FP8 tensor cores, and nothing else
    assert report.sass_fp8_mma == sum(p.fp8 for p in report.products) and report.sass_other_mma == 0
    assert all(op.startswith("QGMMA") and "E4M3.E4M3" in op for op in parse_mma(build.sass))
    assert (report.spill_stores, report.spill_loads, report.stack_frame) == (0, 0, 0), build.ptxas_log
    assert 0 < report.registers <= 255 and 0 < report.shared <= 232448


@pytest.mark.parametrize("case,causal", [(case, False) for case in OWN_TILES] + [("fa3_b224", True)])
def test_mosaic_compiles_with_xla_without_spills_at_the_presets_own_blocks(case, causal, xla_plugin):
    """The presets' own blocks, N = 512 (the last block masked; causal: the diagonal too)."""
    cfg, shape = OWN_TILES[case]
    report, build = mc.xla_report("mosaic", cfg.replace(causal=causal), shape)
    for p in report.products:
        assert p.kind == "wgmma" and p.fp8 > 0 and p.converted == 0, p
    assert report.sass_fp8_mma == sum(p.fp8 for p in report.products) and report.sass_other_mma == 0
    assert (report.spill_stores, report.spill_loads, report.stack_frame) == (0, 0, 0), build.ptxas_log
    assert 0 < report.registers <= 255 and 0 < report.shared <= 232448


def test_triton_compiles_with_xla_to_the_same_mma_kind(xla_triton, wheel_builds):
    """XLA's Triton and the wheel agree on the MMA kind and the instruction counts (a faithful stand-in)."""
    report, build = xla_triton
    wheel, _ = wheel_builds("fa3")
    assert report.num_warps == wheel.num_warps
    assert report.products[0].kind == wheel.products[0].kind == "wgmma"
    assert report.sass_fp8_mma == wheel.sass_fp8_mma and report.sass_other_mma == wheel.sass_other_mma == 0


def test_triton_compiled_by_xla_uses_fp8_wgmma_without_spills(xla_triton):
    report, build = xla_triton
    assert report.products[0].kind == "wgmma" and report.sass_fp8_mma > 0 and report.sass_other_mma == 0
    assert (report.spill_stores, report.stack_frame) == (0, 0), build.ptxas_log


def parse_mma(sass_text: str) -> dict[str, int]:
    return mc.parse_sass(sass_text).mma_opcodes()
