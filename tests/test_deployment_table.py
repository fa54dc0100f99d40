"""The deployment table as data: importable without JAX, keyed by all four of engine, backend, GPU and KV-cache
dtype, and the source of ``pcast doctor``'s help lists."""

import json
import re
import subprocess
import sys

import pytest

from pcast_jax import cli, deployment_table, deployments
from pcast_jax.errors import PcastError

_ROWS = deployment_table.DEPLOYMENTS + deployment_table.MODEL_DTYPE_ROWS


def test_the_table_imports_no_jax():
    """A fresh process (this one has JAX loaded already) imports the table and looks a row up without JAX."""
    probe = ("import sys\nfrom pcast_jax import deployment_table as t\n"
             "t.find('vllm', 'triton_attn', 'sm90', 'auto')\n"
             "print('LOADED=' + ','.join(m for m in ('jax', 'jaxlib') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED=\n" in proc.stdout, proc.stdout


def test_deployments_reexports_every_name_of_the_table():
    """Users' code imports the table's names from ``pcast_jax.deployments``: the same objects."""
    for name in deployment_table.__all__:
        assert getattr(deployments, name) is getattr(deployment_table, name), name
        assert name in deployments.__all__, name


def test_every_key_names_one_row():
    """(engine, backend, GPU, KV-cache dtype) picks at most one row, and ``find`` returns it."""
    keys = [(d.engine, d.backend, gpu, kv) for d in _ROWS for gpu in d.gpus for kv in d.kv_cache_dtypes]
    assert len(keys) == len(set(keys))
    for d in _ROWS:
        for gpu in d.gpus:
            for kv in d.kv_cache_dtypes:
                assert deployment_table.find(d.engine, d.backend, gpu, kv) is d


def test_the_kv_cache_dtype_picks_the_row():
    """An FP8 KV cache runs vLLM's FP8 path (Q quantized, P cast); the cache in the model dtype (``auto``)
    keeps Q out of FP8, so no P is cast; ``fp8`` and ``fp8_e4m3`` name the same E4M3 cache."""
    fp8 = deployment_table.find("vllm", "triton_attn", "sm90", "fp8")
    assert fp8.presets == ("vllm_triton_fp8", "vllm_triton_fp8_3d") and fp8.casts_p
    assert deployment_table.find("vllm", "triton_attn", "sm90", "fp8_e4m3") is fp8
    auto = deployment_table.find("vllm", "triton_attn", "sm90", "auto")
    assert not auto.casts_p and auto.knob == "none" and auto.kv_cache_dtypes == ("auto",)
    assert auto.capabilities == fp8.capabilities and "query_quant" in auto.selection
    assert not deployment_table.find("sglang", "fa3", "sm90", "auto").casts_p
    assert deployment_table.find("sglang", "fa3", "sm90", "fp8").presets == ("fa3", "fa3_splitkv")


@pytest.mark.parametrize("engine, backend, gpu", [("flash-attention", "fa3", "sm90"), ("vllm", "rocm_flash", "gfx942"),
                                                  ("tensorrt-llm", "xqa", "sm90")])
def test_a_model_dtype_cache_not_read_is_refused(engine, backend, gpu):
    with pytest.raises(PcastError, match=r"kv_cache_dtype='auto': .* known with 'fp8', 'fp8_e4m3' only"):
        deployment_table.find(engine, backend, gpu, "auto")


def test_model_dtype_entries_name_real_backends_and_cite_a_commit():
    for entry in deployment_table.MODEL_DTYPE_KV:
        assert re.search(r" at [0-9a-f]{7,40}\b", entry.selection), entry.selection
        for backend in entry.backends:
            assert any(d.engine == entry.engine and d.backend == backend for d in deployment_table.DEPLOYMENTS)
    with pytest.raises(PcastError, match="backend='xformers'.*triton_attn"):
        deployment_table.ModelDtypeKV(engine="vllm", backends=("xformers",), selection="x at 0000000", note="")


def test_doctor_with_a_model_dtype_cache_says_no_fp8_p(capsys):
    argv = ["doctor", "--engine", "vllm", "--backend", "flash_attn", "--gpu", "sm90", "--kv-cache-dtype", "auto"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "with KV cache auto runs: no FP8 P-cast" in out and "Verdict: no FP8 P" in out
    assert cli.main([*argv, "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["rows"] == [] and got["safe"] is True and got["presets"] == []
    assert got["kv_cache_dtypes"] == ["auto"]
    assert cli.main(["doctor", "--engine", "flash-attention", "--backend", "fa3", "--gpu", "sm90",
                     "--kv-cache-dtype", "auto"]) == 2
    assert "kv_cache_dtype='auto'" in capsys.readouterr().err


def test_doctor_help_names_every_rows_values(capsys, monkeypatch):
    """The help lists come from the table: every engine, backend, GPU and KV-cache dtype a row holds is named
    (the words are compared with the help's line breaks removed)."""
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    words = set(re.findall(r"[\w.-]+", text))
    for d in _ROWS:
        assert {d.engine, d.backend, *d.gpus, *d.kv_cache_dtypes} <= words, d
    for engine, backends in deployment_table.BACKENDS.items():
        assert f"{engine}: {', '.join(backends)}" in text
