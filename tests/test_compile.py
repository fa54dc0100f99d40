"""Compile once per shape, the persistent compilation cache, and the vmapped micro-batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from pcast_jax import cache, formats, metrics, workloads
from pcast_jax.errors import PcastError
from pcast_jax.sweep import SweepSpec, estimate_instance_bytes, instance_key, plan_layout, run_sweep
from pcast_jax.sweep.compute import chunk_metrics

SPEC_KW = dict(configs=("rev_s256", "dynamic_pow2"), deltas=(5.0, 9.0), ns=(200,), seeds=4, q_len=4, d=8)


def _same_bits(a, b, label=""):
    for m in metrics.METRICS:
        np.testing.assert_array_equal(np.asarray(a[m]).view(np.uint32), np.asarray(b[m]).view(np.uint32),
                                      err_msg=f"{label} {m}")


def test_fingerprint_of_the_default_spec_is_unchanged():
    assert SweepSpec(deltas=(7.0,), ns=(4096,), seeds=4).fingerprint() == "109b3b7528d3467c"
    assert SweepSpec().to_dict()["micro_batch"] == 1  # every field is written
    batched = SweepSpec(micro_batch=4)
    assert batched.fingerprint() != SweepSpec().fingerprint()
    assert SweepSpec.from_dict(batched.to_dict()) == batched
    with pytest.raises(PcastError, match="micro_batch"):
        SweepSpec(micro_batch=0)


def test_configs_past_one_group_compile_in_groups_that_do_not_see_each_other(monkeypatch):
    """A sweep of CONFIG_GROUP + 1 configs is two programs; each config's numbers are those of its group
    swept alone (bit for bit), and only such a sweep has the group size in its fingerprint."""
    from pcast_jax.sweep import compute_chunk
    from pcast_jax.sweep.spec import CONFIG_GROUP

    names = ("fwd_s1", "rev_s1", "fwd_s256", "rev_s256", "fwd_s448", "fa3", "dynamic_pow2", "hpc_ops", "trtllm_xqa")
    assert len(names) == CONFIG_GROUP + 1
    kw = dict(deltas=(9.0,), ns=(64,), seeds=2, q_len=2, d=4)
    before = chunk_metrics._cache_size()
    both = compute_chunk(SweepSpec(configs=names, **kw), 64, 0, 2)
    assert chunk_metrics._cache_size() - before <= 2  # the two groups (fewer where an earlier test compiled one)
    first = compute_chunk(SweepSpec(configs=names[:-1], **kw), 64, 0, 2)
    last = compute_chunk(SweepSpec(configs=names[-1:], **kw), 64, 0, 2)
    _same_bits({m: both[m][..., :-1] for m in both}, first, "first group")
    _same_bits({m: both[m][..., -1:] for m in both}, last, "second group")
    assert chunk_metrics._cache_size() - before == 2, "the groups swept alone are the sweep's own programs"
    nine, eight = SweepSpec(configs=names, **kw), SweepSpec(configs=names[:-1], **kw)
    prints = nine.fingerprint(), eight.fingerprint()
    monkeypatch.setattr("pcast_jax.sweep.spec.CONFIG_GROUP", 2 * CONFIG_GROUP)
    assert nine.fingerprint() != prints[0] and eight.fingerprint() == prints[1]


def test_same_shapes_with_other_seeds_base_seed_and_deltas_do_not_recompile():
    first = run_sweep(SweepSpec(**SPEC_KW), chunk_size=4, progress=False)
    compiled = chunk_metrics._cache_size()
    other = SweepSpec(**{**SPEC_KW, "seed_offset": 11, "base_seed": 123, "deltas": (3.0, 12.5)})
    second = run_sweep(other, chunk_size=4, progress=False)
    assert chunk_metrics._cache_size() == compiled, "a traced value was compiled in"
    assert not np.array_equal(first.data["mse"], second.data["mse"])
    # the traced base seed, seed and Δ give the instance a standalone evaluation gives
    for si, di in ((0, 0), (3, 1)):
        key = instance_key(other.base_seed, 200, other.seed_offset + si)
        inst = workloads.make_instance(key, other.workload(200), other.deltas[di])
        alone = jax.jit(lambda i: metrics.evaluate(i, other.configs))(inst)
        for m in metrics.METRICS:
            np.testing.assert_array_equal(second.data[m][0, :, di, si].view(np.uint32),
                                          np.asarray(alone[m]).view(np.uint32), err_msg=m)


@pytest.fixture(scope="module")
def batched():
    spec = SweepSpec(**{**SPEC_KW, "seeds": 7, "micro_batch": 3})
    return spec, run_sweep(spec, chunk_size=7, progress=False)


@pytest.mark.parametrize("chunk_size", [1, 2, 4])
def test_micro_batch_is_bit_identical_for_any_chunk_size(batched, chunk_size):
    spec, reference = batched
    _same_bits(run_sweep(spec, chunk_size=chunk_size, progress=False).data, reference.data, f"chunk {chunk_size}")


def test_micro_batch_is_bit_identical_with_delta_groups_and_seed_offset(batched):
    spec, reference = batched
    budget = 3 * max(estimate_instance_bytes(spec, n) for n in spec.ns)  # one micro-batch, one Δ
    assert plan_layout(spec, n_devices=1, memory_budget=budget)["delta_group"] == 1
    _same_bits(run_sweep(spec, memory_budget=budget, progress=False).data, reference.data, "Δ groups")
    shifted = run_sweep(SweepSpec(**{**SPEC_KW, "seeds": 4, "seed_offset": 3, "micro_batch": 3}), progress=False)
    _same_bits(shifted.data, {m: v[..., 3:] for m, v in reference.data.items()}, "seed_offset")


def test_micro_batch_needs_its_memory_up_front():
    spec = SweepSpec(**{**SPEC_KW, "micro_batch": 8})
    with pytest.raises(PcastError, match="micro_batch=8"):
        plan_layout(spec, n_devices=1, memory_budget=4 * estimate_instance_bytes(spec, 200))


# --------------------------------------------------------------------------------------------
# The draws: JAX's threefry bits, unrolled
# --------------------------------------------------------------------------------------------


def _within_ulps(a, b, ulps: int = 4):
    """Normals from the same bits: JAX's own erf_inv transform, whose last bits XLA:CPU may round
    differently in two compiled programs (vectorized and scalar loops contract its polynomial
    differently; 3 ulps seen on an AVX-512 CPU). Bits are compared exactly above."""
    a, b = np.asarray(a), np.asarray(b)
    ints = {2: np.int16, 4: np.int32}[a.dtype.itemsize]
    diff = np.abs(a.view(ints).astype(np.int64) - b.view(ints).astype(np.int64))
    assert diff.max() <= ulps, f"normals differ by {diff.max()} ulps"


@pytest.mark.parametrize("shape", [(3,), (7, 33, 5)])
def test_unrolled_threefry_draws_jax_bits(shape):
    raw = jax.random.fold_in(jax.random.PRNGKey(7), 3)
    for key in (raw, jax.random.wrap_key_data(raw)):
        fast = workloads.threefry_unrolled(key)
        assert fast is not key
        np.testing.assert_array_equal(jax.random.bits(fast, shape), jax.random.bits(key, shape))
        for dtype in ("float32", "float16"):  # 32 bits unrolled; other widths are JAX's own
            a = jax.jit(lambda k, dtype=dtype: jax.random.normal(k, shape, dtype))
            _within_ulps(a(fast), a(key))
    keys = jax.random.split(raw, 5)  # under vmap, as a micro-batch draws them
    np.testing.assert_array_equal(jax.vmap(lambda k: jax.random.bits(workloads.threefry_unrolled(k), shape))(keys),
                                  jax.vmap(lambda k: jax.random.bits(k, shape))(keys))
    draw = jax.vmap(lambda k: jax.random.normal(workloads.threefry_unrolled(k), shape))
    _within_ulps(draw(keys), jax.vmap(lambda k: jax.random.normal(k, shape))(keys))
    rbg = jax.random.key(0, impl="rbg")
    assert workloads.threefry_unrolled(rbg) is rbg


def _rounding_codes(fmt) -> np.ndarray:
    """float32 codes that exercise every rounding decision of ``fmt``, and the special values.

    For every binade from below the smallest subnormal to above max: every kept mantissa, with
    the dropped bits 0, 1, just under half, half (ties, even and odd), just over half and all ones
    (the subnormal range drops more bits: the same patterns at its own half); both signs; zeros,
    float32 subnormals, max and its neighbours, ±inf, NaNs; and a random sample of all codes.
    """
    drop = 23 - fmt.mantissa_bits
    emin = int(np.log2(fmt.smallest_subnormal)) - 2
    emax = int(np.log2(fmt.max)) + 2
    codes = []
    for e in range(emin, emax + 1):
        d = drop if e >= int(np.log2(fmt.smallest_normal)) else min(23, drop + int(np.log2(fmt.smallest_normal)) - e)
        kept = np.arange(1 << (23 - d), dtype=np.uint32) << d
        low = np.array([0, 1, (1 << (d - 1)) - 1, 1 << (d - 1), (1 << (d - 1)) + 1, (1 << d) - 1], np.uint32)
        codes.append(((e + 127) << 23) | (kept[:, None] | low[None, :]).ravel())
    special = np.array([0, 1, 0x7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF], np.uint32)
    near = np.float32(fmt.max).view(np.uint32) + np.arange(-3, 4, dtype=np.int64)
    rng = np.random.default_rng(0).integers(0, 2**32, 1 << 20, dtype=np.uint64)
    codes = np.concatenate(codes + [special, near.astype(np.uint32), rng.astype(np.uint32)])
    return np.concatenate([codes, codes | np.uint32(0x80000000)])


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "int8", "uint8"])
def test_arithmetic_cast_is_the_fp8_cast_bit_for_bit(name):
    fmt = formats.get_format(name)
    x = _rounding_codes(fmt).view(np.float32)
    want = np.asarray(jax.jit(lambda x: formats.cast(x, fmt))(x)).view(np.uint32)
    got = np.asarray(jax.jit(lambda x: formats.cast_arithmetic(x, fmt))(x)).view(np.uint32)
    bad = np.nonzero(want != got)[0]
    assert bad.size == 0, (x[bad[:5]], want[bad[:5]].view(np.float32), got[bad[:5]].view(np.float32))
    assert name in formats.ARITHMETIC_CAST_FORMATS


# --------------------------------------------------------------------------------------------
# The persistent compilation cache
# --------------------------------------------------------------------------------------------


def test_cache_folder_and_switches(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.default_cache_dir() == tmp_path / "pcast_jax" / "jax-cache"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert not cache._writable(blocker / "sub")  # a folder that cannot be made: no cache, no error
    assert cache._writable(tmp_path / "ok")
    for value, folder in [("", tmp_path / "pcast_jax" / "jax-cache"), ("On", tmp_path / "pcast_jax" / "jax-cache"),
                          ("0", None), (" off ", None), (str(tmp_path / "mine"), tmp_path / "mine")]:
        monkeypatch.setenv(cache.ENV_VAR, value)
        assert cache._env_folder() == folder, value
    assert cache._env_folder(tmp_path / "d") == tmp_path / "mine"  # a named folder wins over the default
    monkeypatch.setenv(cache.ENV_VAR, "~/mine")
    assert cache._env_folder() == Path("~/mine").expanduser()
    monkeypatch.setenv(cache.ENV_VAR, "0")
    assert cache._env_folder(tmp_path / "d") is None  # off stays off whatever the default
    monkeypatch.setenv(cache.ENV_VAR, "")
    assert cache._env_folder(tmp_path / "d") == tmp_path / "d"
    monkeypatch.setattr(cache, "_state", {})
    monkeypatch.setenv(cache.ENV_VAR, "0")
    assert cache.enable() is None
    assert cache.enable(enabled=False) is None


#: The variables a child process's cache settings come from (the suite sets them for its own children).
_CACHE_VARS = (cache.ENV_VAR, "JAX_COMPILATION_CACHE_DIR", cache._MIN_TIME_VAR)

_CACHED_RUN = """
import json, sys
import jax
from pcast_jax import cache
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name))
from pcast_jax.sweep import SweepSpec, run_sweep
from pcast_jax.sweep.compute import chunk_metrics
folder = cache.enable()
run_sweep(SweepSpec(**json.loads(sys.argv[1])), progress=False)
print(json.dumps({"dir": None if folder is None else str(folder), "config": jax.config.jax_compilation_cache_dir,
                  "hits": hits.count("/jax/compilation_cache/cache_hits")}))
"""


def _cached_run(env, spec_kw):
    kw = {k: list(v) if isinstance(v, tuple) else v for k, v in spec_kw.items()}
    proc = subprocess.run([sys.executable, "-c", _CACHED_RUN, json.dumps(kw)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_process_loads_the_chunk_from_the_cache_and_unwritable_folder_is_ignored(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in _CACHE_VARS}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_PLATFORMS="cpu")
    kw = {**SPEC_KW, "configs": ("fwd_s1", "rev_s256", "fa3")}
    cold = _cached_run(env, kw)
    assert cold["dir"] == str(tmp_path / "xdg" / "pcast_jax" / "jax-cache")
    assert any((tmp_path / "xdg" / "pcast_jax" / "jax-cache").iterdir())
    warm = _cached_run(env, {**kw, "seed_offset": 5, "base_seed": 3, "deltas": (1.0, 2.0)})
    assert warm["hits"] >= 1 and warm["hits"] > cold["hits"]
    (tmp_path / "blocker").write_text("")
    off = _cached_run({**env, cache.ENV_VAR: str(tmp_path / "blocker" / "cache")}, SPEC_KW)
    assert off["dir"] is None and not off["config"]
    assert _cached_run({**env, cache.ENV_VAR: "0"}, SPEC_KW)["dir"] is None


_CACHE_PROGRAM = """
import sys, jax, numpy as np
from pcast_jax.cache import enable
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name))
assert enable(True, sys.argv[1]) is not None
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
k = float(sys.argv[2])
print(float(jax.jit(lambda x: x * k + 1.0)(np.float32(2.0))), hits.count("/jax/compilation_cache/cache_hits"))
"""


def _program(folder, k):
    """(result, cache hits, stderr) of x*k + 1 at x = 2, compiled through the cache in ``folder``."""
    env = {k_: v for k_, v in os.environ.items() if k_ not in _CACHE_VARS}
    proc = subprocess.run([sys.executable, "-c", _CACHE_PROGRAM, str(folder), str(k)], capture_output=True,
                          text=True, timeout=300, env={**env, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    value, hits = proc.stdout.split()
    return float(value), int(hits), proc.stderr


def _entry(folder):
    (entry,) = [p for p in folder.iterdir() if p.name.endswith("-cache")]
    return entry


@pytest.mark.parametrize("damage", ["garbage", "truncated", "another_program", "plain_jax_entry"])
def test_a_damaged_or_foreign_cache_entry_is_never_used_and_is_replaced_once(tmp_path, damage):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _program(a, 3)[:2] == (7.0, 0)
    good = _entry(a).read_bytes()
    assert _program(a, 3)[:2] == (7.0, 1)  # verified and loaded
    if damage == "garbage":
        _entry(a).write_bytes(os.urandom(len(good)))
    elif damage == "truncated":
        _entry(a).write_bytes(good[: len(good) // 2])
    elif damage == "another_program":  # x*5+1's entry, digest and all, under x*3+1's name
        assert _program(b, 5)[:2] == (11.0, 0)
        _entry(a).write_bytes(_entry(b).read_bytes())
    else:  # what JAX itself writes: the content without the project's digest
        _entry(a).write_bytes(good[len(cache._MAGIC) + 32:])
    value, hits, err = _program(a, 3)
    assert (value, hits) == (7.0, 0), (value, hits)  # never the foreign program's 11.0
    assert "persistent compilation cache" not in err.lower(), err[-2000:]  # no warning: replaced silently
    assert _entry(a).read_bytes().startswith(cache._MAGIC)
    replaced = _entry(a).stat().st_mtime_ns
    assert _program(a, 3)[:2] == (7.0, 1)  # replaced once: loaded again from now on
    assert _entry(a).stat().st_mtime_ns == replaced


def test_the_suites_cache_folder_is_trimmed_to_half_its_limit_least_recently_used_first(tmp_path):
    import conftest

    for i in range(10):  # entry i last used at time 1000 + i
        p = tmp_path / f"entry{i}-cache"
        p.write_bytes(b"x" * 100)
        os.utime(p, (1000 + i, 1000 + i))
    conftest._trim(tmp_path, 1000)  # 1000 bytes exactly: under the limit, nothing removed
    assert len(list(tmp_path.iterdir())) == 10
    conftest._trim(tmp_path, 999)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"entry{i}-cache" for i in range(6, 10)]
    conftest._trim(tmp_path / "missing", 1)  # no folder yet: nothing to do


_MIN_TIME = """
import sys, jax
from pcast_jax import cache
assert cache.enable(True, sys.argv[1]) is not None
print(jax.config.jax_persistent_cache_min_compile_time_secs)
"""


@pytest.mark.parametrize("value", [None, "0", "2.5"])
def test_the_shortest_cached_compile_is_half_a_second_unless_set_through_jax(tmp_path, value):
    env = {k: v for k, v in os.environ.items() if k not in _CACHE_VARS}
    if value is not None:
        env[cache._MIN_TIME_VAR] = value
    proc = subprocess.run([sys.executable, "-c", _MIN_TIME, str(tmp_path / "c")], capture_output=True, text=True,
                          timeout=300, env={**env, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.split()[-1]) == (0.5 if value is None else float(value))


_UNTOUCHED_RUN = """
import jax
import numpy as np
before = dict(jax.config.values)
from jax._src import compilation_cache as cc
cache_before = (cc._cache, getattr(cc, "_cache_initialized", None))
import pcast_jax as pj
from pcast_jax.sweep import SweepSpec, run_sweep
run_sweep(SweepSpec(configs=("fwd_s1",), ns=(64,), seeds=2, q_len=2, d=4), progress=False)
q = np.ones((1, 8, 2, 4), np.float32)
pj.dot_product_attention(q, q, q, config="fa3").block_until_ready()
changed = {k: (before.get(k), v) for k, v in jax.config.values.items() if before.get(k) != v}
assert not changed, changed
assert (cc._cache, getattr(cc, "_cache_initialized", None)) == cache_before
assert jax.config.jax_compilation_cache_dir is None
print("untouched")
"""


def test_library_calls_leave_jax_config_and_its_cache_untouched():
    """run_sweep and the drop-in change no JAX option and no cache (the command line turns the cache on)."""
    env = {k: v for k, v in os.environ.items() if k not in _CACHE_VARS}
    proc = subprocess.run([sys.executable, "-c", _UNTOUCHED_RUN], env={**env, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("untouched"), proc.stderr[-3000:]
