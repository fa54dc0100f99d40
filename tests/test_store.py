"""The sweep folder as a database: exclusive claims, every file checked against spec.json, cleanup.

Fault injection in the style of ``test_interrupt.py``: each test damages or races the store in a
whole class of ways (every tag of a chunk, every field of spec.json, truncation at many offsets,
two processes released at once) and asserts that nothing mismatched is ever trusted.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pcast_jax import metrics
from pcast_jax.errors import PcastError
from pcast_jax.fileio import clean_stale_temps, create_exclusive, temp_prefix
from pcast_jax.sweep import SweepSpec, load_result, run_sweep, store
from pcast_jax.sweep import local as sweep_local

from cases import count_chunks

TINY = dict(configs=("fwd_s1", "rev_s256"), deltas=(5.0, 7.0, 9.0), ns=(64, 96), seeds=4, q_len=2, d=4)


@pytest.fixture(scope="module")
def spec():
    return SweepSpec(**TINY)


@pytest.fixture(scope="module")
def finished(spec, tmp_path_factory):
    """A finished sweep folder (chunks of 2 seeds, Δ groups of 2) and its result."""
    out = tmp_path_factory.mktemp("finished") / "run"
    res = run_sweep(spec, out, chunk_size=2, progress=False)
    return out, res


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _same_bits(a: dict, b: dict) -> None:
    assert set(a) == set(b) == set(metrics.METRICS)
    for m in a:
        np.testing.assert_array_equal(a[m].view(np.uint32), b[m].view(np.uint32), err_msg=m)




# --------------------------------------------------------------------------------------------
# Two writers released at the same moment
# --------------------------------------------------------------------------------------------

RACE_TRIALS = 12


def _racer(who: int, root: str, barrier, results) -> None:
    """Run sweep ``who`` (Δ = 7 or Δ = 11) into ``root/t<k>`` for every trial, released by ``barrier``."""
    from pcast_jax.errors import PcastError as Refused
    from pcast_jax.sweep import SweepSpec as Spec
    from pcast_jax.sweep import run_sweep as run

    spec = Spec(configs=("fwd_s1",), deltas=(7.0 if who == 0 else 11.0,), ns=(64,), seeds=2, q_len=2, d=4)
    run(spec, None, chunk_size=1, progress=False)  # compile before the first release
    for k in range(RACE_TRIALS):
        barrier.wait(timeout=120)
        try:
            res = run(spec, Path(root) / f"t{k}", chunk_size=1, progress=False)
            results.put((k, who, "ok", float(res.data["mse"][0, 0, 0, 0])))
        except Refused as exc:
            results.put((k, who, "refused", str(exc)))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results.put((k, who, "crashed", f"{type(exc).__name__}: {exc}"))


def test_two_sweeps_released_at_once_into_one_folder_one_wins(tmp_path):
    """Two processes, two different sweeps, one folder, released together by a barrier, many times.

    Exactly one is accepted and the other refused with PcastError in every trial, and the folder's
    spec.json and results.npz always belong to the winner.
    """
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(who, str(tmp_path), barrier, results)) for who in (0, 1)]
    for p in procs:
        p.start()
    rows = [results.get(timeout=240) for _ in range(2 * RACE_TRIALS)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    wins = [0, 0]
    for k in range(RACE_TRIALS):
        got = sorted((r for r in rows if r[0] == k), key=lambda r: r[1])
        outcomes = [r[2] for r in got]
        assert sorted(outcomes) == ["ok", "refused"], got
        winner = outcomes.index("ok")
        wins[winner] += 1
        assert "different sweep" in got[1 - winner][3]
        res = load_result(tmp_path / f"t{k}")  # checked against spec.json: never the loser's data
        assert res.spec.deltas == ((7.0,) if winner == 0 else (11.0,))
        assert float(res.data["mse"][0, 0, 0, 0]) == got[winner][3]
    print(f"race wins by process: {wins} over {RACE_TRIALS} trials")


def test_create_exclusive_has_exactly_one_winner_among_threads(tmp_path):
    """Many threads create the same file at once: one wins, the file is whole, no temp file stays."""
    for trial in range(20):
        path = tmp_path / f"f{trial}.json"
        gate, won, lost = threading.Barrier(8), [], []

        def create(i):
            gate.wait()
            try:
                create_exclusive(path, lambda f: f.write(json.dumps({"writer": i, "pad": "x" * 4096})), text=True)
                won.append(i)
            except FileExistsError:
                lost.append(i)

        threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(lost) == 7
        assert json.loads(path.read_text())["writer"] == won[0]
    assert not list(tmp_path.glob(".*.tmp"))


def test_writability_probes_of_concurrent_runs_never_collide(tmp_path):
    """Probe names are unique per process and call: threads probing one folder never fail."""
    errors = []

    def probe():
        for _ in range(150):
            try:
                store._check_writable(tmp_path)
            except PcastError as exc:
                errors.append(str(exc))

    threads = [threading.Thread(target=probe) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# Chunks: every tag and every array checked against the spec
# --------------------------------------------------------------------------------------------


def _rewrite(path: Path, change) -> None:
    with np.load(path) as z:
        entries = {k: z[k] for k in z.files}
    change(entries)
    with open(path, "wb") as f:
        np.savez(f, **entries)


def _other_sweep_fp(spec):
    return SweepSpec(**{**TINY, "seeds": 5}).fingerprint()


#: One damage per way a chunk can disagree with the spec.
CHUNK_DAMAGE = {
    "seed axis longer": lambda e, s: e.update({k: np.concatenate([v, v[:1]]) for k, v in e.items() if k[:2] == "m_"}),
    "delta axis shorter": lambda e, s: e.update({k: v[:, :1] for k, v in e.items() if k[:2] == "m_"}),
    "config axis longer": lambda e, s: e.update({k: np.concatenate([v, v], 2) for k, v in e.items() if k[:2] == "m_"}),
    "float64 metrics": lambda e, s: e.update({k: v.astype(np.float64) for k, v in e.items() if k[:2] == "m_"}),
    "float16 metric": lambda e, s: e.update(m_mse=e["m_mse"].astype(np.float16)),
    "metric missing": lambda e, s: e.pop("m_zeroed_mass"),
    "extra metric": lambda e, s: e.update(m_bogus=e["m_mse"]),
    "extra entry": lambda e, s: e.update(note=np.array("x")),
    "other fingerprint": lambda e, s: e.update(fingerprint=np.array(_other_sweep_fp(s))),
    "other bounds": lambda e, s: e.update(bounds=e["bounds"] + np.array([2, 2, 0, 0])),
    "other grid place": lambda e, s: e.update(unit=e["unit"] + np.array([1, 0, 0])),
    "other N": lambda e, s: e.update(n=np.array(96)),
    "other deltas": lambda e, s: e.update(deltas=e["deltas"] + 1.0),
    "no grid place (older file)": lambda e, s: e.pop("unit"),
    "bounds as text": lambda e, s: e.update(bounds=np.array("0,2,0,2")),
}


@pytest.mark.parametrize("damage", sorted(CHUNK_DAMAGE))
def test_chunk_that_disagrees_with_the_spec_is_removed_and_recomputed(finished, spec, tmp_path, monkeypatch,
                                                                      damage):
    out = _copy(finished[0], tmp_path / "run")
    (out / "results.npz").unlink()
    victim = sorted((out / "chunks").glob("n64_*.npz"))[0]
    _rewrite(victim, lambda e: CHUNK_DAMAGE[damage](e, spec))
    todo = sweep_local.units(spec, json.loads((out / "spec.json").read_text())["layout"])
    unit = next(u for u in todo if store.chunk_path(out, spec, u) == victim)
    assert isinstance(store.check_chunk(victim, spec, unit), str)
    with pytest.raises(PcastError, match=victim.name):  # the multi-process merge refuses it
        store.merge(out, spec, [unit], store.empty_results(spec))
    calls = count_chunks(monkeypatch)
    res = run_sweep(spec, out, progress=False)
    assert len(calls) == 1  # exactly the damaged chunk, never merged
    _same_bits(res.data, finished[1].data)
    _same_bits(load_result(out).data, finished[1].data)
    assert not isinstance(store.check_chunk(victim, spec, unit), str)


def test_chunk_moved_to_another_place_is_never_read(finished, spec, tmp_path, monkeypatch):
    """Every chunk file copied over every other one of equal shape: each copy is recomputed."""
    out = _copy(finished[0], tmp_path / "run")
    (out / "results.npz").unlink()
    chunks = sorted((out / "chunks").glob("*.npz"))
    blobs = [p.read_bytes() for p in chunks]
    for i, path in enumerate(chunks):  # rotate: every file now holds its neighbour's content
        path.write_bytes(blobs[(i + 1) % len(blobs)])
    calls = count_chunks(monkeypatch)
    _same_bits(run_sweep(spec, out, progress=False).data, finished[1].data)
    assert len(calls) == len(chunks)


# --------------------------------------------------------------------------------------------
# spec.json and results.npz
# --------------------------------------------------------------------------------------------

#: Ways spec.json can be damaged; each value maps the saved JSON text to the damaged text.
SPEC_DAMAGE = {
    "empty": lambda t: "",
    "not json": lambda t: "{not json",
    "a list": lambda t: "[1, 2]",
    "no spec": lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "spec"}),
    "no layout": lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "layout"}),
    "chunk_size 0": lambda t: _edit(t, lambda d: d["layout"].update(chunk_size=0)),
    "chunk_size -2": lambda t: _edit(t, lambda d: d["layout"].update(chunk_size=-2)),
    "chunk_size text": lambda t: _edit(t, lambda d: d["layout"].update(chunk_size="2")),
    "chunk_size float": lambda t: _edit(t, lambda d: d["layout"].update(chunk_size=2.0)),
    "chunk_size true": lambda t: _edit(t, lambda d: d["layout"].update(chunk_size=True)),
    "delta_group 0": lambda t: _edit(t, lambda d: d["layout"].update(delta_group=0)),
    "delta_group too big": lambda t: _edit(t, lambda d: d["layout"].update(delta_group=99)),
    "delta_group null": lambda t: _edit(t, lambda d: d["layout"].update(delta_group=None)),
    "fingerprint changed": lambda t: _edit(t, lambda d: d.update(fingerprint="0" * 16)),
    "spec field changed": lambda t: _edit(t, lambda d: d["spec"].update(seeds=3)),
    "spec field bad": lambda t: _edit(t, lambda d: d["spec"].update(sigma="x")),
    "spec field unknown": lambda t: _edit(t, lambda d: d["spec"].update(bogus=1)),
    "configs bad": lambda t: _edit(t, lambda d: d["spec"].update(configs=[{"name": 3}])),
    "deltas a number": lambda t: _edit(t, lambda d: d["spec"].update(deltas=7)),
    "nan sigma": lambda t: t.replace('"sigma": 1.0', '"sigma": NaN'),
}


def _edit(text: str, change) -> str:
    d = json.loads(text)
    change(d)
    return json.dumps(d)


@pytest.mark.parametrize("damage", sorted(SPEC_DAMAGE))
def test_damaged_spec_json_gives_one_error_naming_the_file(finished, spec, tmp_path, monkeypatch, damage):
    out = _copy(finished[0], tmp_path / "run")
    manifest = out / "spec.json"
    manifest.write_text(SPEC_DAMAGE[damage](manifest.read_text()))
    calls = count_chunks(monkeypatch)
    for action in (lambda: load_result(out), lambda: run_sweep(spec, out, progress=False)):
        with pytest.raises(PcastError) as info:
            action()
        assert "spec.json" in str(info.value) and "\n" not in str(info.value)
    assert calls == []  # refused before any work: no all-NaN results are ever written


@pytest.mark.parametrize("cut", [0, 1, 10, 100, 0.25, 0.5, 0.9, -1])
def test_truncated_spec_json_at_any_length_is_refused(finished, spec, tmp_path, cut):
    out = _copy(finished[0], tmp_path / "run")
    text = (out / "spec.json").read_bytes()
    keep = int(len(text) * cut) if isinstance(cut, float) else (len(text) - 1 if cut == -1 else cut)
    (out / "spec.json").write_bytes(text[:keep])
    with pytest.raises(PcastError, match="spec.json"):
        load_result(out)
    with pytest.raises(PcastError, match="spec.json"):
        run_sweep(spec, out, progress=False)


def test_load_result_refuses_results_of_another_sweep(finished, spec, tmp_path):
    """The issue's mix-up: one sweep's spec.json beside another's results.npz is refused."""
    other = SweepSpec(**{**TINY, "deltas": (5.0, 11.0, 9.0)})  # same shapes, other Δ coordinates
    out_b = tmp_path / "b"
    run_sweep(other, out_b, chunk_size=2, progress=False)
    out_a = _copy(finished[0], tmp_path / "a")
    (out_a / "results.npz").write_bytes((out_b / "results.npz").read_bytes())
    with pytest.raises(PcastError, match="another sweep"):
        load_result(out_a)


RESULT_DAMAGE = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "garbage": lambda p: p.write_bytes(b"PK\x03\x04 nothing"),
    "seed axis shorter": lambda p: _rewrite(p, lambda e: e.update({m: e[m][..., :-1] for m in metrics.METRICS})),
    "N axis longer": lambda p: _rewrite(
        p, lambda e: e.update({m: np.concatenate([e[m], e[m]]) for m in metrics.METRICS})),
    "float64": lambda p: _rewrite(p, lambda e: e.update(mse=e["mse"].astype(np.float64))),
    "metric missing": lambda p: _rewrite(p, lambda e: e.pop("frac_zeroed")),
    "extra metric": lambda p: _rewrite(p, lambda e: e.update(bogus=e["mse"])),
    "other fingerprint": lambda p: _rewrite(p, lambda e: e.update(fingerprint=np.array("0" * 16))),
}


@pytest.mark.parametrize("damage", sorted(RESULT_DAMAGE))
def test_load_result_refuses_results_that_do_not_match_spec_json(finished, tmp_path, damage):
    out = _copy(finished[0], tmp_path / "run")
    RESULT_DAMAGE[damage](out / "results.npz")
    with pytest.raises(PcastError, match="results.npz"):
        load_result(out)


def test_results_without_their_fingerprint_are_refused(finished, tmp_path):
    out = _copy(finished[0], tmp_path / "run")
    _rewrite(out / "results.npz", lambda e: e.pop("fingerprint"))
    with pytest.raises(PcastError, match="belongs to another sweep"):
        load_result(out)


def test_results_are_not_written_into_a_folder_claimed_meanwhile(finished, spec, tmp_path):
    out = _copy(finished[0], tmp_path / "run")
    (out / "spec.json").unlink()
    store.claim_dir(out, SweepSpec(**{**TINY, "seeds": 5}), {"chunk_size": 2, "delta_group": 2})
    with pytest.raises(PcastError, match="claimed by another sweep"):
        store.write_results(out, spec, finished[1].data)


# --------------------------------------------------------------------------------------------
# Leftovers of killed writers
# --------------------------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temp_files_of_killed_writers_are_removed_on_resume(finished, spec, tmp_path, monkeypatch):
    out = _copy(finished[0], tmp_path / "run")
    host_prefix = temp_prefix("x").split(".")[2]
    dead, alive = _dead_pid(), os.getppid()
    names = {
        "dead": f".n64_g000_c000000.npz.{host_prefix}.{dead}.abc123.tmp",
        "alive": f".n64_g000_c000000.npz.{host_prefix}.{alive}.abc124.tmp",
        "foreign young": ".n64_g000_c000001.npz.otherhost.123.abc125.tmp",
        "foreign old": ".n64_g000_c000001.npz.otherhost.124.abc126.tmp",
        "old naming, old": ".n64_g000_c000001.npz.abc127.tmp",
    }
    for key, name in names.items():
        path = out / "chunks" / name
        path.write_bytes(b"half a chunk")
        if key in ("foreign old", "old naming, old"):
            os.utime(path, (time.time() - 2 * 86400,) * 2)
    (out / f".spec.json.{host_prefix}.{dead}.abc128.tmp").write_text("{")
    calls = count_chunks(monkeypatch)
    run_sweep(spec, out, progress=False)
    assert calls == []
    left = {p.name for p in out.rglob(".*.tmp")}
    assert left == {names["alive"], names["foreign young"]}


def test_clean_stale_temps_never_touches_other_files(tmp_path):
    for name in ("a.tmp", ".hidden", ".x.npz", "spec.json", ".probe_p0000_ab"):
        (tmp_path / name).write_text("keep")
        os.utime(tmp_path / name, (0, 0))
    assert clean_stale_temps(tmp_path, max_age_s=0) == []
    assert len(list(tmp_path.iterdir())) == 5


# --------------------------------------------------------------------------------------------
# The model cache
# --------------------------------------------------------------------------------------------


def _tiny_model():
    from pcast_jax.models.llama_common import LlamaConfig

    cfg = LlamaConfig(num_layers=1, hidden_size=4, intermediate_size=6, num_heads=2, num_kv_heads=1,
                      head_dim=2, rope_base=1e4, rope_dim=2, rms_eps=1e-5, vocab_size=5, context_length=16,
                      tied_embeddings=True, name="tiny")
    rng = np.random.default_rng(0)
    shapes = {"embed": (5, 4), "final_norm": (4,), "layers.attn_norm": (1, 4), "layers.wq": (1, 4, 4),
              "layers.wk": (1, 2, 4), "layers.wv": (1, 2, 4), "layers.wo": (1, 4, 4), "layers.mlp_norm": (1, 4),
              "layers.w_gate": (1, 6, 4), "layers.w_up": (1, 6, 4), "layers.w_down": (1, 4, 6)}
    return cfg, {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}, "{}"


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    from pcast_jax.models import gguf_loader

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_loader, "require_model_extra", lambda **_: None)
    parses = []
    monkeypatch.setattr(gguf_loader, "_read_gguf", lambda p: parses.append(p) or _tiny_model())
    model = tmp_path / "venv1" / "tiny.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    return gguf_loader, model, parses


def _cache_entries(tmp_path):
    return sorted((tmp_path / "cache" / "pcast_jax").iterdir())


CACHE_DAMAGE = {
    "empty": lambda p: p.write_bytes(b""),
    "garbage": lambda p: p.write_bytes(b"not an npz at all"),
    "zip header only": lambda p: p.write_bytes(b"PK\x03\x04" + b"\0" * 40),
    **{f"truncated to {f:.0%}": (lambda f: lambda p: p.write_bytes(p.read_bytes()[: int(p.stat().st_size * f)]))(f)
       for f in (0.05, 0.3, 0.6, 0.95, 0.999)},
    "config not json": lambda p: _rewrite(p, lambda e: e.update(__config__=np.frombuffer(b"{", np.uint8))),
    "config not utf-8": lambda p: _rewrite(p, lambda e: e.update(__config__=np.frombuffer(b"\xff\xfe", np.uint8))),
    "config wrong fields": lambda p: _rewrite(p, lambda e: e.update(__config__=np.frombuffer(b'{"x": 1}', np.uint8))),
    "tensor missing": lambda p: _rewrite(p, lambda e: e.pop("layers.wq")),
    "tensor reshaped": lambda p: _rewrite(p, lambda e: e.update(embed=e["embed"].reshape(4, 5))),
    "tensor float16": lambda p: _rewrite(p, lambda e: e.update(embed=e["embed"].astype(np.float16))),
}


@pytest.mark.parametrize("damage", sorted(CACHE_DAMAGE))
def test_damaged_model_cache_is_rebuilt(fake_model, tmp_path, damage):
    loader, model, parses = fake_model
    cfg, flat = loader._load_flat(model)[:2]
    entry = loader._cache_path(model)
    CACHE_DAMAGE[damage](entry)
    cfg2, flat2 = loader._load_flat(model)[:2]
    assert len(parses) == 2 and cfg2 == cfg
    for k in flat:
        np.testing.assert_array_equal(flat2[k], flat[k])
    assert _cache_entries(tmp_path) == [entry]
    loader._load_flat(model)
    assert len(parses) == 2  # the rebuilt entry is used


def test_model_cache_keeps_one_copy_per_model_not_per_install(fake_model, tmp_path):
    loader, model, parses = fake_model
    loader._load_flat(model)
    entry = loader._cache_path(model)
    stale = entry.parent / f"tiny-{model.stat().st_size}-1700000000000000000-v1.npz"  # mtime-keyed key
    stale.write_bytes(entry.read_bytes())
    other_model = entry.parent / "tiny-999-0123456789abcdef-v1.npz"  # another size: another model
    other_model.write_bytes(b"x")
    for venv in ("venv2", "venv3"):  # the same file installed elsewhere, with another mtime
        copy = tmp_path / venv / "tiny.gguf"
        copy.parent.mkdir()
        copy.write_bytes(model.read_bytes())
        os.utime(copy, ns=(1, 10**18))
        assert loader._cache_path(copy) == entry
        loader._load_flat(copy)
    assert len(parses) == 1
    changed = tmp_path / "venv4" / "tiny.gguf"  # same size, other content: another entry
    changed.parent.mkdir()
    changed.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 8)
    assert loader._cache_path(changed) != entry
    loader._load_flat(changed)
    assert len(parses) == 2
    names = {p.name for p in _cache_entries(tmp_path)}
    assert stale.name not in names and other_model.name in names
    assert loader._cache_path(changed).name in names


def test_a_sweep_is_resumed_only_under_the_jax_that_started_it(finished, spec, tmp_path, monkeypatch):
    """Chunks of two jax versions are never mixed (their MSEs differ in low-order bits); the
    finished folder still loads under any version."""
    out = _copy(finished[0], tmp_path / "run")
    manifest = out / "spec.json"
    manifest.write_text(_edit(manifest.read_text(), lambda d: d.update(jax="0.10.0")))
    calls = count_chunks(monkeypatch)
    with pytest.raises(PcastError, match=r"started under jax 0\.10\.0.*resume under jax 0\.10\.0") as info:
        run_sweep(spec, out, progress=False)
    assert "\n" not in str(info.value) and calls == []
    assert load_result(out).spec == spec
