"""pcast_jax: FP8 attention P-cast precision — theory, kernel-faithful simulator, sweeps."""

__version__ = "0.1.0"
