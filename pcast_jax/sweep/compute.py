"""The compiled chunk: every (seed, Δ) instance of a chunk through one compiled body, sharded by seed.

An instance's scores and V are drawn from :func:`~pcast_jax.sweep.spec.instance_key` once per seed
and shared by every Δ and config. What is compiled depends on the shapes only (:class:`ChunkShape`:
configs, workload, implementation, N, micro-batch); the seed indices, the base seed and the Δ values are
traced arguments, so another seed range, base seed or set of Δ values of the same shapes reuses
the compiled program (and JAX's persistent cache, :mod:`pcast_jax.cache`, keeps it across processes).

Seeds go through the body in groups of ``spec.micro_batch``: with 1 (the default) one seed at a
time through a loop (:func:`_loop_map`), with M > 1 in vmapped groups of exactly M (the chunk padded
with discarded seeds). Either way every instance runs through one compiled body of fixed shape and
only the per-device shard axis is vmapped on top, so results do not depend on the chunk size, the
Δ grouping, the device count or the process count. They do depend on M: XLA:CPU compiles the
reductions of a batch of M differently from those of one instance, so the low-order bits of
M > 1 differ from M = 1 (M is part of the fingerprint). The cause, measured (a sum alone, jitted
and vmapped, shows it): XLA:CPU picks a reduction's summation order by the size of its input,
switching between 3584 and 4096 elements; the sums over the KV blocks of a row (ℓ and the zeroed
mass, q × N/B elements: 32 × 64 = 2048 at Table 2's shapes) lie below the switch for one instance
and above it for a micro-batch of two or more, so ℓ, and through it the weights and every MSE,
differ in the last bits (the sums within a block, q × N = 131072 elements there, lie above it
either way and agree; at small shapes they too can straddle it). Summing in a fixed order of its
own would change the M = 1 results.

The configs go through in groups of at most :data:`~pcast_jax.sweep.spec.CONFIG_GROUP`, one
compiled program per group (:func:`config_groups`), their metrics concatenated along the config axis.
Every config is its own code in the program, and XLA:CPU's compile time grows about quadratically
with the program's size: measured on a 2-core CPU at N = 256, d = 16, Δ = (7, 10), 4 configs compile
in 3.0 s, 8 in 5.8 s, 16 in 18.3 s, 32 in 60.6 s; the vendors study's 52 presets took 124 s as one
program (its whole section, cold, 133 s before the groups and 44 s after). A config's numbers do
not depend on the configs of other groups; within a group, the configs with an FP32 accumulator
share one product with V (:func:`pcast_jax.metrics.evaluate`).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pcast_jax import metrics
from pcast_jax.sweep.plan import seed_indices
from pcast_jax.sweep.spec import CONFIG_GROUP, SweepSpec, instance_key
from pcast_jax.workloads import SinkWorkload, make_instance

__all__ = ["ChunkShape", "chunk_shape", "config_groups", "chunk_metrics", "compute_chunk",
           "chunk_args", "global_mesh", "start_global_call", "local_rows"]


@dataclasses.dataclass(frozen=True)
class ChunkShape:
    """The static part of a compiled chunk: everything that sets its shapes or its program.

    Seeds, seed offset, base seed and Δ values are not here: they are traced arguments.
    """

    configs: tuple
    workload: SinkWorkload
    implementation: str
    expected_mse: bool
    micro_batch: int = 1
    sampled_mse: bool = True


def chunk_shape(spec: SweepSpec, n: int) -> ChunkShape:
    """The :class:`ChunkShape` of ``spec``'s chunks at KV length ``n``."""
    return ChunkShape(configs=tuple(spec.configs), workload=spec.workload(n), implementation=spec.implementation,
                      expected_mse=spec.expected_mse, micro_batch=spec.micro_batch, sampled_mse=spec.sampled_mse)


def config_groups(shape: ChunkShape) -> tuple[ChunkShape, ...]:
    """``shape`` split into consecutive groups of at most
    :data:`~pcast_jax.sweep.spec.CONFIG_GROUP` configs, in order."""
    configs = shape.configs
    return tuple(dataclasses.replace(shape, configs=configs[i:i + CONFIG_GROUP])
                 for i in range(0, len(configs), CONFIG_GROUP))


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


def _per_seed(shape: ChunkShape, base_seed, deltas):
    """seed → metric → (D, n_configs): one draw, every Δ through the same loop body."""
    w = shape.workload

    def per_seed(seed):
        base = make_instance(instance_key(base_seed, w.n, seed), w, 0.0, draw_v=shape.sampled_mse)

        impl = shape.implementation

        def per_delta(delta):
            inst = base._replace(scores=base.scores + jnp.where(base.is_sink, delta, 0.0))
            if w.sink_logit == "delta":  # the swept Δ is the learned sink's logit Δ_L
                inst = inst._replace(sink_logit=jnp.asarray(delta, jnp.float32))
            return metrics.evaluate(inst, shape.configs, implementation=impl, sigma_v=w.sigma_v,
                                    expected=shape.expected_mse, sampled=shape.sampled_mse)

        return _loop_map(per_delta, deltas)

    return per_seed


@partial(jax.jit, static_argnames=("shape", "n_shards"))
def chunk_metrics(seed_idx, deltas, base_seed, *, shape: ChunkShape, n_shards: int = 1):
    """(C,) seeds × (D,) deltas → metric → (C, D, n_configs). One draw per seed, shared by every Δ.

    Args:
      seed_idx: (C,) uint32 seed indices (``seed_offset`` already added); C a multiple of
        ``n_shards · shape.micro_batch`` (:func:`chunk_args` pads it).
      deltas: (D,) float32 Δ values.
      base_seed: int32 scalar, the sweep's root seed.
      shape: the static part (:func:`chunk_shape`).
      n_shards: rows the seed axis is split into (one per device of a sharded ``seed_idx``).

    With ``micro_batch`` = 1 every (seed, Δ) instance is computed by the same compiled loop body:
    a loop over Δ inside a loop over seeds (:func:`_loop_map`). XLA:CPU's code for reductions,
    divisions and exponentials depends on array shapes and on what gets fused, so a vmap over a
    batch whose size follows the chunk size or the device count would change low-order bits. With
    ``micro_batch`` = M > 1 the loop over seeds steps through vmapped groups of exactly M seeds,
    so the batched body has one shape whatever the chunking and the trip count drops M-fold. Only
    the shard axis is vmapped on top, so each device loops over its own seeds.
    """
    per_seed = _per_seed(shape, base_seed, deltas)
    m = shape.micro_batch
    if m == 1:  # one seed per trip
        out = jax.vmap(lambda row: _loop_map(per_seed, row))(seed_idx.reshape(n_shards, -1))
        return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), out)
    rows = seed_idx.reshape(n_shards, -1, m)  # (shards, groups, M): one group of M seeds per trip
    out = jax.vmap(lambda row: _loop_map(jax.vmap(per_seed), row))(rows)
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[3:]), out)


def chunk_args(spec: SweepSpec, seed_start: int, seed_stop: int, n_shards: int) -> np.ndarray:
    """Seed indices of seeds [seed_start, seed_stop), padded to a multiple of ``n_shards · micro_batch``."""
    count = seed_stop - seed_start
    step = n_shards * spec.micro_batch
    return seed_indices(spec, seed_start, seed_stop, -(-count // step) * step)


def compute_chunk(spec: SweepSpec, n: int, seed_start: int, seed_stop: int, delta_idx=None,
                  devices=None) -> dict[str, np.ndarray]:
    """Metrics for seeds [seed_start, seed_stop) × the deltas ``delta_idx`` (default all) of N = n.

    The seed axis is sharded over ``devices`` (default all ``jax.devices()``), padded to a multiple
    of their count times ``spec.micro_batch``.

    Returns:
      metric → array of shape (seed_stop − seed_start, len(delta_idx), len(configs)).
    """
    devices = list(devices or jax.devices())
    count = seed_stop - seed_start
    seeds = chunk_args(spec, seed_start, seed_stop, len(devices))
    didx = np.arange(len(spec.deltas)) if delta_idx is None else np.asarray(delta_idx)
    deltas = np.asarray(spec.deltas, np.float32)[didx]
    base_seed = np.int32(spec.base_seed)
    if len(devices) > 1:
        mesh = Mesh(np.asarray(devices), ("i",))
        seeds = jax.device_put(seeds, NamedSharding(mesh, PartitionSpec("i")))
        deltas = jax.device_put(deltas, NamedSharding(mesh, PartitionSpec()))
        base_seed = jax.device_put(base_seed, NamedSharding(mesh, PartitionSpec()))
    outs = [chunk_metrics(seeds, deltas, base_seed, shape=g, n_shards=len(devices))
            for g in config_groups(chunk_shape(spec, n))]
    return {k: np.concatenate([np.asarray(o[k])[:count] for o in outs], axis=-1) for k in outs[0]}


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
    return jax.jit(chunk_metrics, static_argnames=("shape", "n_shards"), out_shardings=rows)


@lru_cache(maxsize=8)
def _concat_fn(mesh: Mesh):
    """The groups' metrics concatenated along the config axis, rows kept where they are."""
    rows = NamedSharding(mesh, PartitionSpec("i"))
    return jax.jit(lambda *parts: jnp.concatenate(parts, axis=-1), out_shardings=rows)


def start_global_call(spec: SweepSpec, n: int, seeds: np.ndarray, deltas: np.ndarray, mesh: Mesh) -> dict:
    """Dispatch one chunk computation over ``mesh`` (every process calls it with the same arguments).

    Args:
      spec: the sweep.
      n: KV length.
      seeds: the global seed-index vector (length a multiple of the mesh size times
        ``spec.micro_batch``), sharded by rows.
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
    base = np.int32(spec.base_seed)
    base_g = jax.make_array_from_callback((), replicated, lambda idx: base)
    fn = _sharded_chunk_fn(mesh)
    outs = [fn(seeds_g, deltas_g, base_g, shape=g, n_shards=mesh.size) for g in config_groups(chunk_shape(spec, n))]
    if len(outs) == 1:
        return outs[0]
    return {k: _concat_fn(mesh)(*(o[k] for o in outs)) for k in outs[0]}


def local_rows(arr: jax.Array, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of the row-sharded global ``arr``; they must lie on this process's devices."""
    pieces = {}
    for shard in arr.addressable_shards:
        first = shard.index[0].start or 0
        block = np.asarray(shard.data)
        for k in range(block.shape[0]):
            pieces[first + k] = block[k]
    return np.stack([pieces[r] for r in range(start, stop)])
