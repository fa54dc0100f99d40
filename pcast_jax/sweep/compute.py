"""The compiled chunk: every (seed, Δ) instance of a chunk through one loop body, sharded by seed.

An instance's scores and V are drawn from :func:`~pcast_jax.sweep.spec.instance_key` once per seed
and shared by every Δ and config. Instances run one after another through the same compiled loop
body (:func:`_loop_map`); only the per-device shard axis is vmapped, so results do not depend on the
chunk size, the Δ grouping or the device count.
"""

from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pcast_jax import metrics
from pcast_jax.sweep.plan import seed_indices
from pcast_jax.sweep.spec import SweepSpec, instance_key
from pcast_jax.workloads import make_instance

__all__ = ["chunk_metrics", "compute_chunk", "global_mesh", "start_global_call", "local_rows"]


def _loop_map(fn, xs):
    """``lax.map(fn, xs)`` as a while loop compiled the same way for every length of ``xs``.

    XLA simplifies loops it can see through: one it knows runs once is inlined, and indexing a
    length-1 array does not depend on the loop counter, so the whole body is hoisted out of the
    loop. Either changes fusion, and so the low-order bits. Here the trip count is hidden behind
    an optimization barrier and ``xs`` gets one unused extra element, so every element goes
    through the same compiled body.
    """
    count = xs.shape[0]
    shapes = jax.eval_shape(fn, jax.tree.map(lambda x: x[0], xs))
    init = jax.tree.map(lambda s: jnp.zeros((count,) + s.shape, s.dtype), shapes)
    xs = jax.tree.map(lambda x: jnp.concatenate([x, x[-1:]]), xs)
    stop = jax.lax.optimization_barrier(jnp.int32(count))

    def body(state):
        i, acc = state
        y = fn(jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), xs))
        return i + 1, jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, i, 0), acc, y)

    _, out = jax.lax.while_loop(lambda state: state[0] < stop, body, (jnp.int32(0), init))
    return out


@partial(jax.jit, static_argnames=("spec", "n", "n_shards"))
def chunk_metrics(seed_idx, deltas, *, spec: SweepSpec, n: int, n_shards: int = 1):
    """(C,) seeds × (D,) deltas → metric → (C, D, n_configs). One draw per seed, shared by every Δ.

    Every (seed, Δ) instance is computed by the same compiled loop body: a loop over Δ inside a
    loop over seeds (:func:`_loop_map`), not a vmap. XLA:CPU's code for reductions, divisions and
    exponentials depends on array shapes and on what gets fused, so a vmap over a batch whose size
    follows the chunk size or the device count changes low-order bits; the loops make the results
    bit-identical whatever the chunking, Δ grouping or device count (and are faster on CPU). The
    seed axis is split into ``n_shards`` rows (one per device of a sharded ``seed_idx``; C must be
    a multiple) and only that axis is vmapped, so each device loops over its own seeds.
    """
    workload = spec.workload(n)

    def per_seed(seed):
        base = make_instance(instance_key(spec.base_seed, n, seed), workload, 0.0)

        def per_delta(delta):
            inst = base._replace(scores=base.scores + jnp.where(base.is_sink, delta, 0.0))
            return metrics.evaluate(inst, spec.configs, engine=spec.engine, sigma_v=spec.sigma_v,
                                    expected=spec.expected_mse)

        return _loop_map(per_delta, deltas)

    rows = seed_idx.reshape(n_shards, -1)  # (shards, C / shards)
    out = jax.vmap(lambda row: _loop_map(per_seed, row))(rows)
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), out)


def compute_chunk(spec: SweepSpec, n: int, seed_start: int, seed_stop: int, delta_idx=None,
                  devices=None) -> dict[str, np.ndarray]:
    """Metrics for seeds [seed_start, seed_stop) × the deltas ``delta_idx`` (default all) of N = n.

    The seed axis is sharded over ``devices`` (default all ``jax.devices()``), padded to a multiple
    of their count.

    Returns:
      metric → array of shape (seed_stop − seed_start, len(delta_idx), len(configs)).
    """
    devices = list(devices or jax.devices())
    count = seed_stop - seed_start
    seeds = seed_indices(spec, seed_start, seed_stop, -(-count // len(devices)) * len(devices))
    didx = np.arange(len(spec.deltas)) if delta_idx is None else np.asarray(delta_idx)
    deltas = np.asarray(spec.deltas, np.float32)[didx]
    if len(devices) > 1:
        mesh = Mesh(np.asarray(devices), ("i",))
        seeds = jax.device_put(seeds, NamedSharding(mesh, PartitionSpec("i")))
        deltas = jax.device_put(deltas, NamedSharding(mesh, PartitionSpec()))
    out = chunk_metrics(seeds, deltas, spec=spec, n=n, n_shards=len(devices))
    return {k: np.asarray(v)[:count] for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# One mesh over every process's devices
# --------------------------------------------------------------------------------------------


def global_mesh() -> Mesh:
    """1-D mesh over every process's devices, each process's devices contiguous and in order.

    Rows [p · slot, (p + 1) · slot) of a row-sharded array then lie on process p's devices.
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.asarray(devices), ("i",))


@lru_cache(maxsize=8)
def _sharded_chunk_fn(mesh: Mesh):
    """:func:`chunk_metrics` with its output rows kept where the input seeds live."""
    rows = NamedSharding(mesh, PartitionSpec("i"))
    return jax.jit(chunk_metrics, static_argnames=("spec", "n", "n_shards"), out_shardings=rows)


def start_global_call(spec: SweepSpec, n: int, seeds: np.ndarray, deltas: np.ndarray, mesh: Mesh) -> dict:
    """Dispatch one chunk computation over ``mesh`` (every process calls it with the same arguments).

    Args:
      spec: the sweep.
      n: KV length.
      seeds: the global seed-index vector (length a multiple of the mesh size), sharded by rows.
      deltas: the Δ values, replicated.
      mesh: :func:`global_mesh`.

    Returns:
      metric → global array of shape (len(seeds), len(deltas), len(configs)), row-sharded like
      ``seeds``; read this process's rows with :func:`local_rows`.
    """
    rows = NamedSharding(mesh, PartitionSpec("i"))
    replicated = NamedSharding(mesh, PartitionSpec())
    seeds_g = jax.make_array_from_callback(seeds.shape, rows, lambda idx: seeds[idx])
    deltas_g = jax.make_array_from_callback(deltas.shape, replicated, lambda idx: deltas[idx])
    return _sharded_chunk_fn(mesh)(seeds_g, deltas_g, spec=spec, n=n, n_shards=mesh.size)


def local_rows(arr: jax.Array, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of the row-sharded global ``arr``; they must lie on this process's devices."""
    pieces = {}
    for shard in arr.addressable_shards:
        first = shard.index[0].start or 0
        block = np.asarray(shard.data)
        for k in range(block.shape[0]):
            pieces[first + k] = block[k]
    return np.stack([pieces[r] for r in range(start, stop)])
