"""The code's shape: no import cycle, no import running back up the layers ARCHITECTURE.md draws."""

import pathlib
import re

from pcast_jax._dev import imports

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_no_import_cycles_and_no_arrows_back_up():
    graph = imports.import_graph(ROOT)
    assert len(graph) > 50 and "pcast_jax.presets" in graph and "pallas_kernels.api" in graph
    assert imports.cycles(graph) == []
    assert imports.back_arrows(graph) == []


def test_the_checker_sees_a_cycle_and_a_back_arrow(tmp_path):
    pkg = tmp_path / "pcast_jax"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("def f():\n    from pcast_jax import presets\n")  # deferred: still an arrow
    (pkg / "presets.py").write_text("from pcast_jax.config import f\n")
    (pkg / "errors.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pcast_jax.config\n")
    graph = imports.import_graph(tmp_path)
    assert imports.cycles(graph) == [["pcast_jax.config", "pcast_jax.presets"]]
    assert imports.back_arrows(graph) == [("pcast_jax.config", "pcast_jax.presets")]
    assert graph["pcast_jax.errors"] == set()  # imports under TYPE_CHECKING never run


def test_no_module_uses_another_modules_private_names():
    assert imports.private_uses(ROOT) == []


def test_the_checker_sees_private_names_imported_or_read_from_another_module(tmp_path):
    pkg = tmp_path / "pcast_jax"
    (pkg / "sub").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "sub" / "__init__.py"):
        init.write_text("")
    (pkg / "engine.py").write_text("def _helper():\n    pass\n\ndef run():\n    return _helper()\n")
    (pkg / "sub" / "_options.py").write_text("def add():\n    pass\n")
    (pkg / "nn.py").write_text(
        "from pcast_jax.engine import _helper\n"  # reported: a private name imported
        "from pcast_jax import engine as _engine\n"  # a private alias of a public module: fine
        "from pcast_jax.sub import _options\n"  # a private module, not a name: fine
        "def f():\n"
        "    _engine._helper()\n"  # reported: a private name read off a module of ours
        "    _options.add()\n"
        "    return _engine.__name__, (1, 2)._replace\n"  # dunders and other objects' attributes: fine
    )
    assert imports.private_uses(tmp_path) == [("pcast_jax.nn", 1, "pcast_jax.engine._helper"),
                                              ("pcast_jax.nn", 5, "pcast_jax.engine._helper")]


def test_the_registry_owns_its_look_ups_and_config_needs_only_the_number_line():
    graph = imports.import_graph(ROOT)
    assert graph["pcast_jax.knob"] <= {"pcast_jax.numberline", "pcast_jax.errors"}  # how a field is declared
    assert graph["pcast_jax.config"] <= {"pcast_jax.numberline", "pcast_jax.errors", "pcast_jax.knob"}
    import pcast_jax.config as config
    import pcast_jax.presets as presets

    for name in ("get_preset", "preset_for", "resolve", "PRESETS"):
        assert hasattr(presets, name) and not hasattr(config, name), name
    assert "pcast_jax.models.llama_common" in graph["pcast_jax.models.hf_loader"]


def test_architecture_md_draws_the_layers_the_check_holds():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = re.search(r"```text layers\n(.*?)```", text, re.S)
    assert block, "ARCHITECTURE.md has no ```text layers block"
    drawn = [tuple(line.split(":", 1)[1].split()) for line in block.group(1).strip().splitlines()]
    assert drawn == [tuple(layer) for layer in imports.LAYERS]


def test_one_record_per_metric_feeds_the_metric_list_the_plot_flag_and_the_docs(capsys):
    import pytest

    from pcast_jax import cli, metrics, quantities

    assert metrics.METRICS == quantities.METRICS and metrics.QUANTITIES is quantities.QUANTITIES
    assert set(quantities.METRICS) == {k for k, q in quantities.QUANTITIES.items() if q.kind in ("metric", "input")}
    with pytest.raises(SystemExit):
        cli.main(["plot", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name in quantities.METRICS:
        assert name in help_text, name
    assert "quantities import QUANTITIES" in (ROOT / "docs" / "_ext" / "generate_pages.py").read_text()


def test_a_zeroed_fraction_has_one_name_per_pooling():
    """``frac_zeroed`` pools the counts over the rows in a sweep and in the trace analysis alike; the analysis's
    mean of per-row fractions has a name and a record of its own, and every fraction a head or decode view
    reports is registered."""
    from pcast_jax.analysis import HEAD_METRICS
    from pcast_jax.models.fp8_study import DECODE_METRICS
    from pcast_jax.quantities import METRICS, QUANTITIES

    for name in (*HEAD_METRICS, *DECODE_METRICS):
        if name.startswith("frac_"):
            assert name in QUANTITIES, name
    assert {"frac_zeroed", "frac_zeroed_row_mean"} <= set(HEAD_METRICS)
    assert "pooled over the query rows" in QUANTITIES["frac_zeroed"].description
    assert QUANTITIES["frac_zeroed_row_mean"].kind == "analysis" and "frac_zeroed_row_mean" not in METRICS
