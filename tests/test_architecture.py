"""The code's shape: no import cycle, no import running back up the layers ARCHITECTURE.md draws, no long
module without its reason."""

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


#: Lines a library module may hold before it must say why at its top.
MAX_MODULE_LINES = 600
#: What a longer module's docstring states in its first lines, followed by the reason.
LONG_MODULE_REASON = "One module, over 600 lines:"


def unexplained_long_modules(root: pathlib.Path) -> list[str]:
    """Each module under ``root``'s pcast_jax/ and pallas_kernels/ over MAX_MODULE_LINES lines whose docstring
    does not state LONG_MODULE_REASON in its first 5 lines, as ``path (N lines)``."""
    import ast

    offenders = []
    for package in ("pcast_jax", "pallas_kernels"):
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            n = len(text.splitlines())
            if n <= MAX_MODULE_LINES:
                continue
            doc = ast.get_docstring(ast.parse(text)) or ""
            if not any(line.startswith(LONG_MODULE_REASON) for line in doc.splitlines()[:5]):
                offenders.append(f"{path.relative_to(root).as_posix()} ({n} lines)")
    return offenders


def test_every_module_over_600_lines_states_why_at_its_top():
    offenders = unexplained_long_modules(ROOT)
    assert not offenders, (f"over {MAX_MODULE_LINES} lines without {LONG_MODULE_REASON!r} <reason> in the "
                           f"docstring's first 5 lines (split along a seam, or say why not): {', '.join(offenders)}")


def test_the_length_check_sees_a_long_module_without_its_reason(tmp_path):
    (tmp_path / "pcast_jax" / "sub").mkdir(parents=True)
    (tmp_path / "pallas_kernels").mkdir()
    body = "x = 1\n" * MAX_MODULE_LINES
    (tmp_path / "pcast_jax" / "short.py").write_text('"""Short."""\n' + "x = 1\n" * (MAX_MODULE_LINES - 1))
    (tmp_path / "pcast_jax" / "sub" / "long.py").write_text('"""Long.\n\nNo reason."""\n' + body)
    (tmp_path / "pcast_jax" / "late.py").write_text(f'"""Late.\n\n\n\n\n{LONG_MODULE_REASON} too late."""\n' + body)
    (tmp_path / "pallas_kernels" / "kernel.py").write_text(body + "y = 2\n")  # one line over, no docstring
    (tmp_path / "pcast_jax" / "said.py").write_text(f'"""Said.\n\n{LONG_MODULE_REASON} a reason."""\n' + body)
    assert unexplained_long_modules(tmp_path) == [f"pcast_jax/late.py ({MAX_MODULE_LINES + 6} lines)",
                                                  f"pcast_jax/sub/long.py ({MAX_MODULE_LINES + 3} lines)",
                                                  f"pallas_kernels/kernel.py ({MAX_MODULE_LINES + 1} lines)"]


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
