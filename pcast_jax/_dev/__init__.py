"""Checks of the code's own shape, run by the tests (not part of the public API)."""
