"""``pcast plot`` and :func:`pcast_jax.report.sweep_figure`: formats, axes, labels, facets."""

import numpy as np
import pytest

from pcast_jax import cli, report
from pcast_jax.errors import PcastError
from pcast_jax.sweep import SweepSpec, load_result, run_sweep

MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-", "svg": b"<?xml"}


@pytest.fixture(scope="module")
def grid_sweep(tmp_path_factory):
    """A tiny sweep over three N and two Δ: every coordinate has several values."""
    out = tmp_path_factory.mktemp("plot") / "sweep"
    spec = SweepSpec(configs=("fwd_s1", "rev_s256", "fwd_s256"), deltas=(5.0, 7.0), ns=(32, 64, 128), seeds=2,
                     q_len=2, d=4)
    run_sweep(spec, out_dir=out, progress=False)
    return out


@pytest.fixture(scope="module")
def one_delta_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("plot1") / "sweep"
    run_sweep(SweepSpec(configs=("fwd_s1",), deltas=(7.0,), ns=(32, 64), seeds=2, q_len=2, d=4), out_dir=out,
              progress=False)
    return out


@pytest.mark.parametrize("fmt", ["png", "pdf", "svg"])
def test_plot_writes_each_format(grid_sweep, tmp_path, fmt, capsys):
    out = tmp_path / f"fig.{fmt}"
    assert cli.main(["plot", str(grid_sweep), "--x", "n", "--out", str(out)]) == 0
    data = out.read_bytes()
    assert len(data) > 1000 and data.startswith(MAGIC[fmt])
    if fmt == "svg":
        assert b"<svg" in data[:2000]
    assert f"wrote {out}" in capsys.readouterr().out


def test_plot_refuses_other_formats(grid_sweep, tmp_path, capsys):
    for name in ("fig.jpg", "fig", "fig.eps"):
        assert cli.main(["plot", str(grid_sweep), "--out", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("pcast: error:") and "--out" in err and ".pdf" in err
        assert not (tmp_path / name).exists()


def test_sizes_get_a_log_axis_with_an_override(grid_sweep):
    result = load_result(grid_sweep)
    ax = report.sweep_figure(result, x="n").axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert report.sweep_figure(result, x="n", log_x=False).axes[0].get_xscale() == "linear"
    assert report.sweep_figure(result, x="delta").axes[0].get_xscale() == "linear"
    assert report.sweep_figure(result, x="delta", log_x=True).axes[0].get_xscale() == "log"


def test_labels_carry_long_names_and_units(grid_sweep):
    ax = report.sweep_figure(load_result(grid_sweep), x="n", y="mse").axes[0]
    assert ax.get_ylabel() == "output MSE vs FP32 reference [V²]"
    assert ax.get_xlabel() == "KV length N [keys]"
    ax = report.sweep_figure(load_result(grid_sweep), x="delta", y="frac_zeroed").axes[0]
    assert ax.get_xlabel() == "sink strength Δ [nats]" and "fraction of non-sink P" in ax.get_ylabel()


def test_col_facets_and_hue_colours(grid_sweep):
    result = load_result(grid_sweep)
    fig = report.sweep_figure(result, x="delta", col="n", hue="config")
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 3 and [ax.get_title() for ax in panels] == ["N = 32", "N = 64", "N = 128"]
    assert all(len(ax.get_lines()) == 3 for ax in panels)  # one line per config in each panel
    fig = report.sweep_figure(result, x="delta", hue="n", col="config")
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 3 and panels[0].get_title() == "fwd_s1"
    colours = {tuple(line.get_color()) for line in panels[0].get_lines()}
    assert len(colours) == 3  # one colour per N
    with pytest.raises(PcastError, match="different coordinates"):
        report.sweep_figure(result, x="n", hue="n")


def test_plot_cli_facets(grid_sweep, tmp_path):
    out = tmp_path / "facets.svg"
    assert cli.main(["plot", str(grid_sweep), "--x", "delta", "--col", "config", "--hue", "n", "--y", "frac_zeroed",
                     "--out", str(out)]) == 0
    assert out.read_bytes().count(b'id="axes_') == 3
    assert cli.main(["plot", str(grid_sweep), "--x", "n", "--hue", "n", "--out", str(tmp_path / "x.png")]) == 2


def test_fwd_and_rev_s256_are_both_visible(grid_sweep):
    ax = report.sweep_figure(load_result(grid_sweep), x="n", col="delta").axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    fwd, rev = lines["fwd_s256"], lines["rev_s256"]
    assert fwd.get_linestyle() != rev.get_linestyle() and fwd.get_marker() != rev.get_marker()
    assert fwd.get_zorder() > rev.get_zorder() and fwd.get_linewidth() < rev.get_linewidth()


def test_title_fits_the_figure(grid_sweep):
    fig = report.sweep_figure(load_result(grid_sweep), x="n", configs=["fwd_s1"])
    fig.canvas.draw()
    title = fig._suptitle
    box = title.get_window_extent(fig.canvas.get_renderer())
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width


def test_one_value_x_is_refused_with_a_hint(one_delta_sweep, capsys):
    with pytest.raises(PcastError, match="one delta value .*try --x n"):
        report.sweep_figure(load_result(one_delta_sweep), x="delta")
    assert cli.main(["plot", str(one_delta_sweep), "--x", "delta"]) == 2
    assert "try --x n" in capsys.readouterr().err
    assert cli.main(["plot", str(one_delta_sweep), "--x", "n"]) == 0
    assert np.isfinite(load_result(one_delta_sweep).data["mse"]).all()
