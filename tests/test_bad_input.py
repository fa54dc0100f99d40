"""Bad input is refused with one clear error that names the parameter and what is allowed.

Every case below must raise :class:`pcast_jax.errors.PcastError` (a ``ValueError``) whose one-line
message contains the parameter's name and the allowed range or choices. Public API first, then
the sweep's side effects (nothing computed, nothing written, nothing mixed), then the ``pcast``
command line in a subprocess: one ``pcast: error: …`` line on stderr, exit status 2, no traceback.

The one input that is *not* an error — N not a multiple of ``block_kv`` — is padded with masked
keys; the tests at the end show the padding changes nothing.
"""

from __future__ import annotations

import importlib
import io
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pcast_jax import engine, formats, report, sweep, workloads
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError
from pcast_jax.presets import get_preset, resolve

import oracle

NAN, INF = float("nan"), float("inf")

# Small, valid inputs that each case breaks in one place.
_SCORES = np.linspace(-2.0, 2.0, 2 * 8, dtype=np.float32).reshape(2, 8)
_V = np.ones((8, 3), np.float32)
_Q = np.ones((2, 4), np.float32)
_K = np.ones((8, 4), np.float32)
_SMALL = dict(ns=(64,), seeds=2, q_len=2, d=4, configs=("fwd_s1",))


def _with(array, index, value):
    out = np.array(array, copy=True)
    out[index] = value
    return out


def _spec(**changes):
    return sweep.SweepSpec(**{**_SMALL, **changes})


def _kernel_inputs(n_keys=256, dtype=jnp.float8_e4m3fn):
    q = jnp.zeros((1, 1, 64, 64), dtype)
    k = jnp.zeros((1, 1, n_keys, 64), jnp.float8_e4m3fn)
    return q, k, k


def _fp8_attention(**kw):
    pallas = importlib.import_module("pallas_kernels")
    q, k, v = _kernel_inputs(kw.pop("n_keys", 256), kw.pop("dtype", jnp.float8_e4m3fn))
    return pallas.fp8_attention(q, k, v, interpret=True, **kw)


def _theory():
    return importlib.import_module("pcast_jax.theory")


def _whatif():
    return importlib.import_module("pcast_jax.whatif")


def _reproduce():
    return importlib.import_module("pcast_experiments.registry").reproduce


def _predict(**kw):
    return importlib.import_module("pcast_jax.jax_fp8").predict(**{"seq_len": 256, "head_dim": 16, "seeds": 2, **kw})


def _nn_attention(**kw):
    x = np.ones((1, 4, 2, 8), np.float32)
    return importlib.import_module("pcast_jax.nn").dot_product_attention(x, x, x, **kw)


# (id, call, substrings the message must contain: the parameter, then the allowed range/choices)
CASES = [
    # KernelConfig: the static scale S and every named choice
    ("scale_zero", lambda: KernelConfig(scale=0.0), ["scale=0.0", "> 0"]),
    ("scale_negative", lambda: KernelConfig(scale=-256.0), ["scale=-256.0", "> 0"]),
    ("scale_nan", lambda: KernelConfig(scale=NAN), ["scale=nan", "finite"]),
    ("scale_inf", lambda: KernelConfig(scale=INF), ["scale=inf", "finite"]),
    ("scale_overflows_float32", lambda: KernelConfig(scale=1e40), ["scale=1e+40", "[2^-100, 2^100]"]),
    ("scale_underflows_float32", lambda: KernelConfig(scale=1e-45), ["scale=1e-45", "[2^-100, 2^100]"]),
    ("scale_not_a_number", lambda: KernelConfig(scale="256"), ["scale='256'", "real number"]),
    ("block_kv_zero", lambda: KernelConfig(block_kv=0), ["block_kv=0", ">= 1"]),
    ("block_kv_fraction", lambda: KernelConfig(block_kv=1.5), ["block_kv=1.5", "integer"]),
    ("order_unknown", lambda: KernelConfig(order="sideways"), ["order='sideways'", "'forward', 'reverse'"]),
    ("scale_mode_unknown", lambda: KernelConfig(scale_mode="log"), ["scale_mode='log'", "'multiply'"]),
    ("p_format_unknown", lambda: KernelConfig(p_format="e3m4"), ["p_format='e3m4'", "'e4m3'"]),
    ("overflow_unknown", lambda: KernelConfig(overflow="wrap"), ["overflow='wrap'", "'satfinite', 'nan'"]),
    ("accumulator_unknown", lambda: KernelConfig(accumulator="bf16"), ["accumulator='bf16'", "'f32', 'f16'"]),
    ("qkv_unknown", lambda: KernelConfig(qkv="int8"), ["qkv='int8'", "'f32', 'e4m3'"]),
    ("causal_not_bool", lambda: KernelConfig(causal="yes"), ["causal='yes'", "True or False"]),
    ("preset_unknown", lambda: get_preset("fa5"), ["preset='fa5'", "'fa3'"]),
    ("config_wrong_type", lambda: resolve(3), ["config=3", "preset name or a KernelConfig"]),
    # formats
    ("format_unknown", lambda: formats.get_format("fp4"), ["fmt='fp4'", "'e4m3'"]),
    ("cast_overflow_unknown", lambda: formats.cast(1.0, overflow="clip"), ["overflow='clip'", "'satfinite'"]),
    # engine: shapes, dtypes, values
    ("scores_v_mismatch", lambda: engine.attention(_SCORES, _V[:7], "fwd_s1"), ["v has 7 keys", "N=8"]),
    ("v_one_dimensional", lambda: engine.attention(_SCORES, _V[:, 0], "fwd_s1"), ["v (..., N, d)", "(8,)"]),
    ("scores_empty_rows", lambda: engine.attention(_SCORES[:0], _V, "fwd_s1"), ["empty", "scores.shape=(0, 8)"]),
    ("scores_empty_keys", lambda: engine.attention(_SCORES[:, :0], _V[:0], "fwd_s1"), ["empty", "(2, 0)"]),
    ("batch_dims_mismatch", lambda: engine.attention(np.zeros((3, 2, 8)), np.ones((2, 8, 3)), "fwd_s1"),
     ["scores and v", "(3,) vs (2,)"]),
    ("scores_complex", lambda: engine.attention(_SCORES + 1j, _V, "fwd_s1"), ["scores.dtype=complex", "real"]),
    ("scores_bool", lambda: engine.attention(_SCORES > 0, _V, "fwd_s1"), ["scores.dtype=bool", "real"]),
    ("scores_strings", lambda: engine.attention(np.full((2, 8), "a"), _V, "fwd_s1"), ["scores.dtype=<U1", "real"]),
    ("v_complex", lambda: engine.attention(_SCORES, _V * 1j, "fwd_s1"), ["v.dtype=complex", "real"]),
    ("scores_nan", lambda: engine.attention(_with(_SCORES, (0, 3), NAN), _V, "fwd_s1"), ["scores", "NaN or +inf"]),
    ("scores_plus_inf", lambda: engine.attention(_with(_SCORES, (1, 0), INF), _V, "fwd_s1"), ["scores", "finite"]),
    ("v_nan", lambda: engine.attention(_SCORES, _with(_V, (2, 1), NAN), "fwd_s1"), ["v contains NaN", "finite"]),
    ("count_mask_length", lambda: engine.attention(_SCORES, _V, "fwd_s1", count_mask=np.ones(5, bool)),
     ["count_mask.shape=(5,)", "(8,)"]),
    ("q_offset_negative", lambda: engine.attention(_SCORES, _V, KernelConfig(causal=True), q_offset=-3),
     ["q_offset=-3", ">= 0"]),
    ("q_offset_fraction", lambda: engine.attention(_SCORES, _V, KernelConfig(causal=True), q_offset=1.5),
     ["q_offset=1.5", "integer"]),
    ("engine_unknown", lambda: engine.attention(_SCORES, _V, "fwd_s1", implementation="slow"), ["implementation='slow'", "'xla', 'scan'"]),
    ("weights_nan", lambda: engine.effective_weights(_with(_SCORES, (0, 0), NAN), "fwd_s1"), ["scores", "NaN"]),
    ("qk_head_dims", lambda: engine.prepare_qkv(_Q, _K[:, :3], _K, "fwd_s1"), ["q and k head dims", "(8, 3)"]),
    ("kv_lengths", lambda: engine.prepare_qkv(_Q, _K, _K[:5], "fwd_s1"), ["k and v lengths", "(5, 4)"]),
    ("q_one_dimensional", lambda: engine.prepare_qkv(_Q[0], _K, _K, "fwd_s1"), ["q.shape=(4,)", "(..., len, d)"]),
    ("qkv_empty", lambda: engine.prepare_qkv(_Q[:0], _K, _K, "fwd_s1"), ["empty", "q.shape=(0, 4)"]),
    ("qkv_batch_dims", lambda: engine.prepare_qkv(np.ones((3, 2, 4)), np.ones((2, 8, 4)), np.ones((2, 8, 4)), "fwd_s1"),
     ["q, k and v", "(3,) vs (2,) vs (2,)"]),
    ("softmax_scale_zero", lambda: engine.prepare_qkv(_Q, _K, _K, "fwd_s1", scale=0.0),
     ["scale=0.0", "> 0"]),
    ("softmax_scale_nan", lambda: engine.prepare_qkv(_Q, _K, _K, "fwd_s1", scale=NAN),
     ["scale=nan", "finite"]),
    # workloads
    ("n_zero", lambda: workloads.SinkWorkload(n=0), ["n=0", ">= 1"]),
    ("k_sink_above_n", lambda: workloads.SinkWorkload(n=8, k_sink=9), ["k_sink=9", "<= 8"]),
    ("k_sink_negative", lambda: workloads.SinkWorkload(n=8, k_sink=-1), ["k_sink=-1", ">= 0"]),
    ("sink_position_too_large", lambda: workloads.SinkWorkload(n=8, sink_positions=(0, 8)),
     ["sink_positions=(0, 8)", "[0, n=8)"]),
    ("sink_position_negative", lambda: workloads.SinkWorkload(n=8, sink_positions=(-1,)), ["sink_positions=-1", ">= 0"]),
    ("sink_positions_duplicated", lambda: workloads.SinkWorkload(n=8, sink_positions=(2, 2)),
     ["sink_positions=(2, 2)", "duplicates"]),
    ("sink_position_fraction", lambda: workloads.SinkWorkload(n=8, sink_positions=(1.5,)), ["sink_positions=1.5", "integer"]),
    ("sink_positions_not_a_sequence", lambda: workloads.SinkWorkload(n=8, sink_positions=3),
     ["sink_positions=3", "sequence"]),
    ("sigma_zero", lambda: workloads.SinkWorkload(sigma=0.0), ["sigma=0.0", "> 0"]),
    ("sigma_v_nan", lambda: workloads.SinkWorkload(sigma_v=NAN), ["sigma_v=nan", "finite"]),
    ("sigma_zero_in_float32", lambda: workloads.SinkWorkload(sigma=1e-46), ["sigma=1e-46", ">= 1.175e-38"]),
    ("sigma_v_subnormal", lambda: workloads.SinkWorkload(sigma_v=1e-40), ["sigma_v=1e-40", "subnormal"]),
    ("instance_delta_nan", lambda: workloads.make_instance(jax.random.PRNGKey(0), workloads.SinkWorkload(n=8), NAN),
     ["delta=nan", "finite"]),
    ("instance_delta_inf", lambda: workloads.make_instance(jax.random.PRNGKey(0), workloads.SinkWorkload(n=8), -INF),
     ["delta=-inf", "finite"]),
    # SweepSpec
    ("sweep_delta_nan", lambda: _spec(deltas=(5.0, NAN)), ["delta=nan", "finite"]),
    ("sweep_delta_inf", lambda: _spec(deltas=(INF,)), ["delta=inf", "finite"]),
    ("sweep_delta_beyond_float32", lambda: _spec(deltas=(1e39,)), ["delta=1e+39", "<= 4.25353e+37"]),
    ("sweep_deltas_empty", lambda: _spec(deltas=()), ["deltas", "at least one"]),
    ("sweep_seeds_zero", lambda: _spec(seeds=0), ["seeds=0", ">= 1"]),
    ("sweep_seeds_negative", lambda: _spec(seeds=-4), ["seeds=-4", ">= 1"]),
    ("sweep_base_seed_negative", lambda: _spec(base_seed=-1), ["base_seed=-1", ">= 0"]),
    ("sweep_seed_offset_negative", lambda: _spec(seed_offset=-1), ["seed_offset=-1", ">= 0"]),
    ("sweep_seed_indices_beyond_uint32", lambda: _spec(seed_offset=2**32 - 1), ["seed_offset=4294967295", "<= 4294967294"]),
    ("sweep_config_unknown", lambda: _spec(configs=("fwd_s1", "fa5")), ["preset='fa5'", "'rev_s256'"]),
    ("sweep_config_names_repeat", lambda: _spec(configs=("fa3", KernelConfig(name="fa3"))), ["unique names", "fa3"]),
    ("sweep_implementation_unknown", lambda: _spec(implementation="gpu"), ["implementation='gpu'", "'xla', 'scan'"]),
    ("sweep_n_zero", lambda: _spec(ns=(64, 0)), ["n=0", ">= 1"]),
    ("sweep_k_sink_above_n", lambda: _spec(ns=(64, 3)), ["k_sink=4", "<= 3"]),
    ("sweep_expected_mse_not_bool", lambda: _spec(expected_mse="no"), ["expected_mse='no'", "True or False"]),
    ("sweep_spec_wrong_type", lambda: sweep.run_sweep({"ns": (64,)}), ["spec must be a SweepSpec", "dict"]),
    ("chunk_size_zero", lambda: sweep.plan_layout(_spec(), n_devices=1, chunk_size=0), ["chunk_size=0", ">= 1"]),
    ("chunk_size_over_budget", lambda: sweep.plan_layout(_spec(), n_devices=1, chunk_size=10**6, memory_budget=2**24),
     ["chunk_size=1000000", "at most"]),
    ("memory_budget_zero", lambda: sweep.plan_layout(_spec(), n_devices=1, memory_budget=0), ["memory_budget=0", "> 0"]),
    ("memory_budget_nan", lambda: sweep.plan_layout(_spec(), n_devices=1, memory_budget=NAN), ["memory_budget=nan", "finite"]),
    ("result_metric_unknown", lambda: sweep.SweepResult(_spec(), {"mse": np.zeros((1, 1, 1, 2))}).get("rmse", config="fwd_s1"),
     ["metric='rmse'", "'mse'"]),
    ("result_config_unknown", lambda: sweep.SweepResult(_spec(), {"mse": np.zeros((1, 1, 1, 2))}).get("mse", config="fa3"),
     ["config='fa3'", "'fwd_s1'"]),
    # theory (closed forms)
    ("theory_delta_nan", lambda: _theory().collapse_fraction(NAN, 256.0), ["delta=nan", "finite"]),
    ("theory_delta_array_inf", lambda: _theory().underflow_threshold(np.array([1.0, INF]), 256.0),
     ["delta (array, offending value inf)", "finite"]),
    ("theory_scale_zero", lambda: _theory().critical_delta(0.0), ["scale=0.0", ">= 2^-100"]),
    ("theory_scale_subnormal", lambda: _theory().dp(1e-40), ["scale=1e-40", ">= 2^-100"]),
    ("theory_sigma_negative", lambda: _theory().collapse_fraction(7.0, 256.0, sigma=-1.0), ["sigma=-1.0", "> 0"]),
    ("theory_n_not_above_k_sink", lambda: _theory().reverse_underflow_prob(4, 256.0, k_sink=4), ["n=4", "> k_sink=4"]),
    ("theory_k_below_one", lambda: _theory().delta_k(0.5), ["k=0.5", ">= 1"]),
    ("theory_max_model_unknown", lambda: _theory().reverse_underflow_prob(100, 256.0, max_model="gumbel"),
     ["max_model='gumbel'", "'eq11'"]),
    # API edges: integers past int32, malformed masks, non-numbers, complex numbers, integers past float
    ("q_offset_beyond_int32", lambda: engine.attention(_SCORES, _V, KernelConfig(causal=True), q_offset=2**31),
     ["q_offset=2147483648", "<= 2147483645"]),
    ("count_mask_strings", lambda: engine.attention(_SCORES, _V, "fwd_s1", count_mask="abcdefgh"),
     ["count_mask.dtype=<U8", "integer"]),
    ("count_mask_ragged", lambda: engine.attention(_SCORES, _V, "fwd_s1", count_mask=[1, 0, [1], 1, 1, 1, 1, 1]),
     ["count_mask", "real numbers"]),
    ("cast_string", lambda: formats.cast("abc"), ["x='abc'", "real number"]),
    ("theory_delta_none", lambda: _theory().collapse_fraction(None, 256.0), ["delta=None", "real number"]),
    ("theory_delta_string", lambda: _theory().collapse_fraction("7", 256.0), ["delta='7'", "real number"]),
    ("config_name_two_lines", lambda: KernelConfig(name="a\nb"), ["name='a\\nb'", "one printable line"]),
    ("cast_complex", lambda: formats.cast(np.array([1 + 2j])), ["x=array([1.+2.j])", "complex"]),
    ("theory_delta_complex", lambda: _theory().collapse_fraction(7 + 1j, 256.0), ["delta=(7+1j)", "complex"]),
    ("theory_delta_huge_integer", lambda: _theory().collapse_fraction(10**400, 256.0),
     ["delta=1000000", "beyond float range"]),
    ("theory_block_max_negative", lambda: _theory().block_element_threshold(-1.0), ["block_max=-1.0", ">= 0"]),
    ("theory_block_max_inf", lambda: _theory().block_element_threshold(INF), ["block_max=inf", "finite"]),
    ("scale_huge_integer", lambda: KernelConfig(scale=10**400), ["scale=1000000", "beyond float range"]),
    # every loop a user can size has a bound; options are checked before any work
    ("worst_delta_range_unbounded", lambda: _whatif().worst_case_delta("fwd_s1", 64, delta_range=(0.0, 1e6)),
     ["delta_range=(0.0, 1000000.0)", "at most 4096"]),
    ("worst_delta_refine_step_tiny", lambda: _whatif().worst_case_delta("fwd_s1", 64, refine_step=1e-9),
     ["refine_step=1e-09", "at most 4096"]),
    ("reproduce_extras_unknown", lambda: _reproduce()("/nonexistent/never-created", extras=("bogus",)),
     ["extras='bogus'", "real_model"]),
    # Pallas FP8 kernels: what the kernels cannot take (validated before anything is compiled)
    # any block up to the widest tile runs (the semantic block on a tile the backend lowers, N padded)
    ("kernel_block_kv_triton", lambda: _fp8_attention(config=KernelConfig(block_kv=300), implementation="triton"),
     ["block_kv=300", "triton", "256 keys"]),
    ("kernel_block_kv_mosaic", lambda: _fp8_attention(config=KernelConfig(block_kv=260), implementation="mosaic"),
     ["block_kv=260", "mosaic", "256 keys"]),
    ("kernel_dtype_float32", lambda: _fp8_attention(config="fwd_s1", implementation="triton", dtype=jnp.float32),
     ["q.dtype=float32", "float8_e4m3fn"]),
    ("kernel_backend_unknown", lambda: _fp8_attention(config="fwd_s1", implementation="cuda"), ["implementation='cuda'", "'mosaic', 'triton'"]),
    # jax_fp8.predict: what a JAX user passes, every number checked where it enters; sizes against the budget
    ("predict_scale_s_string", lambda: _predict(fp8_params={"scale_s": "2"}), ["fp8_params['scale_s']='2'", "real number"]),
    ("predict_scale_s_complex", lambda: _predict(fp8_params={"scale_s": 2 + 1j}),
     ["fp8_params['scale_s']=(2+1j)", "real number"]),
    ("predict_scale_s_huge_integer", lambda: _predict(fp8_params={"scale_s": 10**400}),
     ["fp8_params['scale_s']=1000000", "beyond float range"]),
    ("predict_scale_s_complex_array", lambda: _predict(fp8_params={"scale_s": np.array([2 + 0j])}),
     ["fp8_params['scale_s']", "real number", "complex128"]),
    ("predict_base_seed_huge", lambda: _predict(base_seed=2**70), ["base_seed=1180591620717411303424", "<= 4294967295"]),
    ("predict_q_len_huge", lambda: _predict(q_len=10**9), ["q_len=1000000000", "<= 1048576"]),
    ("predict_gpu_unknown", lambda: _predict(gpu="ampere"), ["gpu='ampere'", "hopper, blackwell"]),
    ("predict_tau_contradicts_gpu", lambda: _predict(gpu="hopper", rescale_threshold=4.0),
     ["rescale_threshold=4", "contradicts gpu='hopper'", "τ = 0"]),
    ("predict_tau_with_an_open_kernel", lambda: _predict(gpu="blackwell", rescale_threshold=0.0),
     ["rescale_threshold=0", "gpu='blackwell'", "bakes τ = 4 in log2 units", "without a GPU"]),
    ("predict_mxfp8_off_blackwell", lambda: _predict(gpu="hopper", mxfp8=True),
     ["mxfp8=True", "gpu='hopper'", "Blackwell (sm100)"]),
    ("predict_trace_and_synthetic", lambda: _predict(trace="t.npz"), ["head_dim, seq_len, seeds", "trace="]),
    ("predict_trace_missing", lambda: importlib.import_module("pcast_jax.jax_fp8").predict(trace="no/t.npz"),
     ["trace file no/t.npz", "does not exist"]),
    ("predict_logits_fn_without_trace", lambda: _predict(logits_fn=len), ["logits_fn", "only with trace="]),
    ("predict_over_the_memory_budget", lambda: _predict(seq_len=1 << 20, q_len=1 << 20, seeds=4096),
     ["predict's simulation", "seq_len=1048576", "the budget is"]),
    ("predict_sinks_complex", lambda: _predict(sinks=[1 + 2j, 3.0]), ["sinks=[(1+2j), 3.0]", "real numbers"]),
    ("predict_sinks_text", lambda: _predict(sinks=np.array(["5"])), ["sinks=array(['5']", "real numbers"]),
    ("memory_over_budget", lambda: plan.check_memory("a table of 10 bytes", 10, budget=4),
     ["a table of 10 bytes needs", "the budget is"]),
    # the drop-in's local window: positions are int32
    ("local_window_beyond_int32", lambda: _nn_attention(local_window_size=2**40),
     ["local_window_size=1099511627776", "<= 2147483647"]),
    ("local_window_pair_beyond_int32", lambda: _nn_attention(local_window_size=(4, 2**31)),
     ["local_window_size=2147483648", "<= 2147483647"]),
]


@pytest.mark.parametrize("call, needles", [pytest.param(c, n, id=i) for i, c, n in CASES])
def test_bad_input_raises_one_clear_error(call, needles):
    with pytest.raises(PcastError) as info:
        call()
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} missing from {message!r}"


def test_case_ids_are_unique_and_many():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 30


def test_guarantees_page_counts_the_cases_of_this_file():
    import re
    from pathlib import Path

    text = " ".join((Path(__file__).parents[1] / "docs" / "guarantees.md").read_text().split())
    found = re.search(r"(\d+) kinds of bad input to the Python API and (\d+) on the `pcast` command line", text)
    counts = (len(CASES) + len(SURFACE_CASES), len(_CLI_CASES) + len(SURFACE_CLI_CASES))
    assert found and (int(found[1]), int(found[2])) == counts, (found, counts)


# --------------------------------------------------------------------------------------------
# The sweep: refuse before any work, never write where it cannot, never mix two sweeps
# --------------------------------------------------------------------------------------------


class _Computed(Exception):
    pass


@pytest.fixture
def no_compute(monkeypatch):
    """Make any chunk computation fail loudly, so a test can show none was started."""

    def refuse(*args, **kwargs):
        raise _Computed("a chunk was computed")

    monkeypatch.setattr("pcast_jax.sweep.local.compute_chunk", refuse)


def test_memory_budget_too_small_fails_before_any_work(tmp_path, no_compute):
    out = tmp_path / "out"
    spec = _spec(ns=(4096,), q_len=32, d=128)
    with pytest.raises(PcastError, match=r"memory_budget|memory budget") as info:
        sweep.run_sweep(spec, out_dir=out, memory_budget=4096)
    assert "GiB" in str(info.value) and "N=4096" in str(info.value)
    assert not out.exists()  # nothing created, nothing computed


def test_output_directory_that_cannot_exist_is_refused(tmp_path, no_compute):
    blocker = tmp_path / "afile"
    blocker.write_text("a regular file, so no folder can be made under it (even as root)")
    out = blocker / "sub"
    with pytest.raises(PcastError, match=r"out_dir=.*afile/sub.* is not writable"):
        sweep.run_sweep(_spec(), out_dir=out)
    assert blocker.read_text().startswith("a regular file")


def test_output_directory_under_a_device_file_is_refused(no_compute):
    # a chmod-ed folder would not stop root; no one can make a folder under /dev/null
    with pytest.raises(PcastError, match=r"out_dir='/dev/null/pcast' is not writable"):
        sweep.run_sweep(_spec(), out_dir="/dev/null/pcast")


def _claim(out, spec, monkeypatch):
    """Start a sweep in ``out`` that stops at its first chunk (spec.json written, nothing else)."""

    def stop(*args, **kwargs):
        raise _Computed("stopped at the first chunk")

    with monkeypatch.context() as m:
        m.setattr("pcast_jax.sweep.local.compute_chunk", stop)
        with pytest.raises(_Computed):
            sweep.run_sweep(spec, out_dir=out)
    assert (out / "spec.json").exists()


@pytest.mark.parametrize("change, field", [
    (dict(deltas=(5.0, 9.0)), "deltas"),
    (dict(configs=("rev_s256",)), "configs"),
    (dict(seeds=3), "seeds"),
    (dict(base_seed=1), "base_seed"),
    (dict(ns=(128,)), "ns"),
])
def test_resume_with_a_different_spec_is_refused(tmp_path, monkeypatch, no_compute, change, field):
    out = tmp_path / "out"
    _claim(out, _spec(deltas=(5.0,)), monkeypatch)
    saved = (out / "spec.json").read_text()
    with pytest.raises(PcastError, match=rf"different sweep \(fields that differ: .*{field}.*refusing to mix"):
        sweep.run_sweep(_spec(**{"deltas": (5.0,), **change}), out_dir=out)
    assert (out / "spec.json").read_text() == saved
    assert not (out / "chunks").exists()


def test_unreadable_saved_spec_is_refused(tmp_path, monkeypatch, no_compute):
    out = tmp_path / "out"
    _claim(out, _spec(), monkeypatch)
    (out / "spec.json").write_text('{"fingerprint": "abc", "layout": ')  # truncated JSON
    with pytest.raises(PcastError, match=r"spec.json is unreadable"):
        sweep.run_sweep(_spec(), out_dir=out)


def test_loading_an_unfinished_sweep_is_refused(tmp_path):
    with pytest.raises(PcastError, match=r"out_dir=.* has no results.npz"):
        sweep.load_result(tmp_path)


# --------------------------------------------------------------------------------------------
# N not a multiple of block_kv: padded with masked keys, which changes nothing
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["fwd_s1", "rev_s256", "fa3"])
@pytest.mark.parametrize("engine_name", ["xla", "scan"])
def test_padding_to_a_block_multiple_changes_nothing(preset, engine_name):
    n, block_kv = 100, 64  # 36 masked keys of padding in the last block
    cfg = get_preset(preset).replace(block_kv=block_kv)
    inst = workloads.make_instance(jax.random.PRNGKey(7), workloads.SinkWorkload(n=n, q_len=4, d=8), 6.0)
    got = engine.attention(inst.scores, inst.v, cfg, implementation=engine_name)
    # the same keys padded by hand to N = 128 = 2 blocks: -inf scores, zero values
    pad = 2 * block_kv - n
    scores = jnp.pad(inst.scores, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    v = jnp.pad(inst.v, ((0, pad), (0, 0)))
    manual = engine.attention(scores, v, cfg, implementation=engine_name)
    for field in ("out", "row_sum", "n_zeroed", "zeroed_mass"):
        np.testing.assert_array_equal(getattr(got, field), getattr(manual, field), err_msg=field)
    np.testing.assert_array_equal(got.n_counted, n)  # padding is never counted
    assert got.out.shape == (4, 8)
    weights = engine.effective_weights(inst.scores, cfg)
    assert weights.shape == (4, n)
    np.testing.assert_allclose(weights @ inst.v, got.out, rtol=1e-5, atol=1e-6)
    ref = oracle.attention(inst.scores, inst.v, **oracle.config_kwargs(cfg))  # independent float64
    np.testing.assert_allclose(got.out, ref.out, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got.n_zeroed, ref.n_zeroed)


def test_n_smaller_than_one_block_is_padded():
    cfg = KernelConfig(block_kv=64, scale=256.0)
    scores = np.linspace(-3.0, 1.0, 3 * 5, dtype=np.float32).reshape(3, 5)
    v = np.arange(5 * 2, dtype=np.float32).reshape(5, 2)
    got = engine.attention(scores, v, cfg)
    ref = oracle.attention(scores, v, **oracle.config_kwargs(cfg))
    np.testing.assert_allclose(got.out, ref.out, rtol=1e-6)
    np.testing.assert_array_equal(got.n_zeroed, ref.n_zeroed)
    np.testing.assert_array_equal(got.n_counted, 5)


# --------------------------------------------------------------------------------------------
# The command line: one line on stderr, exit status 2, no traceback
# --------------------------------------------------------------------------------------------

_CLI_CASES = {
    "theory_delta_nan": (["theory", "--delta", "nan"], ["delta=nan", "finite"]),
    "theory_scale_negative": (["theory", "--scale", "-1"], ["scale=-1.0", ">= 2^-100"]),
    "theory_n_not_above_k_sink": (["theory", "--n", "4", "--ksink", "4"], ["n=4", ">= 5"]),
    "theory_fmt_unknown": (["theory", "--fmt", "e3m4"], ["--fmt", "e3m4", "choose from"]),
    "command_unknown": (["sweeep"], ["sweeep", "choose from"]),
    "sweep_config_unknown": (["sweep", "--configs", "fwd_s1,fa5"], ["--configs", "'fa5'", "choose from"]),
    "sweep_delta_nan": (["sweep", "--delta", "5,nan"], ["--delta", "nan", "finite"]),
    "sweep_seeds_zero": (["sweep", "--seeds", "0"], ["--seeds", ">= 1"]),
    "sweep_implementation_unknown": (["sweep", "--implementation", "gpu"], ["--implementation", "'gpu'", "xla"]),
    # a kernel's numbers: a power's base > 0 and -2^2 is -(2^2), as written in mathematics
    "config_scale_negative_root": (["sweep", "--config", "scale=-2^0.5"], ["scale=-1.414", "> 0"]),
    "config_scale_zero_power": (["sweep", "--config", "scale=0^-1"], ["scale='0^-1'", "base > 0"]),
    "config_scale_minus_two_squared": (["sweep", "--config", "scale=-2^2"], ["scale=-4.0", "> 0"]),
    "sweep_delta_step_below_float32": (["sweep", "--delta", "1e8:1.0000001e8:1"], ["--delta", "float32"]),
    "sweep_seeds_beyond_uint32": (["sweep", "--seeds", "99999999999999999999"],
                                  ["seeds=99999999999999999999", "<= 4294967296"]),
    "theory_scale_subnormal": (["theory", "--scale", "1e-40"], ["scale=1e-40", ">= 2^-100"]),
    "theory_scale_huge": (["theory", "--scale", "2e30"], ["scale=2e+30", "2^100"]),
    "whatif_start_outside_range": (["whatif", "optimal-scale", "--surrogate", "staircase", "--start", "100"],
                                   ["start_log2_scale=100.0", "log2_range=(-2, 10)"]),
    # filled in with a real path by the fixture: a folder under a regular file
    "sweep_out_under_a_file": (["sweep", "--n", "64", "--seeds", "1", "--out", "{afile}/sub"],
                               ["out_dir=", "afile/sub", "not writable"]),
    # report folders are checked before any work; a model folder needs its config.json
    "analyze_out_a_file": (["analyze", "{afile}", "--out", "{afile}"], ["--out=", "afile", "is an existing file"]),
    "whatif_report_out_a_file": (["whatif", "report", "--quick", "--out", "{afile}"],
                                 ["--out=", "afile", "is an existing file"]),
    "jax_fp8_sinks_file_a_folder": (["jax-fp8", "--sinks", "{folder}.npy"], ["sinks file", "not a regular file"]),
    # the JAX question on a trace: the file, the GPU, and options that contradict each other
    "jax_fp8_trace_missing": (["jax-fp8", "--trace", "{folder}/missing.npz"], ["trace file", "missing.npz",
                                                                              "does not exist"]),
    "jax_fp8_gpu_unknown": (["jax-fp8", "--gpu", "ampere"], ["--gpu='ampere'", "hopper, blackwell"]),
    "jax_fp8_tau_contradicts_gpu": (["jax-fp8", "--gpu", "hopper", "--tau", "4"],
                                    ["--tau=4", "contradicts --gpu='hopper'", "τ = 0"]),
    "jax_fp8_trace_and_synthetic": (["jax-fp8", "--trace", "{afile}", "--sinks", "3"], ["--sinks", "--trace"]),
    "jax_fp8_model_without_trace": (["jax-fp8", "--model", "{afile}"], ["--model", "only with --trace"]),
}


def _run_cli_cases(cases):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = {name: subprocess.Popen([sys.executable, "-m", "pcast_jax.cli", *argv], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env)
             for name, (argv, _) in cases.items()}
    results = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"pcast {' '.join(cases[name][0])} did not finish in 180 s")
        results[name] = (proc.returncode, out, err)
    return results


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "afile").write_text("a regular file")
    (tmp / "folder.npy").mkdir()
    cases = {name: ([a.replace("{afile}", str(tmp / "afile")).replace("{folder}", str(tmp / "folder")) for a in argv],
                    needles)
             for name, (argv, needles) in _CLI_CASES.items()}
    return cases, _run_cli_cases(cases)


@pytest.mark.parametrize("name", sorted(_CLI_CASES))
def test_cli_prints_one_error_line_and_exits_2(cli_results, name):
    cases, results = cli_results
    argv, needles = cases[name]
    code, out, err = results[name]
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert "Traceback" not in err and "Traceback" not in out
    assert len(lines) == 1, err
    assert lines[0].startswith("pcast") and "error:" in lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} missing from {lines[0]!r}"


# --------------------------------------------------------------------------------------------
# Numbers that enter float32 are checked against float32's range where they are parsed
# --------------------------------------------------------------------------------------------

from pcast_jax import theory  # noqa: E402
from pcast_jax.errors import check_f32  # noqa: E402

#: (parameter, a call that passes ``x`` as that parameter) for every public entry point of a number.
_F32_ENTRIES = {
    "delta (theory)": ("delta", lambda x: theory.collapse_fraction(x, 256.0)),
    "scale (theory)": ("scale", lambda x: theory.dp(x)),
    "sigma (theory)": ("sigma", lambda x: theory.critical_delta(256.0, sigma=x)),
    "n (theory)": ("n", lambda x: theory.reverse_underflow_prob(x, 256.0)),
    "sigma_v (theory)": ("sigma_v", lambda x: theory.mse_collapse(np.ones(4), np.ones(4, bool), x)),
    "delta (non_sink_mass)": ("delta", lambda x: theory.non_sink_mass(x)),
    "sigma (workload)": ("sigma", lambda x: workloads.SinkWorkload(n=8, sigma=x)),
    "sigma_v (workload)": ("sigma_v", lambda x: workloads.SinkWorkload(n=8, sigma_v=x)),
    "delta (spec)": ("delta", lambda x: sweep.SweepSpec(deltas=(x,), **_SMALL)),
    "sigma_v (spec)": ("sigma_v", lambda x: sweep.SweepSpec(sigma_v=x, **_SMALL)),
    "scale (config)": ("scale", lambda x: KernelConfig(scale=x)),
    "v_channel_max (config)": ("v_channel_max", lambda x: KernelConfig(accumulator="f16", v_channel_max=x)),
    "check_f32": ("x", lambda x: check_f32("x", x)),
}


@pytest.mark.parametrize("value", [3.5e38, -3.5e38, 1e39, 1e300, -1e300, np.float64(1e100)])
@pytest.mark.parametrize("entry", sorted(_F32_ENTRIES))
def test_numbers_beyond_float32_are_refused_naming_the_parameter(entry, value):
    param, call = _F32_ENTRIES[entry]
    with pytest.raises(PcastError, match=rf"\b{param}\b"):
        call(value)


@pytest.mark.parametrize("param, value", [("sigma_v", 1e30), ("sigma_v", 2e15), ("sigma", 1e19)])
def test_squared_parameters_have_a_tighter_bound(param, value):
    with pytest.raises(PcastError, match=param):
        workloads.SinkWorkload(n=8, **{param: value})
    with pytest.raises(PcastError, match=param):
        sweep.SweepSpec(**{param: value}, **_SMALL)


def test_largest_accepted_sigma_v_and_delta_give_finite_sweep_metrics():
    spec = sweep.SweepSpec(sigma_v=workloads.SIGMA_V_MAX, deltas=(workloads.DELTA_MAX, -workloads.DELTA_MAX), **_SMALL)
    res = sweep.run_sweep(spec, progress=False)
    for m in ("mse", "mse_expected", "frac_zeroed", "nonsink_mass", "zeroed_mass"):
        assert np.isfinite(res.data[m]).all(), m


# --------------------------------------------------------------------------------------------
# Every number a sweep writes is finite, or the run says why (never a silent NaN or inf)
# --------------------------------------------------------------------------------------------

from pcast_jax.presets import PRESETS  # noqa: E402


@pytest.mark.parametrize("part", [0, 1], ids=["presets-even", "presets-odd"])
def test_every_preset_is_finite_and_sane_at_the_largest_sigma(part):
    """The accepted σ range is where every preset's metrics are finite (and measure the cast); every other
    preset per case, so the two halves of a halved run (tests/cases.py) sweep each preset once."""
    spec = sweep.SweepSpec(configs=tuple(PRESETS)[part::2], ns=(512,), seeds=1, q_len=2, d=4,
                           sigma=workloads.SIGMA_MAX, deltas=(7.0, workloads.DELTA_MAX, -workloads.DELTA_MAX))
    res = sweep.run_sweep(spec, progress=False)
    for m in ("mse", "mse_expected", "frac_zeroed", "nonsink_mass", "zeroed_mass"):
        assert np.isfinite(res.data[m]).all(), m
    assert float(np.max(res.data["mse"])) < 1.0  # a convex combination of V rows with sigma_v = 1
    for sigma in (np.nextafter(workloads.SIGMA_MAX, np.inf), 1e12, 1e18):
        with pytest.raises(PcastError, match=r"sigma=.* must be <= 65536"):
            sweep.SweepSpec(configs=("fa3",), ns=(64,), seeds=1, sigma=sigma)
    for delta in (np.nextafter(workloads.DELTA_MAX, np.inf), -1.2e38):
        with pytest.raises(PcastError, match=r"delta=.* must be <= 4.25353e\+37 = 2\^125"):
            sweep.SweepSpec(configs=("fa3",), ns=(64,), seeds=1, deltas=(delta,))


def test_a_non_finite_metric_stops_the_sweep_naming_where_and_is_never_written(tmp_path):
    nan_cast = KernelConfig(name="nan_cast", scale=1024.0, overflow="nan")  # P*S >= 464 is NaN
    spec = sweep.SweepSpec(configs=("fwd_s1", nan_cast), ns=(64,), seeds=2, q_len=2, d=4)
    with pytest.raises(PcastError) as info:
        sweep.run_sweep(spec, out_dir=tmp_path / "o", progress=False)
    msg = str(info.value)
    assert "\n" not in msg
    for needle in ("config='nan_cast'", "overflow='nan'", "N=64", "delta=7", "sigma=1", "non-finite"):
        assert needle in msg, (needle, msg)
    assert not list((tmp_path / "o").glob("chunks/*.npz")) and not (tmp_path / "o" / "results.npz").exists()
    skipped = sweep.SweepSpec(configs=("fwd_s1",), ns=(64,), seeds=1, q_len=2, d=4, expected_mse=False)
    assert np.isnan(sweep.run_sweep(skipped, progress=False).data["mse_expected"]).all()  # off is NaN by definition


@pytest.mark.parametrize("preset", ["fwd_s1", "fa3", "sageattn2", "nvfp4_fakequant", "mxfp8_p"])
def test_values_that_overflow_the_accumulator_are_refused_naming_v(preset):
    v = np.full((8, 3), 3e38, np.float32)
    for call in (lambda: engine.attention(_SCORES, v, preset),
                 lambda: engine.attention(_SCORES, v, preset, implementation="scan")):
        with pytest.raises(PcastError, match=r"^v \(max \|v\| = 3e\+38\) gives a non-finite output") as info:
            call()
        assert f"config={preset!r}" in str(info.value)
    assert np.isfinite(np.asarray(engine.attention(_SCORES, v / 3e8, preset).out)).all()


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("delta", [84.0, 85.0, 89.0, 100.0, 1e4, 1e30, -1e30])
def test_non_sink_mass_gradient_is_finite_where_the_value_is(delta, per_row):
    value = theory.non_sink_mass(delta, per_row=per_row)
    grads = jax.grad(lambda d, s: theory.non_sink_mass(d, sigma=s, per_row=per_row), argnums=(0, 1))(delta, 1.0)
    assert np.isfinite(value) and all(np.isfinite(g) for g in grads)


def test_probabilities_stay_in_the_unit_interval():
    deltas = np.concatenate([-np.logspace(-3, 30, 12), np.linspace(-50, 150, 41), np.logspace(-3, 30, 12)])
    scales = np.array([2.0 ** -100, 1e-3, 1.0, 448.0, 2.0 ** 100])
    for s in scales:
        for got in (theory.collapse_fraction(deltas, s), theory.collapse_fraction_spread(deltas, s),
                    theory.reverse_underflow_prob(4096, s), theory.reverse_underflow_prob(4096, s, max_model="mean")):
            got = np.asarray(got)
            assert np.all((got >= 0) & (got <= 1)), (s, got.max(), got.min())
    for per_row in (True, False):
        got = np.asarray(theory.non_sink_mass(deltas, per_row=per_row))
        assert np.all((got >= 0) & (got <= 1)), (per_row, got.max(), got.min())


def test_numpy_numbers_are_accepted_where_python_numbers_are(tmp_path):
    plain = sweep.SweepSpec(**{**_SMALL, "ns": (64,), "seeds": 2}, deltas=(7.0,), sigma=1.5, sink_positions=(0, 3))
    numpy = sweep.SweepSpec(configs=("fwd_s1",), ns=(np.int32(64),), seeds=np.int64(2), q_len=np.int64(2),
                            d=np.uint8(4), deltas=(np.float32(7.0),), sigma=np.float32(1.5),
                            sink_positions=(np.int64(0), np.int16(3)), seed_offset=np.int64(0))
    assert numpy.fingerprint() == plain.fingerprint()
    sweep.run_sweep(numpy, tmp_path / "o", progress=False)  # spec.json is JSON: no crash
    assert sweep.load_result(tmp_path / "o").spec == plain
    cfg = KernelConfig(block_kv=np.int64(64), kv_splits=np.int32(2), accumulator="f16",
                       v_channel_max=np.float32(2.0))
    assert type(cfg.block_kv) is int and type(cfg.kv_splits) is int and type(cfg.v_channel_max) is float


# --------------------------------------------------------------------------------------------
# Pallas entry point: array descales and non-finite input
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [NAN, 0.0, -1.0, INF, 1e39])
@pytest.mark.parametrize("kind", ["jax array", "numpy 0-d", "float"])
def test_pallas_descales_are_checked_also_as_arrays(kind, bad):
    from pallas_kernels import api

    value = {"jax array": jnp.asarray(bad, jnp.float64 if bad == 1e39 else jnp.float32),
             "numpy 0-d": np.asarray(bad), "float": bad}[kind]
    if kind == "jax array" and bad == 1e39:
        value = np.asarray(bad)  # jax would hold it as float32 inf already
    with pytest.raises(PcastError, match="k_descale"):
        api._check_descale("k_descale", value)
    assert float(api._check_descale("k_descale", jnp.asarray(0.5))) == 0.5


@pytest.mark.parametrize("bad", [NAN, INF, -INF, 1e39])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_quantize_qkv_refuses_non_finite_input(which, bad):
    from pallas_kernels import api

    x = {n: np.ones((1, 1, 4, 8), np.float64) for n in "qkv"}
    x[which][0, 0, 1, 2] = bad
    with pytest.raises(PcastError, match=rf"^{which} holds NaN or inf"):
        api.quantize_qkv(x["q"], x["k"], x["v"])


# --------------------------------------------------------------------------------------------
# The sweep command and the Python sweep API: everything checked first, a closed pipe skips nothing
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, param", [
    (dict(out_dir=""), "out_dir"), (dict(out_dir="  "), "out_dir"), (dict(out_dir=3), "out_dir"),
    (dict(chunk_size=0), "chunk_size"), (dict(chunk_size=2.0), "chunk_size"), (dict(progress="yes"), "progress"),
    (dict(memory_budget=-1), "memory_budget"), (dict(memory_budget=NAN), "memory_budget"),
])
def test_run_sweep_arguments_are_checked_before_any_work(tmp_path, monkeypatch, kw, param):
    from pcast_jax.sweep import local

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(local, "compute_chunk", lambda *a, **k: pytest.fail("computed before checking"))
    with pytest.raises(PcastError, match=param):
        sweep.run_sweep(sweep.SweepSpec(**_SMALL), **kw)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option, value, named", [
    ("--out", "", "--out"), ("--sigma-v", "1e30", "sigma_v"), ("--sigma", "1e300", "sigma"),
    ("--delta", "1e39", "delta"), ("--sigma", "1e12", "sigma"), ("--init-timeout", "1e12", "init_timeout"), ("--heartbeat-timeout", "1e12", "heartbeat_timeout"),
])
def test_cli_sweep_refuses_before_any_work(tmp_path, monkeypatch, capsys, option, value, named):
    from pcast_jax import cli
    from pcast_jax.sweep import local

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(local, "compute_chunk", lambda *a, **k: pytest.fail("computed before checking"))
    args = ["sweep", "--n", "64", "--seeds", "2", "--q-len", "2", "--d", "4", "--configs", "fwd_s1",
            "--no-progress", option, value]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pcast: error:") and named in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option, value", [("--sigma", "1e300"), ("--scale", "1e300"), ("--delta", "1e39"),
                                           ("--sigma", "1e19")])
def test_cli_theory_refuses_numbers_beyond_float32(capsys, option, value):
    from pcast_jax import cli

    assert cli.main(["theory", option, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option.lstrip("-") in err[0], err


def test_closed_output_pipe_never_skips_the_sweep(tmp_path):
    """`pcast sweep ... | head -0`: printing stops, the sweep still finishes and writes its results."""
    out = tmp_path / "o"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pcast_jax.cli", "sweep", "--n", "64", "--seeds", "2", "--q-len", "2", "--d", "4",
         "--configs", "fwd_s1", "--no-progress", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err
    res = sweep.load_result(out)
    assert np.isfinite(res.data["mse"]).all()


# --------------------------------------------------------------------------------------------
# Flags: ranges keep their values, negative values need no '=', analyses say why a ratio is missing
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, count", [("0:5e-13:1e-13", 6), ("0:1:0.1", 11), ("-2:2:1", 5), ("1e-40:1e-39:1e-40", 10)])
def test_a_range_keeps_every_value_distinct_in_float32(text, count):
    from pcast_jax.commands import _options

    vals = _options.floats("--delta", text)
    assert len(vals) == count and len(set(np.float32(vals).tolist())) == count, vals
    assert vals[0] == float(text.split(":")[0]) and vals[-1] == pytest.approx(float(text.split(":")[1]))


@pytest.mark.parametrize("argv, dest, value", [
    (["sweep", "--delta", "-2:2:1"], "delta", "-2:2:1"), (["sweep", "--sigma", "-1e3"], "sigma", "-1e3"),
    (["theory", "--delta", "-.5"], "delta", -0.5), (["whatif", "optimal-scale", "--start", "-1.5"], "start", -1.5),
])
def test_negative_values_need_no_equals_sign(argv, dest, value):
    from pcast_jax import cli

    args = cli.build_parser(argv).parse_args(argv)
    assert getattr(args, dest) == value


def test_optimal_scale_on_scores_without_error_says_why_there_is_no_ratio():
    whatif = _whatif()
    r = whatif.optimal_scale(scores=np.zeros((1, 4, 256), np.float32), steps=3, curve_points=0)
    assert r.at_256 == 0.0
    rows = r.rows()
    assert all(row["rel_to_256"] == "n/a: MSE at S=256 is 0" for row in rows)
    assert all(np.isfinite(row["exact_mse"]) for row in rows)
    report.cell_table(rows, ["scale", "exact_mse", "rel_to_256"])  # published: words, not nan
    with pytest.raises(PcastError, match=r"start_log2_scale=100 must lie in log2_range=\(-2, 10\)"):
        whatif.optimal_scale(scores=np.zeros((1, 4, 256), np.float32), start_log2_scale=100, steps=3)


@pytest.mark.parametrize("scale", [2.0**-100, 2.0**100])
def test_every_theory_row_is_finite_at_the_scale_edges(scale):
    from pcast_jax.commands import theory as theory_cmd

    table = theory_cmd.rows(delta=7.0, scale=scale, k_sink=4, sigma=1.0, n=4096, fmt="e4m3")
    values = [float(row[2]) for row in table if row[0] != "power_of_two"]
    assert len(values) >= 10 and np.isfinite(values).all(), table


# --------------------------------------------------------------------------------------------
# Files a user brings: bounded in size, depth and inflation before they are parsed
# --------------------------------------------------------------------------------------------

import tracemalloc  # noqa: E402
import zipfile  # noqa: E402

from pcast_jax import fileio  # noqa: E402
from pcast_jax.sweep import plan, store  # noqa: E402


def _config_file_error(capsys, path) -> str:
    from pcast_jax import cli

    assert cli.main(["sweep", "--n", "64", "--seeds", "1", "--config-file", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pcast: error: --config-file="), err
    return err[0]


def _hostile(tmp_path, kind):
    path = tmp_path / f"{kind}.toml"
    if kind == "directory":
        path.mkdir()
    elif kind == "pipe":  # opening it for reading would wait for a writer forever
        os.mkfifo(path)
    elif kind == "binary":
        path.write_bytes(bytes(range(256)) * 64)
    elif kind == "deep_array":
        path.write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    elif kind == "deep_table":
        path.write_text("a = " + "{b = " * 5_000 + "1" + "}" * 5_000 + "\n")
    elif kind == "deep_dotted_key":  # 200 kB that Python's TOML reader would need ~100 GB for
        path.write_text("a" + ".a" * 100_000 + " = 1\n")
    elif kind == "huge":
        with open(path, "w") as f:
            f.write("[[kernel]]\nname = 'x'\n" + "# padding\n" * (fileio.MAX_TOML_BYTES // 10 + 1))
    return path


@pytest.mark.parametrize("kind, needle", [
    ("directory", "not a regular file"), ("pipe", "not a regular file"), ("binary", "not UTF-8 text"),
    ("deep_array", "nests deeper than 16"), ("deep_table", "nests deeper than 16"),
    ("deep_dotted_key", "nests deeper than 16"), ("huge", "at most 1 MiB"), ("missing", "does not exist"),
])
def test_hostile_config_files_give_one_line_naming_the_option(tmp_path, capsys, kind, needle):
    line = _config_file_error(capsys, _hostile(tmp_path, kind))
    assert needle in line, line


def test_an_endless_device_as_config_file_is_refused_without_reading_it(capsys):
    tracemalloc.start()
    try:
        line = _config_file_error(capsys, "/dev/zero")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "--config-file='/dev/zero' is not a regular file" in line
    assert peak < 64 * 2**20, peak


def test_a_config_file_within_the_bounds_still_loads(tmp_path, capsys):
    from pcast_jax.commands import _options

    path = tmp_path / "ok.toml"
    nested = "note = " + "[" * 14 + "1" + "]" * 14 + "\n"  # deep, but within the bound: only the keys are refused
    path.write_text("[[kernel]]\nname = 'mine[[[{{'\nscale = 64.0\n# [[[[ [ [ { in a comment\n")
    assert [c.name for c in _options.config_file(path)] == ["mine[[[{{"]
    path.write_text("[[kernel]]\nname = 'mine'\n" + nested)
    with pytest.raises(PcastError, match=r"--config-file=.*kernel 1.*note"):
        _options.config_file(path)


def test_a_deeply_nested_spec_json_is_refused_naming_the_file(tmp_path, monkeypatch, no_compute):
    out = tmp_path / "out"
    _claim(out, _spec(), monkeypatch)
    (out / "spec.json").write_text('{"spec": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(PcastError, match=r"spec.json nests deeper than 16 levels.*spec.json is unreadable"):
        sweep.run_sweep(_spec(), out_dir=out)


def _npz_bomb(path, *, inflated: int, header_shape=None):
    """An .npz whose one member inflates to ``inflated`` bytes (or whose header claims ``header_shape``)."""
    shape = header_shape or (inflated // 4,)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        with zf.open("m_mse.npy", "w", force_zip64=True) as f:
            f.write(header.getvalue())
            block = bytes(2**20)
            for _ in range(inflated // len(block)):
                f.write(block)
    return path


def _chunk_of(spec, out):
    layout = store.read_manifest(out)["layout"]
    unit = plan.units(spec, layout)[0]
    return unit, store.chunk_path(out, spec, unit)


@pytest.mark.parametrize("bomb", ["inflates", "lying_header"])
def test_a_chunk_that_inflates_is_refused_in_bounded_memory_and_recomputed(tmp_path, bomb):
    out = tmp_path / "out"
    spec = _spec()
    first = sweep.run_sweep(spec, out_dir=out, progress=False)
    unit, path = _chunk_of(spec, out)
    size = 64 * 2**20 if bomb == "inflates" else 2**20
    _npz_bomb(path, inflated=size, header_shape=None if bomb == "inflates" else (2**40,))
    assert path.stat().st_size < 2 * 2**20  # small on disk
    tracemalloc.start()
    try:
        why = store.check_chunk(path, spec, unit)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(why, str) and ("inflates to" in why or "declares" in why), why
    assert "not a readable" not in why, why  # the bound's own line, not wrapped in another
    assert peak < 16 * 2**20, peak  # never the 64 MiB (or 4 TiB) the file claims
    (out / "results.npz").unlink()
    again = sweep.run_sweep(spec, out_dir=out, progress=False)  # removed and recomputed, bit for bit
    for m in ("mse", "frac_zeroed"):
        np.testing.assert_array_equal(again.data[m], first.data[m])


def test_a_results_file_that_inflates_is_refused_naming_it(tmp_path):
    out = tmp_path / "out"
    sweep.run_sweep(_spec(), out_dir=out, progress=False)
    _npz_bomb(out / "results.npz", inflated=64 * 2**20)
    with pytest.raises(PcastError, match=r"results.npz.* inflates to 64 MiB; at most"):
        sweep.load_result(out)


def test_a_scores_file_with_a_lying_header_is_refused_naming_the_option(tmp_path, capsys):
    from pcast_jax import cli

    path = tmp_path / "scores.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (2**20, 2**20)})
        f.write(bytes(64))
    assert cli.main(["whatif", "optimal-scale", "--scores", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--scores=" in err[0] and "declares (1048576, 1048576)" in err[0], err
    np.save(path, np.zeros((2, 3), np.float32))
    assert fileio.load_npy(path, what="x", max_bytes=2**10).shape == (2, 3)
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(PcastError, match="holds Python objects"):
        fileio.load_npy(path, what="--scores", max_bytes=2**10)


# --------------------------------------------------------------------------------------------
# Theory gradients in sigma: finite down to sigma -> 0 and equal to finite differences at sigma = 1
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["collapse_fraction", "collapse_fraction_spread"])
@pytest.mark.parametrize("sigma", [1e-3, 1e-10, 1e-30, 1e-37])
@pytest.mark.parametrize("delta", [7.0, 11.45, 30.0])
def test_collapse_fraction_gradient_in_sigma_is_finite_near_zero(name, sigma, delta):
    fn = getattr(theory, name)
    grad = jax.grad(lambda s: fn(delta, 256.0, sigma=s))(sigma)
    assert np.isfinite(grad) and np.isfinite(fn(delta, 256.0, sigma=sigma)), grad


@pytest.mark.parametrize("name, kw", [("collapse_fraction", {}), ("collapse_fraction_spread", {}),
                                      ("block_collapse_fraction", {"fmt": "nvfp4"}),
                                      ("block_collapse_fraction", {"fmt": "mxfp8"})])
def test_sigma_gradients_equal_finite_differences(name, kw):
    fn = getattr(theory, name)
    for delta in (7.0, 11.0):
        grad = float(jax.grad(lambda s: fn(delta, 256.0, sigma=s, **kw))(1.0))
        h = 1e-2
        fd = (float(fn(delta, 256.0, sigma=1.0 + h, **kw)) - float(fn(delta, 256.0, sigma=1.0 - h, **kw))) / (2 * h)
        assert np.isfinite(grad) and abs(grad - fd) <= 2e-2 * abs(fd) + 1e-5, (delta, grad, fd)


@pytest.mark.parametrize("fmt", ["table", "csv", "json", "md"])
def test_one_seed_or_a_switched_off_metric_is_missing_never_nan(tmp_path, monkeypatch, capsys, fmt):
    """A summary never prints nan: one seed has no standard error, a metric switched off has no mean."""
    import csv as csv_

    from pcast_jax import cli

    monkeypatch.chdir(tmp_path)
    argv = ["sweep", "--n", "64", "--seeds", "1", "--q-len", "2", "--d", "4", "--configs", "fwd_s1", "--no-progress",
            "--no-expected-mse", "--out", "o", "--format", fmt]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "nan" not in out.lower(), out
    if fmt in ("table", "md"):
        assert "± n/a" in out
    with open(tmp_path / "o" / "summary.csv", newline="") as f:
        (row,) = list(csv_.DictReader(f))
    assert row["mse_sem"] == "" and row["mse_expected_mean"] == "" and float(row["mse_mean"]) > 0, row
    assert "nan" not in (tmp_path / "o" / "summary.csv").read_text().lower()


# --------------------------------------------------------------------------------------------
# A non-finite learned sink under jax.jit: NaN rows in every config, never a finite number
# --------------------------------------------------------------------------------------------

_SINKS = np.array([NAN, INF, -INF, 0.5], np.float32)  # one per head: three non-finite, one finite


def _jit_sink_attention(preset, implementation="xla"):
    from pcast_jax import nn

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 4, 4)).astype(np.float32) for _ in range(3))
    fn = jax.jit(lambda q, k, v, s: nn.dot_product_attention(q, k, v, is_causal=True, config=preset, sinks=s,
                                                             implementation=implementation))
    return np.asarray(fn(q, k, v, _SINKS)), v


@pytest.mark.parametrize("preset", [None, *PRESETS])
def test_a_non_finite_sink_under_jit_gives_nan_in_every_config(preset):
    out, v = _jit_sink_attention(preset)
    assert np.isnan(out[..., :3, :]).all(), (preset, out[..., :3, :])
    # the finite head is a convex combination of the values, scaled down by the sink's share
    finite = out[..., 3, :]
    assert np.isfinite(finite).all() and np.abs(finite).max() <= np.abs(v[..., 3, :]).max() * 1.01, preset


@pytest.mark.parametrize("preset", ["fa3", "rev_s256", "flashinfer_sm90", "fa3_splitkv"])
def test_a_non_finite_sink_under_jit_gives_nan_in_the_scan_engine(preset):
    out, _ = _jit_sink_attention(preset, implementation="scan")
    assert np.isnan(out[..., :3, :]).all() and np.isfinite(out[..., 3, :]).all(), preset


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_a_non_finite_sink_under_jit_gives_nan_in_the_pallas_kernels(backend):
    """The kernels (interpret mode without a GPU) agree with the simulator: NaN rows, the finite head finite."""
    from pcast_jax import nn

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 64, 4, 64)).astype(np.float32) for _ in range(3))
    fn = jax.jit(lambda q, k, v, s: nn.dot_product_attention(q, k, v, is_causal=True, config="fa3", sinks=s,
                                                             implementation=backend))
    out = np.asarray(fn(q, k, v, _SINKS))
    assert np.isnan(out[..., :3, :]).all() and np.isfinite(out[..., 3, :]).all(), backend


def test_a_non_finite_sink_is_refused_eagerly():
    from pcast_jax import nn

    x = np.ones((1, 4, 4, 4), np.float32)
    with pytest.raises(PcastError, match="sinks contains NaN or inf"):
        nn.dot_product_attention(x, x, x, is_causal=True, config="fa3", sinks=_SINKS)


# --------------------------------------------------------------------------------------------
# pcast analyze on the smallest valid trace: one layer, one head (a mean with no standard error)
# --------------------------------------------------------------------------------------------


def _one_head_trace(path, T=32, D=8):
    from pcast_jax.analysis import Trace

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, T, 1, D)).astype(np.float32) for _ in range(3))
    k[0, 0, 0] *= 6.0  # a sink key
    Trace(q=q, k=k, v=v, lengths=np.array([T]), layers=("block0",)).save(path)
    return path


def test_analyze_of_one_layer_and_one_head_says_there_is_no_standard_error(tmp_path, capsys):
    import csv as csv_

    from pcast_jax import cli
    from pcast_jax.stats import NO_SE

    trace = _one_head_trace(tmp_path / "one.npz")
    assert cli.main(["analyze", str(trace), "--configs", "fwd_s1,fa3", "--out", str(tmp_path / "a"),
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out.lower(), out
    for name in ("analysis.md", "analysis_configs.csv"):
        assert "nan" not in (tmp_path / "a" / name).read_text().lower(), name
    with open(tmp_path / "a" / "analysis_configs.csv", newline="") as f:
        rows = list(csv_.DictReader(f))
    assert [r["heads"] for r in rows] == ["1", "1"]
    assert all(r["zeroed_mass_sem"] == NO_SE and float(r["zeroed_mass_mean"]) >= 0.0 for r in rows), rows


# --------------------------------------------------------------------------------------------
# Hugging Face checkpoints: every JSON read bounded, the safetensors layout validated, fields that
# change the model refused; each damage one line naming the file and the field
# --------------------------------------------------------------------------------------------

import json  # noqa: E402
import struct  # noqa: E402

_HF_CONFIG = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "vocab_size": 16, "max_position_embeddings": 32, "tie_word_embeddings": True}


def _hf_tensors():
    """A one-layer llama's weights under Hugging Face names (hidden 8, heads 2 × 4, one KV head)."""
    shapes = {"model.embed_tokens.weight": (16, 8), "model.norm.weight": (8,),
              "model.layers.0.input_layernorm.weight": (8,), "model.layers.0.post_attention_layernorm.weight": (8,),
              "model.layers.0.self_attn.q_proj.weight": (8, 8), "model.layers.0.self_attn.k_proj.weight": (4, 8),
              "model.layers.0.self_attn.v_proj.weight": (4, 8), "model.layers.0.self_attn.o_proj.weight": (8, 8),
              "model.layers.0.mlp.gate_proj.weight": (8, 8), "model.layers.0.mlp.up_proj.weight": (8, 8),
              "model.layers.0.mlp.down_proj.weight": (8, 8)}
    rng = np.random.default_rng(0)
    return {name: rng.normal(size=shape).astype(np.float32) * 0.1 for name, shape in shapes.items()}


def _safetensors_bytes(tensors: dict, edit=None) -> bytes:
    """A safetensors file from the format's definition; ``edit(header)`` changes the header first."""
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        data = np.asarray(value, "<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(value.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode() if edit is None else edit(header)
    return struct.pack("<Q", len(raw)) + raw + b"".join(blobs)


def _hf_folder(path, *, config=None, shards=None, edit=None):
    """A checkpoint folder: config.json (``config`` merged in), one file or ``shards`` {file: names}."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**_HF_CONFIG, **(config or {})}))
    tensors = _hf_tensors()
    if shards is None:
        (path / "model.safetensors").write_bytes(_safetensors_bytes(tensors, edit))
    else:
        for file, names in shards.items():
            (path / file).write_bytes(_safetensors_bytes({n: tensors[n] for n in names}))
    return path


def _edit_entry(key, value, name="model.norm.weight"):
    def edit(header):
        header[name][key] = value
        return json.dumps(header).encode()
    return edit


def _two_halves():
    names = list(_hf_tensors())
    return {"a.safetensors": names[:6], "b.safetensors": names[5:]}  # names[5] in both


def _index(folder_maker, weight_map_of):
    def make(path):
        names = list(_hf_tensors())
        folder = _hf_folder(path, shards={"a.safetensors": names})
        (folder / "model.safetensors.index.json").write_text(weight_map_of(names))
        return folder
    return make


def _write_over(file, text):
    def make(path):
        folder = _hf_folder(path)
        target = folder / file
        target.unlink(missing_ok=True)
        if text is None:
            os.mkfifo(target)
        else:
            target.write_bytes(text.encode() if isinstance(text, str) else text)
        return folder
    return make


def _deep_header(path):
    folder = _hf_folder(path)
    raw = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return folder


def _truncated(path):
    folder = _hf_folder(path)
    raw = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(raw[:-40])
    return folder


def _long_digits_header(path):
    return _hf_folder(path, edit=lambda h: json.dumps(h).replace('"shape": [8]', '"shape": [' + "9" * 5000 + "]")
                      .encode())


def _overlapping(header):
    first = next(iter(header.values()))["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [first[0], first[0] + 32]
    return json.dumps(header).encode()


#: (id, a function of a fresh folder path that writes the damaged checkpoint, substrings of the one line)
HF_CASES = [
    ("no_config_json", lambda p: (p.mkdir(), p)[1], ["no config.json"]),
    ("config_not_json", _write_over("config.json", "{model_type: llama"), ["config.json is not valid JSON"]),
    ("config_deep", _write_over("config.json", "[" * 100_000 + "]" * 100_000), ["config.json nests deeper than 16"]),
    ("config_5000_digits", _write_over("config.json", '{"hidden_size": ' + "7" * 5000 + "}"),
     ["config.json is not valid JSON", "digits"]),
    ("config_fifo", _write_over("config.json", None), ["config.json is not a regular file"]),
    ("config_layers_1e9", lambda p: _hf_folder(p, config={"num_hidden_layers": 1e9}),
     ["config.json", "'num_hidden_layers' = 1000000000", "the budget is"]),
    ("config_hidden_70_bits", lambda p: _hf_folder(p, config={"hidden_size": 2**70}),
     ["config.json", "'hidden_size' = an integer of 71 bits"]),
    ("config_rope_theta_inf", lambda p: _hf_folder(p, config={"rope_theta": 1e400}),
     ["config.json", "'rope_theta' = inf", "finite"]),
    ("llama_mlp_bias", lambda p: _hf_folder(p, config={"mlp_bias": True}), ["config.json", "'mlp_bias' = True"]),
    ("qwen2_sliding_window", lambda p: _hf_folder(p, config={"model_type": "qwen2", "use_sliding_window": True}),
     ["config.json", "'use_sliding_window' = True", "qwen2"]),
    ("header_deep", _deep_header, ["model.safetensors: field 'header' nests deeper than 16"]),
    ("header_5000_digits", _long_digits_header, ["model.safetensors: field 'header' is not valid JSON", "digits"]),
    ("shape_not_a_list", lambda p: _hf_folder(p, edit=_edit_entry("shape", 16)), ["'model.norm.weight'",
                                                                                  "field 'shape' = 16"]),
    ("dtype_a_list", lambda p: _hf_folder(p, edit=_edit_entry("dtype", ["F32"])),
     ["'model.norm.weight'", "field 'dtype' = ['F32']"]),
    ("shape_product_overflows", lambda p: _hf_folder(p, edit=_edit_entry("shape", [2**40, 2**40])),
     ["'model.norm.weight'", "field 'shape' = [1099511627776, 1099511627776]"]),
    ("data_offsets_overlap", lambda p: _hf_folder(p, edit=_overlapping), ["model.safetensors", "invalid offset"]),
    ("data_offsets_truncated", _truncated, ["model.safetensors", "field 'data_offsets'", "truncated"]),
    ("shard_fifo", _write_over("model.safetensors", None), ["model.safetensors is not a regular file"]),
    ("tensor_in_two_shards", lambda p: _hf_folder(p, shards=_two_halves()), ["is in two files", "a.safetensors",
                                                                              "b.safetensors"]),
    ("index_parent_path", _index(None, lambda ns: json.dumps({"weight_map": {n: "../x.safetensors" for n in ns}})),
     ["model.safetensors.index.json", "'../x.safetensors', outside the checkpoint folder"]),
    ("index_absolute_path", _index(None, lambda ns: json.dumps({"weight_map": {n: "/etc/x.safetensors" for n in ns}})),
     ["model.safetensors.index.json", "outside the checkpoint folder"]),
    ("index_deep", _index(None, lambda ns: '{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}"),
     ["model.safetensors.index.json nests deeper than 16"]),
    ("index_weight_map_a_list", _index(None, lambda ns: json.dumps({"weight_map": ns})),
     ["model.safetensors.index.json", "field 'weight_map'"]),
]


@pytest.mark.parametrize("make, needles", [pytest.param(m, n, id=i) for i, m, n in HF_CASES])
def test_damaged_hugging_face_checkpoints_give_one_line_naming_file_and_field(tmp_path, make, needles):
    pytest.importorskip("safetensors")
    from pcast_jax.models.hf_loader import read_hf_checkpoint

    folder = make(tmp_path / "ckpt")
    with pytest.raises(PcastError) as info:
        read_hf_checkpoint(folder)
    message = str(info.value)
    assert "\n" not in message and str(folder) in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} missing from {message!r}"


def test_the_undamaged_checkpoint_of_the_hostile_cases_loads(tmp_path):
    pytest.importorskip("safetensors")
    from pcast_jax.models.hf_loader import read_hf_checkpoint

    names = list(_hf_tensors())
    for folder in (_hf_folder(tmp_path / "one"), _hf_folder(tmp_path / "two", shards={"a.safetensors": names[:6],
                                                                                       "b.safetensors": names[6:]})):
        cfg, flat = read_hf_checkpoint(folder)
        assert cfg.num_layers == 1 and flat["layers.wk"].shape == (1, 4, 8)
        np.testing.assert_array_equal(flat["final_norm"], _hf_tensors()["model.norm.weight"])


@pytest.mark.parametrize("text, needle", [("{", "is not valid JSON"), ('{"model": 3}', "not a tokenizer"),
                                          ("[" * 100_000, "nests deeper than 16")])
def test_a_damaged_tokenizer_json_is_one_line_naming_it(tmp_path, text, needle):
    pytest.importorskip("tokenizers")
    from pcast_jax.models import load_tokenizer

    folder = _write_over("tokenizer.json", text)(tmp_path / "ckpt")
    with pytest.raises(PcastError, match=needle) as info:
        load_tokenizer(folder)
    assert "tokenizer.json" in str(info.value) and "\n" not in str(info.value)


def test_a_folder_without_config_json_is_named_as_a_checkpoint_folder(tmp_path):
    from pcast_jax.models import load_model

    (tmp_path / "ckpt").mkdir()
    with pytest.raises(PcastError, match="ckpt: no config.json"):
        load_model(tmp_path / "ckpt")


# --------------------------------------------------------------------------------------------
# jax_fp8 files and placeholders; pcast analyze / whatif report / reproduce refuse or say why first
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, needle", [("complex", "real numbers"), ("pipe", "is not a regular file"),
                                          ("pickle", "holds Python objects"), ("directory", "not a regular file")])
def test_a_sinks_file_that_is_not_real_logits_is_refused_naming_it(tmp_path, kind, needle):
    from pcast_jax import jax_fp8

    path = tmp_path / "sinks.npy"
    if kind == "complex":
        np.save(path, np.array([4.0 + 1.0j, 2.0]))
    elif kind == "pipe":
        os.mkfifo(path)
    elif kind == "pickle":
        np.save(path, np.array([4.0, None], dtype=object), allow_pickle=True)
    else:
        path.mkdir()
    with pytest.raises(PcastError, match=needle) as info:
        jax_fp8.predict(seq_len=256, head_dim=16, seeds=2, sinks=str(path))
    assert "\n" not in str(info.value) and ("sinks" in str(info.value))


def test_jax_fp8_without_a_sink_prints_no_theory_figure(capsys):
    from pcast_jax import cli, jax_fp8

    r = jax_fp8.predict(seq_len=256, head_dim=16, seeds=2)
    assert np.isnan(r.theory_frac_zeroed).all() and np.isfinite(r.frac_zeroed).all()
    assert cli.main(["jax-fp8", "--seq-len", "256", "--head-dim", "16", "--seeds", "2"]) == 0
    text = capsys.readouterr().out
    assert jax_fp8.NO_THEORY in text and "theory 0.0" not in text and "nan" not in text.lower(), text
    assert cli.main(["jax-fp8", "--seq-len", "256", "--head-dim", "16", "--seeds", "2", "--format", "json"]) == 0
    (head,) = json.loads(capsys.readouterr().out)["heads"]
    assert head["theory_frac_zeroed"] == jax_fp8.NO_THEORY and head["sink_logit"] is None
    with_sink = jax_fp8.predict(seq_len=256, head_dim=16, seeds=2, sinks=[8.0], gpu="hopper")
    assert 0.0 < with_sink.theory_frac_zeroed[0] <= 1.0 and "theory " in with_sink.summary()


def test_jax_fp8_beyond_the_memory_budget_is_refused_naming_the_size_and_the_budget(capsys, monkeypatch):
    from pcast_jax import cli
    from pcast_jax.sweep import plan as plan_

    monkeypatch.setattr(plan_, "default_budget", lambda: 2**30)  # a 1 GiB machine
    assert cli.main(["jax-fp8", "--seq-len", "1048576"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "seq_len=1048576" in line and "the budget is 1 GiB" in line, line


@pytest.fixture
def no_analysis(monkeypatch):
    import pcast_experiments.whatif_report as whatif_report
    import pcast_jax.analysis as analysis_mod

    def refuse(*_a, **_k):
        raise _Computed("work started before the arguments were checked")

    monkeypatch.setattr(analysis_mod, "analyze", refuse)
    monkeypatch.setattr(analysis_mod, "load_trace", refuse)
    monkeypatch.setattr(whatif_report, "run_study", refuse)


def _cli_error(capsys, argv) -> str:
    from pcast_jax import cli

    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pcast: error:"), err
    return err[0]


def test_analyze_out_an_existing_file_is_refused_before_any_work(tmp_path, capsys, no_analysis):
    (tmp_path / "report.md").write_text("a file the user keeps")
    line = _cli_error(capsys, ["analyze", str(tmp_path / "t.npz"), "--out", str(tmp_path / "report.md")])
    assert "--out=" in line and "is an existing file" in line, line
    assert (tmp_path / "report.md").read_text() == "a file the user keeps"
    line = _cli_error(capsys, ["analyze", str(tmp_path / "t.npz"), "--out", str(tmp_path / "report.md" / "sub")])
    assert "not a folder" in line, line


def test_whatif_report_out_a_file_is_refused_before_any_work(tmp_path, capsys, no_analysis):
    (tmp_path / "keep.csv").write_text("a,b\n")
    line = _cli_error(capsys, ["whatif", "report", "--quick", "--out", str(tmp_path / "keep.csv")])
    assert "--out=" in line and "is an existing file" in line, line


def test_analyze_of_a_pipe_is_refused_without_reading_it(tmp_path, capsys, no_analysis):
    os.mkfifo(tmp_path / "trace.npz")
    line = _cli_error(capsys, ["analyze", str(tmp_path / "trace.npz"), "--out", str(tmp_path / "a")])
    assert "trace file" in line and "is not a regular file" in line, line


def test_analyze_with_a_model_that_did_not_make_the_trace_is_refused_before_the_analysis(tmp_path, capsys,
                                                                                          monkeypatch):
    pytest.importorskip("safetensors")
    import pcast_jax.analysis as analysis_mod
    from pcast_jax.analysis import Trace

    monkeypatch.setattr(analysis_mod, "analyze", lambda *a, **k: (_ for _ in ()).throw(_Computed("analysed")))
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 16, 1, 8)).astype(np.float32), rng.standard_normal((2, 1, 16, 1, 8))
    Trace(q=q, k=k.astype(np.float32), v=k.astype(np.float32), lengths=np.array([16]), layers=("a", "b"),
          tokens=np.arange(16)[None] + 10).save(tmp_path / "t.npz")
    model = _hf_folder(tmp_path / "ckpt")  # 1 layer, 2 query heads, 1 KV head, head dim 4, vocabulary 16
    line = _cli_error(capsys, ["analyze", str(tmp_path / "t.npz"), "--model", str(model), "--out",
                               str(tmp_path / "a"), "--no-progress"])
    for needle in ("does not match the trace", "layers 1 vs 2", "query heads 2 vs 1", "head dim 4 vs 8",
                   "token id 25 vs vocabulary 16"):
        assert needle in line, line
    assert "KV heads" not in line, line


@pytest.mark.parametrize("flags", [dict(quick=True), dict(only=["table1"]), {}])
def test_reproduce_runs_the_extras_asked_for_with_only_and_quick(tmp_path, monkeypatch, flags):
    """An extra asked for is run and in the report, with --only and --quick too; none is asked for by
    default there (a full run's default is the real model)."""
    import types

    registry = importlib.import_module("pcast_experiments.registry")
    common = importlib.import_module("pcast_experiments.common")
    monkeypatch.setattr(registry, "EXPERIMENTS", {"table1": "fake_paper_experiment"})
    paper = types.ModuleType("fake_paper_experiment")
    paper.run = lambda ctx: common.Section("table1", "A fake table", "intro")
    extra = types.ModuleType("fake_whatif_module")
    extra.section = lambda out_dir, quick=False, log=None: "## A fake what-if\n\nbody\n"
    monkeypatch.setitem(sys.modules, "fake_paper_experiment", paper)
    monkeypatch.setitem(sys.modules, "fake_whatif_module", extra)
    monkeypatch.setitem(registry.EXTRA_SECTIONS, "whatif", ("fake_whatif_module", "section"))
    monkeypatch.setattr(registry, "DEFAULT_EXTRAS", ("whatif",))
    report_md = registry.reproduce(tmp_path, extras=("whatif",), log=lambda line: None, **flags)
    assert "## A fake what-if" in report_md.read_text()
    default = registry.reproduce(tmp_path / "d", log=lambda line: None, **flags)
    assert ("## A fake what-if" in default.read_text()) == (not flags)


def test_analyze_with_weights_beyond_float32s_working_range_is_refused_before_the_analysis(tmp_path, capsys,
                                                                                           monkeypatch):
    pytest.importorskip("safetensors")
    import pcast_jax.analysis as analysis_mod
    from pcast_jax.analysis import Trace

    monkeypatch.setattr(analysis_mod, "analyze", lambda *a, **k: (_ for _ in ()).throw(_Computed("analysed")))
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 1, 12, 2, 4)), rng.standard_normal((1, 1, 12, 1, 4))
    Trace(q=q.astype(np.float32), k=k.astype(np.float32), v=k.astype(np.float32), lengths=np.array([12]),
          layers=("a",), tokens=np.arange(12)[None]).save(tmp_path / "t.npz")

    model = _hf_folder(tmp_path / "ckpt")
    raw = bytearray((model / "model.safetensors").read_bytes())
    length = int.from_bytes(raw[:8], "little")
    start = 8 + length + json.loads(raw[8:8 + length])["model.norm.weight"]["data_offsets"][0]
    raw[start:start + 8 * 4] = np.full(8, 3e38, "<f4").tobytes()  # the final norm at 3e38: finite, but h·E overflows
    (model / "model.safetensors").write_bytes(bytes(raw))
    line = _cli_error(capsys, ["analyze", str(tmp_path / "t.npz"), "--model", str(model), "--out",
                               str(tmp_path / "a"), "--no-progress"])
    assert "exact FP32 forward on the trace's tokens is not finite" in line and "3e+38" in line, line


def test_damaged_trace_files_give_one_line_naming_the_file(tmp_path):
    """load_trace reads through the bounded .npz reader: a truncated trace (the commonest damage), a plain
    .npy, a 0-d ``dims``, a declared shape past the memory budget and a missing file are one PcastError each."""
    from pcast_jax.analysis.capture import Trace, load_trace

    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 1, 8, 2, 4)).astype(np.float32)
    k = rng.normal(size=(1, 1, 8, 1, 4)).astype(np.float32)
    Trace(q=q, k=k, v=k, lengths=np.array([8]), layers=("l0",)).save(tmp_path / "t.npz")
    assert load_trace(tmp_path / "t.npz").q.shape == q.shape
    raw = (tmp_path / "t.npz").read_bytes()
    (tmp_path / "trunc.npz").write_bytes(raw[: len(raw) // 2])
    np.save(tmp_path / "plain.npy", np.zeros(3))
    with np.load(tmp_path / "t.npz") as z:
        fields = dict(z)
    np.savez(tmp_path / "dims0.npz", **{**fields, "dims": np.array("x")})
    header = np.lib.format.header_data_from_array_1_0(np.zeros(1, np.float32))
    import io
    import zipfile
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as zf:  # a header declaring 2^40 float32 values
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(buf, {**header, "shape": (1 << 40,)})
        zf.writestr("q.npy", buf.getvalue())
    for name, words in [("trunc.npz", "not a readable .npz"), ("plain.npy", "not a readable .npz"),
                        ("dims0.npz", "field 'dims'"), ("huge.npz", "huge.npz"), ("missing.npz", "does not exist")]:
        with pytest.raises(PcastError, match="trace file") as exc:
            load_trace(tmp_path / name)
        assert words in str(exc.value) and "\n" not in str(exc.value), (name, str(exc.value))


# --------------------------------------------------------------------------------------------
# Finite but huge trace values: refused at load, naming the file, the field and the layer
# --------------------------------------------------------------------------------------------


def _trace_fields(T=8, D=4):
    rng = np.random.default_rng(0)
    q = rng.uniform(-1, 1, (2, 1, T, 2, D)).astype(np.float32)
    k, v = (rng.uniform(-1, 1, (2, 1, T, 1, D)).astype(np.float32) for _ in range(2))
    return dict(q=q, k=k, v=v, lengths=np.array([T]), layers=("l0", "l1"))


@pytest.mark.parametrize("change, needles", [
    (dict(q=1e10, k=1e10), ["fields 'q' and 'k' of layer 'l1'", "logits up to", "2^40"]),
    (dict(q=1e25), ["fields 'q' and 'k' of layer 'l1'", "2^40"]),
    (dict(v=3e38), ["field 'v' of layer 'l1'", "e+38", "[2^-32, 2^40]"]),
    (dict(v=1e-30), ["field 'v' of layer 'l1'", "[2^-32, 2^40]"]),
    (dict(sinks=1e20), ["field 'sinks'", "2^40"]),
])
def test_huge_trace_values_are_refused_at_load_naming_file_field_and_layer(tmp_path, change, needles):
    from pcast_jax.analysis.capture import Trace, load_trace

    fields = _trace_fields()
    with np.load(_save_raw_trace(tmp_path / "ok.npz", fields)) as z:
        raw = dict(z)
    for name, factor in change.items():
        if name == "sinks":
            raw["sinks"] = np.full((2, 2), factor, np.float32)
        else:
            raw[name][1] *= np.float32(factor)
    np.savez(tmp_path / "huge.npz", **raw)
    with pytest.raises(PcastError) as info:
        load_trace(tmp_path / "huge.npz")
    message = str(info.value)
    assert "\n" not in message and "huge.npz" in message, message
    for needle in needles:
        assert needle in message, message
    with pytest.raises(PcastError, match="Trace: field"):  # the same check guards a Trace built in memory
        Trace(**{k: (raw[k] if k in ("q", "k", "v") else v) for k, v in fields.items()},
              sinks=raw.get("sinks"))


def _save_raw_trace(path, fields):
    from pcast_jax.analysis.capture import Trace

    return Trace(**fields).save(path)


def test_the_largest_accepted_trace_values_give_finite_analysis_numbers():
    """Logits just under 2^40 and |v| at both ends of [2^-32, 2^40]: every published number is finite."""
    import math as math_

    from pcast_jax.analysis import Trace, analyze

    rng = np.random.default_rng(0)
    T, D = 48, 8
    q = rng.uniform(-1, 1, (2, 1, T, 2, D)).astype(np.float32)
    k, v = (rng.uniform(-1, 1, (2, 1, T, 1, D)).astype(np.float32) for _ in range(2))
    q[0, 0, 0, 0, 0] = k[0, 0, 0, 0, 0] = 1.0
    q[0] *= np.float32(2.0**20 / math_.sqrt(D) * 0.99)
    k[0] *= np.float32(2.0**20)
    v[0] *= np.float32(2.0**40)
    v[1] *= np.float32(2.0**-32)
    v[0, 0, 0, 0, 0], v[1, 0, 0, 0, 0] = 2.0**40, 2.0**-32
    result = analyze(Trace(q=q, k=k, v=v, lengths=np.array([T]), layers=("big", "small")),
                     ["fwd_s1", KernelConfig(qkv="e4m3")], progress=lambda _line: None)
    rows = result.config_rows() + result.head_rows()
    bad = [(r.get("config"), key) for r in rows for key, x in r.items()
           if isinstance(x, float) and not math_.isfinite(x) and not key.endswith("_sem")]
    assert not bad, bad
    assert all(r["rel_mse_mean"] > 0 for r in result.config_rows())


# --------------------------------------------------------------------------------------------
# Report folders are written as a set: a full disk mid-write leaves the previous report as it was
# --------------------------------------------------------------------------------------------


def _full_disk_at(monkeypatch, name):
    """Make the report writer fail with ENOSPC on the file called ``name``, after writing part of it."""
    import errno

    from pcast_jax import report

    real = report.atomic_write

    def writer(path, write, **kw):
        if os.path.basename(path) != name:
            return real(path, write, **kw)

        def partial(f):
            f.write(b"config,")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return real(path, partial)

    monkeypatch.setattr(report, "atomic_write", writer)


def _folder_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_full_disk_in_the_middle_of_analyze_out_leaves_the_previous_report(tmp_path, capsys, monkeypatch):
    from pcast_jax import cli

    trace = _one_head_trace(tmp_path / "one.npz")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("the user's own file")
    argv = ["analyze", str(trace), "--configs", "fwd_s1,fa3", "--out", str(tmp_path / "a"), "--no-progress"]
    assert cli.main(argv) == 0
    before = _folder_bytes(tmp_path / "a")
    assert {"analysis.md", "analysis_configs.csv", "analysis_heads.csv", "analysis_layers.png",
            "notes.txt"} <= set(before)
    capsys.readouterr()
    _full_disk_at(monkeypatch, "analysis_heads.csv")
    line = _cli_error(capsys, argv)
    assert "--out=" in line and os.strerror(28) in line and str(tmp_path / "a" / "analysis_heads.csv") in line, line
    assert "unchanged" in line, line
    assert _folder_bytes(tmp_path / "a") == before
    line = _cli_error(capsys, argv[:-3] + ["--out", str(tmp_path / "new"), "--no-progress"])
    assert str(tmp_path / "new") in line, line
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "one.npz"]  # no staging folder left


def test_write_set_replaces_the_set_keeps_other_files_and_cleans_a_killed_writers_staging(tmp_path):
    from pcast_jax import fileio

    out = tmp_path / "r"
    fileio.write_set(out, lambda d: [(d / n).write_text("1") for n in ("a", "b")])
    assert _folder_bytes(out) == {"a": b"1", "b": b"1"} and oct(out.stat().st_mode & 0o777) != "0o700"
    (out / "mine").write_text("kept")
    fileio.write_set(out, lambda d: (d / "a").write_text("2"))
    assert _folder_bytes(out) == {"a": b"2", "b": b"1", "mine": b"kept"}

    def fails(d):
        (d / "a").write_text("3")
        raise PcastError("a refused number")

    with pytest.raises(PcastError, match="a refused number"):
        fileio.write_set(out, fails)
    assert _folder_bytes(out) == {"a": b"2", "b": b"1", "mine": b"kept"}
    stale = tmp_path / (fileio.temp_prefix("r").replace(str(os.getpid()), "999999999") + "x.tmp")
    stale.mkdir()
    (stale / "a").write_text("left by a killed writer")
    fileio.write_set(out, lambda d: (d / "b").write_text("3"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


# --------------------------------------------------------------------------------------------
# pcast doctor and pcast fingerprint: hostile checkpoints, probe and output files, flags
# --------------------------------------------------------------------------------------------

_ST_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "int32": "I32", "bool": "BOOL"}


def _scales_file(path, tensors: dict, edit=None):
    """A safetensors file of ``tensors`` (name → NumPy array of any dtype), from the format's definition."""
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        value = np.asarray(value)
        data = value.astype(value.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": _ST_DTYPES[value.dtype.name], "shape": list(value.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header if edit is None else edit(header)).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return path.parent


def _ckpt_scale(value):
    return lambda p: _scales_file(p / "model.safetensors", {"model.layers.0.self_attn.prob_scale": value,
                                                            "model.layers.0.self_attn.q_proj.weight": np.ones(4)})


def _ckpt_fifo(p):
    p.mkdir()
    os.mkfifo(p / "a.safetensors")
    return p


def _ckpt_index(weight_map):
    def make(p):
        folder = _scales_file(p / "a.safetensors", {"x.prob_scale": np.float32(0.5)})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return folder
    return make


def _ckpt_files(**files):
    def make(p):
        p.mkdir()
        for name, data in files.items():
            (p / name.replace("_", ".")).write_bytes(data)
        return p
    return make


def _ckpt_two_files(p):
    _scales_file(p / "a.safetensors", {"x.prob_scale": np.float32(0.5)})
    return _scales_file(p / "b.safetensors", {"x.prob_scale": np.float32(0.25)})


def _scales(make):
    def call(tmp_path):
        from pcast_jax import deployments

        deployments.checkpoint_scales(make(tmp_path / "ckpt"))
    return call


def _probes_file(tmp_path, change=None, drop=()):
    """A probes file of ``pcast fingerprint probe`` (head dim 36), ``change`` {key: value} edited into it."""
    from pcast_jax import fingerprint

    fingerprint.probes(36).save(tmp_path / "good.npz")
    if change is None and not drop:
        return tmp_path / "good.npz"
    with np.load(tmp_path / "good.npz") as z:
        data = {k: v for k, v in z.items() if k not in drop}
    data.update(change or {})
    np.savez(tmp_path / "probes.npz", **data)
    return tmp_path / "probes.npz"


def _load_probes(change=None, drop=(), raw=None):
    def call(tmp_path):
        from pcast_jax import fingerprint

        path = _probes_file(tmp_path, change, drop)
        if raw is not None:
            path = raw(tmp_path, path)
        fingerprint.ProbeSet.load(path)
    return call


def _truncate(tmp_path, path):
    data = path.read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 3])
    return tmp_path / "cut.npz"


def _fifo_instead(tmp_path, path):
    os.mkfifo(tmp_path / "pipe.npz")
    return tmp_path / "pipe.npz"


def _fit_outputs(transform):
    def call(tmp_path):
        from pcast_jax import fingerprint

        ps = fingerprint.probes(36)
        fingerprint.fit(ps, transform(np.zeros(ps.out_shape, np.float32)))
    return call


def _with_inf(out):
    out = out.copy()
    out[2, 5, 0, 1] = -np.inf
    return out


def _outputs_file(write):
    def call(tmp_path):
        from pcast_jax.commands.fingerprint import load_outputs

        load_outputs(str(write(tmp_path)))
    return call


def _npy_object(tmp_path):
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    return tmp_path / "o.npy"


def _npy_truncated(tmp_path):
    np.save(tmp_path / "o.npy", np.zeros((3, 64, 1, 36), np.float32))
    data = (tmp_path / "o.npy").read_bytes()
    (tmp_path / "o.npy").write_bytes(data[:200])
    return tmp_path / "o.npy"


def _npz_empty(tmp_path):
    np.savez(tmp_path / "o.npz")
    return tmp_path / "o.npz"


def _diagnose(**kw):
    def call(_tmp_path):
        from pcast_jax import deployments

        row = kw.pop("row", None) or deployments.find("jax", "cudnn", "sm90")
        deployments.diagnose(row, **kw)
    return call


def _api(call):
    return lambda _tmp_path: call()


def _deployments():
    return importlib.import_module("pcast_jax.deployments")


def _fingerprint():
    return importlib.import_module("pcast_jax.fingerprint")


def _jax_fp8():
    return importlib.import_module("pcast_jax.jax_fp8")


def _testing():
    return importlib.import_module("pcast_jax.testing")


def _collapse_file(tmp_path, change=None, drop=(), name="cp.npz", head_dim=16):
    """A probes file of ``pcast probe write`` (64 keys), ``change`` {key: value} edited into it."""
    _testing().collapse_probes(head_dim, n_keys=64).save(tmp_path / name)
    if change is None and not drop:
        return tmp_path / name
    with np.load(tmp_path / name) as z:
        data = {k: v for k, v in z.items() if k not in drop}
    data.update(change or {})
    np.savez(tmp_path / name, **data)
    return tmp_path / name


def _load_collapse(change=None, drop=()):
    return lambda tmp_path: _testing().CollapseProbes.load(_collapse_file(tmp_path, change, drop))


def _collapse_kernel(kernel, **kw):
    kw = {"fingerprint": False, **kw}
    return _api(lambda: _testing().check_p_collapse(kernel, head_dim=16, n_keys=64, **kw))


def _collapse_outputs(tmp_path, make, head_dim=16):
    """An outputs file (``out``) for _collapse_file's probes: ``make(exact output)``."""
    probes = _testing().collapse_probes(head_dim, n_keys=64)
    np.savez(tmp_path / f"co{head_dim}.npz", out=make(probes.exact.astype(np.float32)))
    return tmp_path / f"co{head_dim}.npz"


def _fit_simulated(transform):
    """fingerprint.fit on fwd_s1's simulated outputs (a fit that succeeds), ``transform`` applied first."""
    def call(tmp_path):
        from pcast_jax import fingerprint

        ps = fingerprint.probes(36)
        fingerprint.fit(ps, transform(fingerprint.simulate_outputs(ps, "fwd_s1").copy()))
    return call


def _zero_at(index):
    def transform(out):
        out[index] = 0.0
        return out
    return transform


def _soft_capped_trace(cap):
    def call(tmp_path):
        from pcast_jax.analysis import Trace

        q = np.random.default_rng(0).standard_normal((1, 1, 16, 1, 8)).astype(np.float32)
        Trace(q=q, k=q, v=q, lengths=np.array([16]), layers=("a",), logits_soft_cap=np.array([cap]))
    return call


def _symlink(name, target, index=None):
    """A checkpoint folder whose ``name`` is a symbolic link to ``target`` (itself: a loop), with an index."""
    def make(p):
        p.mkdir()
        os.symlink(target, p / name)
        if index is not None:
            (p / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
        return p
    return make


#: (id, a function of a fresh tmp_path that makes the hostile input and calls the API, substrings)
SURFACE_CASES = [
    # pcast doctor's checkpoint folder: only q/k/v/prob_scale tensors are read, through safetensors_files
    ("ckpt_missing_folder", _scales(lambda p: p), ["checkpoint=", "is not a folder"]),
    ("ckpt_a_file", _scales(lambda p: (p.write_text("x"), p)[1]), ["checkpoint=", "is not a folder"]),
    ("ckpt_empty_folder", _scales(lambda p: (p.mkdir(), p)[1]), ["holds no *.safetensors file"]),
    ("ckpt_no_safetensors", _scales(_ckpt_files(model_bin=b"\0" * 64, README_md=b"hi")),
     ["holds no *.safetensors file"]),
    ("ckpt_text_named_safetensors", _scales(_ckpt_files(model_safetensors=b"not a safetensors file")),
     ["model.safetensors: field 'header length'", "exceeds the file"]),
    ("ckpt_header_not_json", _scales(_ckpt_files(model_safetensors=struct.pack("<Q", 4) + b"{x:1")),
     ["model.safetensors: field 'header' is not valid JSON"]),
    ("ckpt_header_deep", _scales(_ckpt_files(model_safetensors=struct.pack("<Q", 2000) + b"[" * 1000 + b"]" * 1000)),
     ["model.safetensors: field 'header' nests deeper than 16"]),
    ("ckpt_header_a_list", _scales(_ckpt_files(model_safetensors=struct.pack("<Q", 2) + b"[]")),
     ["model.safetensors: field 'header' must be a JSON object"]),
    ("ckpt_fifo", _scales(_ckpt_fifo), ["a.safetensors is not a regular file"]),
    ("ckpt_folder_named_safetensors", _scales(lambda p: ((p / "a.safetensors").mkdir(parents=True), p)[1]),
     ["a.safetensors is not a regular file"]),
    ("ckpt_index_parent_path", _scales(_ckpt_index({"x.prob_scale": "../a.safetensors"})),
     ["model.safetensors.index.json", "'../a.safetensors', outside the checkpoint folder"]),
    ("ckpt_index_absolute_path", _scales(_ckpt_index({"x.prob_scale": "/etc/passwd"})),
     ["model.safetensors.index.json", "outside the checkpoint folder"]),
    ("ckpt_index_missing_shard", _scales(_ckpt_index({"x.prob_scale": "c.safetensors"})),
     ["c.safetensors (named by model.safetensors.index.json) does not exist"]),
    ("ckpt_index_weight_map_a_list", _scales(_ckpt_index(["x.prob_scale"])),
     ["model.safetensors.index.json", "field 'weight_map'"]),
    ("ckpt_scale_in_two_files", _scales(_ckpt_two_files), ["'x.prob_scale' is in two files", "a.safetensors",
                                                           "b.safetensors"]),
    ("ckpt_scale_int32", _scales(_ckpt_scale(np.int32(1))), ["prob_scale'", "field 'dtype' = 'I32'", "F32"]),
    ("ckpt_scale_bool", _scales(_ckpt_scale(np.bool_(True))), ["prob_scale'", "field 'dtype' = 'BOOL'"]),
    ("ckpt_scale_float64", _scales(_ckpt_scale(np.float64(0.5))), ["prob_scale'", "field 'dtype' = 'F64'"]),
    ("ckpt_scale_two_values", _scales(_ckpt_scale(np.float32([0.5, 0.25]))),
     ["prob_scale'", "field 'shape' = [2]", "one number"]),
    ("ckpt_scale_empty", _scales(_ckpt_scale(np.zeros(0, np.float32))), ["prob_scale'", "field 'shape' = [0]"]),
    ("ckpt_scale_zero", _scales(_ckpt_scale(np.float32(0.0))), ["prob_scale': value=0.0", "finite positive"]),
    ("ckpt_scale_negative", _scales(_ckpt_scale(np.float32(-0.5))), ["prob_scale': value=-0.5", "[2^-90, 2^90]"]),
    ("ckpt_scale_nan", _scales(_ckpt_scale(np.float32(np.nan))), ["prob_scale'", "non-finite"]),
    ("ckpt_scale_inf", _scales(_ckpt_scale(np.float16(np.inf))), ["prob_scale'", "non-finite"]),
    ("ckpt_scale_huge", _scales(_ckpt_scale(np.float32(3e38))), ["prob_scale': value=3.", "[2^-90, 2^90]"]),
    ("ckpt_scale_subnormal", _scales(_ckpt_scale(np.float32(1e-40))), ["prob_scale': value=", "[2^-90, 2^90]"]),
    ("ckpt_scale_offsets_outside", _scales(lambda p: _scales_file(
        p / "model.safetensors", {"a.k_scale": np.float32(1.0)},
        edit=lambda h: {"a.k_scale": {**h["a.k_scale"], "data_offsets": [0, 400]}})),
     ["'a.k_scale'", "field 'data_offsets' = [0, 400]"]),
    # the deployment table, the knob and the simulation's arguments
    ("doctor_engine_unknown", _api(lambda: _deployments().find("vllm2", "triton_attn", "sm90")),
     ["engine='vllm2'", "'vllm'"]),
    ("doctor_gpu_unknown", _api(lambda: _deployments().find("vllm", "triton_attn", "sm80")), ["gpu='sm80'", "'sm90'"]),
    ("doctor_kv_dtype_unknown", _api(lambda: _deployments().find("vllm", "triton_attn", "sm90", "fp8_e5m2")),
     ["kv_cache_dtype='fp8_e5m2'", "'fp8'"]),
    ("doctor_backend_unknown", _api(lambda: _deployments().find("sglang", "nope", "sm90")),
     ["backend='nope'", "known for sglang"]),
    ("doctor_engine_not_a_string", _api(lambda: _deployments().find(None, "cudnn", "sm90")), ["engine=None"]),
    ("knob_value_a_string", _api(lambda: _deployments().scale_from_knob("prob_scale", "0.5")),
     ["prob_scale='0.5'", "finite positive"]),
    ("knob_value_beyond_range", _api(lambda: _deployments().scale_from_knob("scale_s", 2.0**100)),
     ["scale_s=1.2676506002282294e+30", "[2^-90, 2^90]"]),
    ("knob_unknown", _api(lambda: _deployments().scale_from_knob("tau", 1.0)), ["knob='tau'", "'prob_scale'"]),
    ("diagnose_not_a_deployment", _diagnose(row="fa3"), ["deployment='fa3'", "deployments.find"]),
    ("diagnose_no_deltas", _diagnose(deltas=()), ["deltas", "at least one"]),
    ("diagnose_one_seed", _diagnose(seeds=1), ["seeds=1", ">= 2"]),
    ("diagnose_seeds_beyond_range", _diagnose(seeds=1000), ["seeds=1000", "<= 256"]),
    ("diagnose_delta_nan", _diagnose(deltas=(4.0, NAN)), ["delta", "finite"]),
    ("diagnose_learned_sink_not_bool", _diagnose(learned_sink="yes"), ["learned_sink='yes'", "True or False"]),
    ("diagnose_knob_value_negative", _diagnose(knob_value=-2.0), ["scale_s=-2.0", "finite positive"]),
    # pcast fingerprint: probes, probe files, outputs and output files
    ("probes_head_dim_below", _api(lambda: _fingerprint().probes(35)), ["head_dim=35", ">= 36"]),
    ("probes_head_dim_above", _api(lambda: _fingerprint().probes(4097)), ["head_dim=4097", "<= 4096"]),
    ("probes_head_dim_bool", _api(lambda: _fingerprint().probes(True)), ["head_dim=True", "integer"]),
    ("probes_scale_zero", _api(lambda: _fingerprint().probes(64, scale=0.0)), ["scale=0.0", "[2^-20, 2^20]"]),
    ("probes_scale_a_string", _api(lambda: _fingerprint().probes(64, scale="x")), ["scale='x'", "real number"]),
    ("probes_seed_negative", _api(lambda: _fingerprint().probes(64, seed=-1)), ["seed=-1", ">= 0"]),
    ("probes_causal_not_bool", _api(lambda: _fingerprint().probes(64, causal=1)), ["causal=1", "True or False"]),
    ("probes_file_missing", _load_probes(raw=lambda t, p: t / "missing.npz"), ["probes file", "does not exist"]),
    ("probes_file_fifo", _load_probes(raw=_fifo_instead), ["probes file", "pipe.npz", "not a regular file"]),
    ("probes_file_a_folder", _load_probes(raw=lambda t, p: t), ["probes file", "not a regular file"]),
    ("probes_file_truncated", _load_probes(raw=_truncate), ["probes file", "cut.npz", "not a readable .npz"]),
    ("probes_file_other_version", _load_probes({"format": np.array("pcast_fingerprint_probes_v0")}),
     ["probes file", "was not written by 'pcast fingerprint probe'"]),
    ("probes_file_tag_an_array", _load_probes({"format": np.array(["pcast_fingerprint_probes_v1"] * 2)}),
     ["probes file", "no format tag"]),
    ("probes_file_no_seed", _load_probes(drop=("seed",)), ["probes file", "lacks scale, causal, seed or q"]),
    ("probes_file_seed_negative", _load_probes({"seed": np.int64(-1)}), ["probes file", "probes.npz", "seed=-1"]),
    ("probes_file_scale_nan", _load_probes({"scale": np.float64(NAN)}), ["probes file", "probes.npz", "scale=nan"]),
    ("probes_file_head_dim_8", _load_probes({"q": np.zeros((3, 64, 1, 8), np.float32)}),
     ["probes file", "probes.npz", "head_dim=8"]),
    ("probes_file_v_edited", _load_probes({"v": np.zeros((3, 512, 1, 36), np.float32)}),
     ["probes file", "v is not the probes"]),
    ("probes_file_pickle", _load_probes({"q": np.array([None], dtype=object)}),
     ["probes file", "Python objects"]),
    ("fit_outputs_complex", _fit_outputs(lambda o: o + 1j), ["outputs.dtype=complex", "floating-point"]),
    ("fit_outputs_bool", _fit_outputs(lambda o: o > 0), ["outputs.dtype=bool", "floating-point"]),
    ("fit_outputs_strings", _fit_outputs(lambda o: o.astype(str)), ["outputs.dtype=<U", "floating-point"]),
    ("fit_outputs_inf", _fit_outputs(_with_inf), ["outputs holds 1 NaN or inf", "(2, 5, 0, 1)", "'ramp'"]),
    ("fit_outputs_heads_first", _fit_outputs(lambda o: np.swapaxes(o, 1, 2)), ["outputs.shape=(",
                                                                              ", 1, 64, 36) must be the probes' query "
                                                                              "shape (", ", 64, 1, 36)"]),
    ("fit_outputs_not_an_array", _fit_outputs(lambda o: [[1.0], [2.0, 3.0]]), ["outputs", "not an array"]),
    ("fit_output_dtype_unknown", _api(lambda: _fingerprint().fit(_fingerprint().probes(36), np.zeros(
        (3, 64, 1, 36), np.float32), output_dtype="int8")), ["output_dtype='int8'", "bfloat16"]),
    ("fit_probes_a_path", _api(lambda: _fingerprint().fit("probes.npz", np.zeros(3))), ["probes=str", "ProbeSet"]),
    ("outputs_npy_pickle", _outputs_file(_npy_object), ["outputs file", "o.npy", "Python objects"]),
    ("outputs_npy_truncated", _outputs_file(_npy_truncated), ["outputs file", "o.npy", "truncated"]),
    ("outputs_npz_empty", _outputs_file(_npz_empty), ["outputs file", "holds nothing", "'out'"]),
    ("outputs_fifo", _outputs_file(lambda t: (os.mkfifo(t / "o.npz"), t / "o.npz")[1]),
     ["outputs file", "not a regular file"]),
    ("identify_fn_returns_a_string", _api(lambda: _fingerprint().identify(lambda q, k, v: "done", head_dim=36)),
     ["outputs.dtype=<U4", "floating-point"]),
    ("explain_preset_unknown", _api(lambda: _fingerprint().explain_preset("fa5")), ["preset='fa5'", "'fa3'"]),
    # pcast_jax.testing (and pcast probe): the P-collapse probes, kernels, probe files
    ("collapse_head_dim_8", _api(lambda: _testing().collapse_probes(8)), ["head_dim=8", ">= 16"]),
    ("collapse_n_keys_32", _api(lambda: _testing().collapse_probes(16, n_keys=32)), ["n_keys=32", ">= 64"]),
    ("collapse_one_replicate", _api(lambda: _testing().collapse_probes(16, replicates=1)), ["replicates=1", ">= 2"]),
    ("collapse_no_deltas", _api(lambda: _testing().collapse_probes(16, deltas=())), ["deltas=()", "at least one"]),
    ("collapse_delta_repeated", _api(lambda: _testing().collapse_probes(16, deltas=(5, 5))),
     ["deltas=(5, 5)", "must not repeat"]),
    ("collapse_delta_nan", _api(lambda: _testing().collapse_probes(16, deltas=(NAN,))), ["deltas=(nan,)", "[0, 30]"]),
    ("collapse_delta_31", _api(lambda: _testing().collapse_probes(16, deltas=(31.0,))), ["deltas=(31.0,)", "[0, 30]"]),
    ("collapse_scale_zero", _api(lambda: _testing().collapse_probes(16, scale=0.0)), ["scale=0.0", "[2^-20, 2^20]"]),
    ("collapse_causal_not_bool", _api(lambda: _testing().collapse_probes(16, causal=1)), ["causal=1", "True or False"]),
    ("collapse_kernel_not_callable", _api(lambda: _testing().check_p_collapse("k", head_dim=16)),
     ["kernel='k'", "callable"]),
    ("collapse_kernel_heads_first", _collapse_kernel(lambda q, k, v: np.swapaxes(q, 1, 2)),
     ["outputs.shape=(32, 1, 13, 16)", "query shape (32, 13, 1, 16)"]),
    ("collapse_kernel_nan", _collapse_kernel(lambda q, k, v: np.full(q.shape, NAN)),
     ["outputs holds 6656 NaN or inf", "must be finite"]),
    ("collapse_kernel_returns_a_string", _collapse_kernel(lambda q, k, v: "done"),
     ["outputs.dtype=<U4", "floating-point"]),
    ("collapse_kernel_returns_integers", _collapse_kernel(lambda q, k, v: np.ones(q.shape, np.int32)),
     ["outputs.dtype=int32", "floating-point"]),
    ("collapse_fingerprint_not_bool", _collapse_kernel(lambda q, k, v: q, fingerprint="yes"),
     ["fingerprint='yes'", "True or False"]),
    ("collapse_probes_file_missing", lambda t: _testing().CollapseProbes.load(t / "none.npz"),
     ["probes file", "does not exist"]),
    ("collapse_probes_file_of_the_fingerprint", lambda t: _testing().CollapseProbes.load(_probes_file(t)),
     ["probes file", "not written by 'pcast probe write'"]),
    ("collapse_probes_file_no_seed", _load_collapse(drop=("seed",)), ["probes file", "lacks", "seed"]),
    ("collapse_probes_file_v_edited", _load_collapse({"v": np.zeros((32, 64, 1, 16), np.float32)}),
     ["probes file", "v is not what 'pcast probe write' writes"]),
    # degenerate outputs: nothing is read from a buffer the kernel never filled
    ("fit_outputs_all_zero", _fit_simulated(np.zeros_like), ["outputs is zero everywhere", "nothing is read"]),
    ("fit_outputs_negative_zero", _fit_simulated(lambda o: np.full_like(o, -0.0)), ["outputs is zero everywhere"]),
    ("fit_outputs_all_zero_float16", _fit_simulated(lambda o: np.zeros_like(o, np.float16)),
     ["outputs is zero everywhere"]),
    ("fit_outputs_all_nan", _fit_simulated(lambda o: np.full_like(o, NAN)), ["outputs holds", "NaN or inf"]),
    ("fit_outputs_zero_dominant_key", _fit_simulated(_zero_at((0, slice(None), 0, 0))),
     ["outputs is zero on the ladder's dominant key", "64 of 64 rows"]),
    ("fit_outputs_zero_dominant_key_one_row", _fit_simulated(_zero_at((0, 5, 0, 0))),
     ["ladder's dominant key", "1 of 64 rows (first row 5)"]),
    ("fit_outputs_ladder_zero", _fit_simulated(_zero_at(0)), ["ladder's dominant key", "64 of 64"]),
    # a soft cap is a normal float32, never 0 ("no cap") or inf there
    ("soft_cap_below_float32", _api(lambda: _nn_attention(logits_soft_cap=1e-50)),
     ["logits_soft_cap=1e-50", ">= 1.175e-38"]),
    ("soft_cap_subnormal", _api(lambda: _nn_attention(logits_soft_cap=1e-40)), ["logits_soft_cap=1e-40", ">= 1.175e-38"]),
    ("soft_cap_beyond_float32", _api(lambda: _nn_attention(logits_soft_cap=1e39)),
     ["logits_soft_cap=1e+39", "finite in float32"]),
    ("soft_cap_huge_integer", _api(lambda: _nn_attention(logits_soft_cap=10**400)),
     ["logits_soft_cap=1000000", "beyond float range"]),
    ("soft_cap_zero", _api(lambda: _nn_attention(logits_soft_cap=0.0)), ["logits_soft_cap=0.0", "> 0"]),
    ("soft_cap_nan", _api(lambda: _nn_attention(logits_soft_cap=NAN)), ["logits_soft_cap=nan", "finite"]),
    ("trace_soft_cap_below_float32", _soft_capped_trace(1e-50), ["field 'logits_soft_cap' holds 1e-50", "normal float32"]),
    ("trace_soft_cap_subnormal", _soft_capped_trace(np.float32(1e-40)), ["field 'logits_soft_cap' holds", "1.175e-38"]),
    ("trace_soft_cap_beyond_float32", _soft_capped_trace(1e39), ["field 'logits_soft_cap' holds 1e+39"]),
    # symbolic links in a checkpoint folder: what is wrong, not an index that is not there
    ("ckpt_symlink_loop", _scales(_symlink("a.safetensors", "a.safetensors")),
     ["a.safetensors is a symbolic link that leads to no file"]),
    ("ckpt_symlink_dangling", _scales(_symlink("a.safetensors", "nowhere")),
     ["a.safetensors is a symbolic link that leads to no file"]),
    ("ckpt_index_names_a_symlink_loop", _scales(_symlink("a.safetensors", "a.safetensors",
                                                         {"x.prob_scale": "a.safetensors"})),
     ["a.safetensors (named by model.safetensors.index.json) is a symbolic link that leads to no file"]),
    # a learned sink's logit has Δ's bound
    ("sweep_sink_logit_3e38", _api(lambda: _spec(sink_logit=3e38)), ["sink_logit=3e+38", "2^125"]),
    ("sweep_sink_logit_minus_1e38", _api(lambda: _spec(sink_logit=-1e38)), ["sink_logit=-1e+38", "2^125"]),
    ("workload_sink_logit_just_past", _api(lambda: workloads.SinkWorkload(n=8, sink_logit=2.0**125 * 1.0001)),
     ["sink_logit=", "2^125"]),
    # jax_fp8.predict on a trace: the scale is checked before the trace is read (which here does not exist)
    ("predict_trace_scale_s_zero", _api(lambda: _jax_fp8().predict(trace="no/t.npz", scale_s=0.0)),
     ["scale_s=0.0", "> 0"]),
    ("predict_trace_scale_s_negative", _api(lambda: _jax_fp8().predict(trace="no/t.npz", scale_s=-2.0)),
     ["scale_s=-2.0", "> 0"]),
    ("predict_trace_scale_s_nan", _api(lambda: _jax_fp8().predict(trace="no/t.npz", scale_s=NAN)),
     ["scale_s=nan", "finite"]),
    ("predict_trace_scale_s_subnormal", _api(lambda: _jax_fp8().predict(trace="no/t.npz", scale_s=1e-40)),
     ["scale_s=1e-40", ">= 1.175e-38"]),
]


@pytest.mark.parametrize("call, needles", [pytest.param(c, n, id=i) for i, c, n in SURFACE_CASES])
def test_hostile_doctor_and_fingerprint_input_gives_one_clear_error(tmp_path, call, needles):
    pytest.importorskip("safetensors")
    with pytest.raises(PcastError) as info:
        call(tmp_path)
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} missing from {message!r}"


def _zeros_npy(tmp_path):
    np.save(tmp_path / "zeros.npy", np.zeros((5, 64, 1, 36), np.float32))
    return tmp_path / "zeros.npy"


#: ``pcast fingerprint probe`` up to its ``--out`` value (a later ``--head-dim`` wins).
_PROBE = ["fingerprint", "probe", "--head-dim", "36", "--out"]


#: (id, a function of tmp_path giving the argv (files made), substrings of the one ``pcast: error:`` line)
#: ``pcast doctor`` on JAX's cuDNN attention on Hopper: what most doctor cases below break in one flag.
_CUDNN = ["doctor", "--engine", "jax", "--backend", "cudnn", "--gpu", "sm90"]

SURFACE_CLI_CASES = [
    ("doctor_engine_unknown", lambda t: ["doctor", "--engine", "vllm2", "--backend", "x", "--gpu", "sm90"],
     ["engine='vllm2'"]),
    ("doctor_gpu_unknown", lambda t: ["doctor", "--engine", "vllm", "--backend", "triton_attn", "--gpu", "h100"],
     ["gpu='h100'", "sm90"]),
    ("doctor_kv_dtype_unknown", lambda t: [*_CUDNN, "--kv-cache-dtype", "int8"], ["kv_cache_dtype='int8'"]),
    ("doctor_seeds_257", lambda t: [*_CUDNN, "--seeds", "257"], ["--seeds='257'", "[2, 256]"]),
    ("doctor_seeds_a_list", lambda t: [*_CUDNN, "--seeds", "2,3"], ["--seeds='2,3'", "one integer"]),
    ("doctor_seeds_a_word", lambda t: [*_CUDNN, "--seeds", "many"], ["--seeds", "many"]),
    ("doctor_delta_nan", lambda t: [*_CUDNN, "--delta", "4,nan"], ["--delta", "nan", "finite"]),
    ("doctor_delta_beyond_float32", lambda t: [*_CUDNN, "--delta", "1e39"], ["delta", "1e+39"]),
    ("doctor_delta_too_many", lambda t: [*_CUDNN, "--delta", "0:100:1"], ["--delta", "64"]),
    ("doctor_prob_scale_tiny", lambda t: ["doctor", "--engine", "vllm", "--backend", "rocm_flash", "--gpu", "gfx942",
                                          "--prob-scale", "1e-39"], ["prob_scale=1e-39", "[2^-90, 2^90]"]),
    ("doctor_scale_s_inf", lambda t: [*_CUDNN, "--scale-s", "inf"], ["scale_s=inf", "finite positive"]),
    ("doctor_checkpoint_missing", lambda t: [*_CUDNN, "--checkpoint", str(t / "nope")], ["checkpoint=", "is not a folder"]),
    ("doctor_checkpoint_fifo", lambda t: [*_CUDNN, "--checkpoint", str(_ckpt_fifo(t / "c"))],
     ["a.safetensors is not a regular file"]),
    ("doctor_checkpoint_scale_nan", lambda t: ["doctor", "--engine", "vllm", "--backend", "rocm_flash", "--gpu",
                                               "gfx942", "--checkpoint", str(_ckpt_scale(np.float32(NAN))(t / "c"))],
     ["prob_scale'", "non-finite"]),
    ("probe_head_dim_8", lambda t: _PROBE + [str(t / "p.npz"), "--head-dim", "8"], ["head_dim=8", ">= 36"]),
    ("probe_head_dim_a_word", lambda t: ["fingerprint", "probe", "--head-dim", "wide", "--out", str(t / "p.npz")],
     ["--head-dim", "'wide'"]),
    ("probe_scale_nan", lambda t: _PROBE + [str(t / "p.npz"), "--scale", "nan"], ["scale=nan"]),
    ("probe_seed_beyond_int32", lambda t: _PROBE + [str(t / "p.npz"), "--seed", str(2**31)],
     ["seed=2147483648", "<= 2147483647"]),
    ("probe_out_a_folder", lambda t: _PROBE + [str(t)], ["--out=", "is a folder; name a file"]),
    ("probe_out_under_a_file", lambda t: _PROBE + [str(_probes_file(t) / "p.npz")],
     ["--out=", "good.npz", "not a folder"]),
    ("fit_probes_fifo", lambda t: ["fingerprint", "fit", str(_fifo_instead(t, None)), str(_probes_file(t))],
     ["probes file", "not a regular file"]),
    ("fit_outputs_missing", lambda t: ["fingerprint", "fit", str(_probes_file(t)), str(t / "none.npz")],
     ["outputs file", "does not exist"]),
    ("fit_outputs_truncated", lambda t: ["fingerprint", "fit", str(_probes_file(t)), str(_truncate(t, _probes_file(t)))],
     ["outputs file", "cut.npz", "not a readable .npz"]),
    ("fit_outputs_the_probes", lambda t: ["fingerprint", "fit", str(_probes_file(t)), str(_probes_file(t))],
     ["outputs file", "save the kernel's output as 'out'"]),
    ("fit_output_dtype_unknown", lambda t: ["fingerprint", "fit", "p.npz", "o.npz", "--output-dtype", "int8"],
     ["--output-dtype", "'int8'"]),
    ("fingerprint_preset_unknown", lambda t: ["fingerprint", "--preset", "fa5"], ["preset='fa5'"]),
    ("fingerprint_preset_head_dim_8", lambda t: ["fingerprint", "--preset", "fa3", "--head-dim", "8"],
     ["head_dim=8"]),
    # pcast probe: the P-collapse check of a kernel run elsewhere
    ("probe_write_head_dim_8", lambda t: ["probe", "write", "--head-dim", "8", "--out", str(t / "p.npz")],
     ["head_dim=8", ">= 16"]),
    ("probe_write_delta_nan", lambda t: ["probe", "write", "--head-dim", "16", "--delta", "4,nan", "--out",
                                         str(t / "p.npz")], ["--delta", "nan"]),
    ("probe_write_n_keys_32", lambda t: ["probe", "write", "--head-dim", "16", "--n-keys", "32", "--out",
                                         str(t / "p.npz")], ["n_keys=32", ">= 64"]),
    ("probe_write_out_a_folder", lambda t: ["probe", "write", "--head-dim", "16", "--out", str(t)],
     ["--out=", "is a folder"]),
    ("probe_no_action", lambda t: ["probe"], ["needs an action", "write", "check"]),
    ("probe_check_outputs_missing", lambda t: ["probe", "check", str(_collapse_file(t)), str(t / "none.npz")],
     ["outputs file", "does not exist"]),
    ("probe_check_outputs_heads_first", lambda t: ["probe", "check", str(_collapse_file(t)),
                                                   str(_collapse_outputs(t, lambda o: np.swapaxes(o, 1, 2)))],
     ["outputs.shape=(32, 1, 13, 16)", "query shape (32, 13, 1, 16)"]),
    ("probe_check_outputs_nan", lambda t: ["probe", "check", str(_collapse_file(t)),
                                           str(_collapse_outputs(t, lambda o: o * NAN))], ["NaN or inf", "finite"]),
    ("probe_check_the_fingerprint_probes", lambda t: ["probe", "check", str(_probes_file(t)), str(_zeros_npy(t))],
     ["probes file", "not written by 'pcast probe write'"]),
    ("probe_check_fingerprint_other_head_dim", lambda t: ["probe", "check", str(_collapse_file(t)),
                                                          str(_collapse_outputs(t, np.copy)), "--fingerprint",
                                                          str(_probes_file(t)), str(_zeros_npy(t))],
     ["--fingerprint", "head dim, scale, causal, sinks = (36,"]),
    ("probe_check_fingerprint_outputs_missing", lambda t: ["probe", "check", str(_collapse_file(t, head_dim=36)),
                                                           str(_collapse_outputs(t, np.copy, 36)), "--fingerprint", str(_probes_file(t)),
                                                           str(t / "none.npz")],
     ["--fingerprint: outputs file", "none.npz", "does not exist"]),
    ("probe_check_fingerprint_outputs_of_the_probe", lambda t: [
        "probe", "check", str(_collapse_file(t, head_dim=36)), str(_collapse_outputs(t, np.copy, 36)), "--fingerprint",
        str(_probes_file(t)), str(_collapse_outputs(t, np.copy))],
     ["--fingerprint: outputs.shape=(32, 13, 1, 16)", "(5, 64, 1, 36)"]),
    # flags that would be ignored are refused, naming them (the trace need not exist: refused before)
    ("doctor_mass_limit_without_trace", lambda t: [*_CUDNN, "--mass-limit", "0.01"], ["--mass-limit", "only with --trace"]),
    ("doctor_delta_with_trace", lambda t: [*_CUDNN, "--trace", "t.npz", "--delta", "4"], ["--delta:", "--trace"]),
    ("doctor_learned_sink_with_trace", lambda t: [*_CUDNN, "--trace", "t.npz", "--learned-sink"],
     ["--learned-sink:", "--trace"]),
    ("doctor_seeds_with_trace", lambda t: [*_CUDNN, "--trace", "t.npz", "--seeds", "8"], ["--seeds:", "--trace"]),
    ("doctor_delta_and_learned_sink_with_trace", lambda t: [*_CUDNN, "--trace", "t.npz", "--delta", "4",
                                                            "--learned-sink"], ["--delta, --learned-sink:"]),
    # file names that are not UTF-8: refused naming the option before anything is read
    ("analyze_trace_not_utf8", lambda t: ["analyze", "t\udcff.npz"], ["TRACE='t\\udcff.npz'", "not UTF-8"]),
    ("analyze_out_not_utf8", lambda t: ["analyze", "t.npz", "--out", "a\udcfe"], ["--out=", "not UTF-8"]),
    ("doctor_trace_not_utf8", lambda t: [*_CUDNN, "--trace", "t\udcff.npz"], ["--trace=", "not UTF-8"]),
    ("doctor_checkpoint_not_utf8", lambda t: [*_CUDNN, "--checkpoint", "c\udc80"], ["--checkpoint=", "not UTF-8"]),
    ("jax_fp8_trace_not_utf8", lambda t: ["jax-fp8", "--trace", "t\udcff.npz"], ["--trace=", "not UTF-8"]),
    ("fit_outputs_not_utf8", lambda t: ["fingerprint", "fit", "p.npz", "o\udcff.npy"], ["OUTPUTS=", "not UTF-8"]),
    ("fit_probes_not_utf8", lambda t: ["fingerprint", "fit", "p\udcff.npz", "o.npy"], ["PROBES=", "not UTF-8"]),
    # jax-fp8 --trace's numbers, before the trace is read
    ("jax_fp8_trace_scale_s_zero", lambda t: ["jax-fp8", "--trace", "t.npz", "--scale-s", "0"], ["--scale-s=0.0", "> 0"]),
    ("jax_fp8_trace_scale_s_negative", lambda t: ["jax-fp8", "--trace", "t.npz", "--scale-s", "-4"],
     ["--scale-s=-4.0", "> 0"]),
    ("jax_fp8_trace_scale_s_nan", lambda t: ["jax-fp8", "--trace", "t.npz", "--scale-s", "nan"],
     ["--scale-s=nan", "finite"]),
    ("jax_fp8_trace_scale_s_inf", lambda t: ["jax-fp8", "--trace", "t.npz", "--scale-s", "inf"],
     ["--scale-s=inf", "finite"]),
    ("jax_fp8_trace_scale_s_subnormal", lambda t: ["jax-fp8", "--trace", "t.npz", "--scale-s", "1e-40"],
     ["--scale-s=1e-40", "1.175e-38"]),
    ("jax_fp8_scale_s_zero_synthetic", lambda t: ["jax-fp8", "--scale-s", "0"], ["--scale-s=0.0", "> 0"]),
    ("jax_fp8_trace_mass_limit_one", lambda t: ["jax-fp8", "--trace", "t.npz", "--mass-limit", "1"],
     ["--mass-limit=1.0", "below 1"]),
    ("jax_fp8_trace_mass_limit_zero", lambda t: ["jax-fp8", "--trace", "t.npz", "--mass-limit", "0"],
     ["--mass-limit=0.0", "> 0"]),
    # degenerate outputs and symbolic links through the command line
    ("fit_outputs_all_zero", lambda t: ["fingerprint", "fit", str(_probes_file(t)), str(_zeros_npy(t))],
     ["outputs is zero everywhere"]),
    ("doctor_checkpoint_symlink_loop", lambda t: [*_CUDNN, "--checkpoint", str(_symlink("a.safetensors",
                                                                                      "a.safetensors")(t / "c"))],
     ["a.safetensors is a symbolic link that leads to no file"]),
]


@pytest.mark.parametrize("make, needles", [pytest.param(m, n, id=i) for i, m, n in SURFACE_CLI_CASES])
def test_hostile_doctor_and_fingerprint_flags_exit_2_with_one_line(tmp_path, capsys, make, needles):
    pytest.importorskip("safetensors")
    from pcast_jax import cli

    argv = make(tmp_path)
    capsys.readouterr()
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # the argument parser's own refusal
        status = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("pcast"), (status, err)
    line = err[0]
    for needle in needles:
        assert needle in line, f"{needle!r} missing from {line!r}"


def test_whatif_report_out_is_written_as_a_set(tmp_path, capsys, monkeypatch):
    """``pcast whatif report --out DIR`` goes through the same set write (the analyses faked: no work)."""
    from pcast_experiments import whatif_report
    from pcast_jax import cli

    def fake_build(out_dir, *, quick, base_seed):
        (out_dir / "whatif_gradients.png").write_bytes(b"png")
        files = whatif_report.write_tables({"validate": [{"config": "fwd_s1", "x": 1.0}]}, out_dir)
        return "# what-if", [f.name for f in files], 1

    monkeypatch.setattr(whatif_report, "build_report", fake_build)
    argv = ["whatif", "report", "--quick", "--out", str(tmp_path / "w"), "--no-progress"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert str(tmp_path / "w" / "whatif_validate.csv") in printed and ".tmp" not in printed, printed
    before = _folder_bytes(tmp_path / "w")
    assert set(before) == {"whatif.md", "whatif_validate.csv", "whatif_gradients.png"}
    _full_disk_at(monkeypatch, "whatif_validate.csv")
    line = _cli_error(capsys, argv)
    assert "--out=" in line and str(tmp_path / "w" / "whatif_validate.csv") in line and "unchanged" in line, line
    assert _folder_bytes(tmp_path / "w") == before and sorted(p.name for p in tmp_path.iterdir()) == ["w"]


# --------------------------------------------------------------------------------------------
# Reads under an address-space limit: memory follows the file, never the bound
# --------------------------------------------------------------------------------------------

#: A child that imports the readers and starts JAX's CPU backend (its threads), then limits its address space
#: (RLIMIT_AS) to what it has mapped plus 128 MiB and reads small files through every bounded read
#: path: the trace (``analyze``, ``doctor --trace``, ``jax-fp8 --trace``: a quarter of RAM is its
#: bound), the probes (1 GiB) and the outputs (256 MiB) of ``fingerprint fit``, and ``read_bounded``
#: with a 1 GiB bound. A reader that reserves its bound fails there with a MemoryError.
_LIMITED_READS = r"""
import resource, sys
from pcast_jax import fileio
from pcast_jax.analysis import load_trace
from pcast_jax.commands.fingerprint import load_outputs
from pcast_jax.fingerprint import ProbeSet
from pcast_jax.sweep.plan import default_budget

import jax.numpy as jnp

assert default_budget() > 2**28  # the bound dwarfs the headroom
(jnp.ones(8) * 2).block_until_ready()  # JAX's backend and its threads start here, before the limit
mapped = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + 2**27, resource.getrlimit(resource.RLIMIT_AS)[1]))
trace, probes, outputs, small = sys.argv[1:5]
for name, read in [("trace", lambda: load_trace(trace).q.shape),
                   ("probes", lambda: ProbeSet.load(probes).q.shape),
                   ("outputs", lambda: load_outputs(outputs).shape),
                   ("read_bounded", lambda: len(fileio.read_bounded(small, what="f", max_bytes=2**30)))]:
    try:
        print(name, "read", read(), flush=True)
    except MemoryError:
        print(name, "MemoryError", flush=True)
"""


def _small_files(tmp_path):
    """A trace (2 layers, 64 tokens, head dim 16), probes and a preset's outputs on them, a 3-byte file."""
    from pcast_jax import fingerprint
    from pcast_jax.analysis import Trace

    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 64, 2, 16)).astype(np.float32)
    Trace(q=q, k=q[:, :, :, :1].copy(), v=q[:, :, :, 1:].copy(), lengths=np.array([64]),
          layers=("a", "b")).save(tmp_path / "t.npz")
    ps = fingerprint.probes(36)
    ps.save(tmp_path / "p.npz")
    np.save(tmp_path / "o.npy", _fingerprint().simulate_outputs(ps, "fwd_s1"))
    (tmp_path / "small").write_bytes(b"abc")
    return [str(tmp_path / n) for n in ("t.npz", "p.npz", "o.npy", "small")]


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the mapped size from /proc")
def test_every_bounded_read_path_reads_a_small_file_under_an_address_space_limit(tmp_path):
    files = _small_files(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _LIMITED_READS, *files], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines == ["trace read (2, 1, 64, 2, 16)", "probes read (5, 64, 1, 36)", "outputs read (5, 64, 1, 36)",
                     "read_bounded read 3"], lines


#: Address space each ``pcast`` run below gets: 3 GiB. ``pcast analyze`` on the small trace peaks at
#: 1.6 GiB mapped (VmPeak, 2-core CPU host, most of it JAX's runtime); the trace's bound alone is a
#: quarter of RAM, so a reader that reserved it would fail on any host with 8 GiB of RAM or more.
_CLI_ADDRESS_SPACE = 3 * 2**30


#: ``pcast ARGV`` in a child whose address space is limited to ``_CLI_ADDRESS_SPACE`` before anything is imported.
_LIMITED_CLI = (f"import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({_CLI_ADDRESS_SPACE}, "
                "resource.getrlimit(resource.RLIMIT_AS)[1])); from pcast_jax.cli import main; sys.exit(main())")


def test_the_trace_commands_and_fingerprint_fit_run_under_an_address_space_limit(tmp_path):
    trace, probes, outputs, _ = _small_files(tmp_path)
    runs = {"analyze": ["analyze", trace, "--configs", "fwd_s1", "--out", str(tmp_path / "a"), "--no-progress"],
            "doctor": ["doctor", "--engine", "jax", "--backend", "cudnn", "--gpu", "sm90", "--trace", trace],
            "jax-fp8": ["jax-fp8", "--trace", trace, "--format", "json"],
            "fingerprint fit": ["fingerprint", "fit", probes, outputs, "--format", "json"]}
    for name, argv in runs.items():
        proc = subprocess.run([sys.executable, "-c", _LIMITED_CLI, *argv], capture_output=True, text=True,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (name, proc.stderr[-2000:])


@pytest.mark.parametrize("max_bytes, read", [(1000, 100), (100, 100), (50, None), (10, None)])
def test_a_file_that_grows_while_it_is_read_is_read_to_the_bound(tmp_path, monkeypatch, max_bytes, read):
    """The size seen when the file is opened is 10 bytes; it holds 100 by the time it is read."""
    (tmp_path / "f").write_bytes(bytes(range(100)))
    real = os.fstat
    monkeypatch.setattr(fileio.os, "fstat", lambda fd: os.stat_result((*tuple(real(fd))[:6], 10, *tuple(real(fd))[7:10])))
    if read is None:
        with pytest.raises(PcastError, match=f"f grew past {max_bytes} bytes while it was read"):
            fileio.read_bounded(tmp_path / "f", what="f", max_bytes=max_bytes)
    else:
        assert fileio.read_bounded(tmp_path / "f", what="f", max_bytes=max_bytes) == bytes(range(100))


@pytest.mark.parametrize("sink_logit", [workloads.DELTA_MAX, -workloads.DELTA_MAX])
def test_a_sweep_at_the_largest_sink_logit_is_finite_in_exponent_mode(tmp_path, sink_logit):
    """The learned sink's bound is Δ's: at ±2^125 an exponent-mode kernel with the sink in its initial max
    (log2(e)·(s − m), where 3e38 overflowed to NaN) and the presets give finite metrics."""
    mine = KernelConfig(name="exp_init_max", scale_mode="exponent", sink_mode="init_max", scale=256.0)
    res = sweep.run_sweep(_spec(configs=(mine, "fa3", "fwd_s1"), deltas=(7.0,), sink_logit=sink_logit),
                          out_dir=tmp_path / "s", progress=False)
    for name in ("exp_init_max", "fa3", "fwd_s1"):
        assert np.all(np.isfinite(res.mean("mse", config=name, n=64))), name
