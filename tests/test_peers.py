"""The benchmark's NumPy peer (benchmarks/peers.py) computes the sweep's metrics: same instance, same numbers."""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from pcast_jax import metrics
from pcast_jax.sweep import instance_key
from pcast_jax.workloads import SinkWorkload, make_instance

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import peers  # noqa: E402

_evaluate = jax.jit(lambda inst: metrics.evaluate(inst, tuple(c for c, _, _ in peers.CONFIGS)))


@pytest.mark.parametrize("delta", [4.0, 9.0])
def test_numpy_peer_matches_evaluate(delta):
    w = SinkWorkload(n=512, q_len=8, d=16)
    insts = [make_instance(instance_key(0, w.n, k), w, delta) for k in range(2)]
    z = np.stack([np.asarray(i.scores) for i in insts])
    v = np.stack([np.asarray(i.v) for i in insts])
    got = peers.numpy_metrics(z, v, np.asarray(insts[0].is_sink))
    for k, inst in enumerate(insts):
        ref = _evaluate(inst)
        for m in peers.METRICS:
            np.testing.assert_allclose(got[m][k], np.asarray(ref[m], np.float64), rtol=1e-4, atol=1e-12, err_msg=m)
    assert got["frac_zeroed"][:, 0].min() > 0  # forward S = 1 zeroes at these Δ: the counts are exercised


def test_numpy_peer_draws_the_workload():
    out = peers.numpy_peer(3, batch=2, n=256, q=4, d=8)
    assert set(out) == set(peers.METRICS)
    assert all(v.shape == (3, len(peers.CONFIGS)) and np.all(np.isfinite(v)) for v in out.values())


def test_gpu_check_steady_step_times_each_micro_batch(tmp_path):
    """gpu_check.sh step (d) as its CPU smoke runs it: one record per micro-batch, finite and positive."""
    import json
    import subprocess

    out = tmp_path / "steady.json"
    root = Path(__file__).parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "sweep_bench.py"), "--steady-only", "--seeds", "2",
                           "--repeats", "1", "--micro-batch", "1,2", "--out", str(out)],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = json.loads(out.read_text())
    assert [r["micro_batch"] for r in records] == [1, 2]
    assert all(np.isfinite(r["instances_per_s"]) and r["instances_per_s"] > 0 for r in records)
    assert proc.stdout.count("micro_batch=") == 2
    bad = subprocess.run([sys.executable, str(root / "benchmarks" / "sweep_bench.py"), "--steady-only",
                          "--micro-batch", "0"], cwd=root, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--micro-batch" in bad.stderr
