"""Kernels from the command line, results as data, one flag vocabulary, whatif progress, figures."""

import csv
import dataclasses
import io
import json
import sys

import numpy as np
import pytest

from pcast_jax import cli, report
from pcast_jax.commands import _options
from pcast_jax.config import KernelConfig
from pcast_jax.errors import PcastError
from pcast_jax.presets import PRESETS
from pcast_jax.sweep import SweepSpec, load_result
from pcast_jax.sweep.spec import FORMAT_VERSION

# --------------------------------------------------------------------------------------------
# KernelConfig.from_string / to_string
# --------------------------------------------------------------------------------------------


def test_from_string_reads_the_issue_example():
    cfg = KernelConfig.from_string("name=mine,order=reverse,scale=64,block_kv=128,accumulator=f16")
    assert cfg == KernelConfig(order="reverse", scale=64.0, block_kv=128, accumulator="f16")
    assert cfg.name == "mine" and isinstance(cfg.scale, float) and isinstance(cfg.block_kv, int)
    assert KernelConfig.from_string(" qkv = e4m3 , qkv_granularity=head, causal ") == KernelConfig(
        qkv="e4m3", qkv_granularity="head", causal=True)
    assert KernelConfig.from_string("causal=no").causal is False
    assert KernelConfig.from_string("scale=2^8").scale == 256.0
    assert KernelConfig.from_string("scale=2**-3").scale == 0.125


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_to_string_round_trips_every_preset(name):
    cfg = PRESETS[name]
    back = KernelConfig.from_string(cfg.to_string())
    assert back == cfg and back.name == cfg.name


def test_to_string_round_trips_a_config_with_every_field_changed():
    cfg = KernelConfig(order="reverse", scale=2.0**8.807, scale_mode="exponent", block_kv=128, p_format="e5m2",
                       overflow="nan", accumulator="f16", qkv="e4m3", qkv_granularity="head", causal=True,
                       kv_splits=4, split_layout="strided", f16_round_keys=32, v_channel_max=2.25, name="all")
    text = cfg.to_string()
    back = KernelConfig.from_string(text)
    assert back == cfg and back.name == "all" and back.scale == cfg.scale  # exact float round trip
    assert text.startswith("name=all,") and "causal=true" in text


def test_derived_names_spell_the_order_as_the_presets_do():
    assert KernelConfig(scale=256.0).name == "fwd_s256" == PRESETS["fwd_s256"].name
    assert KernelConfig(order="reverse", scale=256.0).name == "rev_s256" == PRESETS["rev_s256"].name
    assert KernelConfig(scale_mode="dynamic", accumulator="f16").name == "fwd_sdyn_f16acc"


#: Unnamed configs: each gets a name derived from its fields, spelled like the presets.
_UNNAMED = (KernelConfig(scale=64.0), KernelConfig(kv_splits=8, split_layout="strided"),
            KernelConfig(order="reverse", scale=256.0), KernelConfig(scale_mode="dynamic", accumulator="f16"))


def test_derived_names_are_written_and_read_back_as_they_are():
    spec = SweepSpec(configs=_UNNAMED, deltas=(7.0,), ns=(4096,), seeds=4)
    assert spec.config_names == ("fwd_s64", "fwd_s1_split8s", "rev_s256", "fwd_sdyn_f16acc")
    saved = spec.to_dict()
    assert [c["name"] for c in saved["configs"]] == list(spec.config_names)
    back = SweepSpec.from_dict(json.loads(json.dumps(saved)))
    assert back.config_names == spec.config_names and back.fingerprint() == spec.fingerprint()
    assert KernelConfig(scale=64.0, name="fwd_s64").to_dict()["name"] == "fwd_s64"
    for cfg in _UNNAMED:  # to_string leaves a derived name out: read back, it is derived again
        text = cfg.to_string()
        assert "name=" not in text and KernelConfig.from_string(text).to_dict() == cfg.to_dict()
    assert KernelConfig().to_string() == "order=forward" and KernelConfig.from_string("order=forward").name == "fwd_s1"


def test_a_folder_of_another_results_format_is_refused(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert cli.main(["sweep", "--config", "scale=64", "--config", "order=reverse", "--out", str(out), *TINY]) == 0
    assert load_result(out).spec.config_names == ("fwd_s64", "rev_s1")
    manifest = json.loads((out / "spec.json").read_text())
    manifest["format_version"] = 1
    (out / "spec.json").write_text(json.dumps(manifest))
    with pytest.raises(PcastError, match="format version 1.*results are recomputable: rerun"):
        load_result(out)
    capsys.readouterr()
    assert cli.main(["sweep", "--config", "scale=64", "--config", "order=reverse", "--out", str(out), *TINY]) == 2
    assert "results are recomputable" in capsys.readouterr().err


def _text(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(KernelConfig)])
def test_every_field_is_a_key(field):
    """Keys follow dataclasses.fields(KernelConfig): a field added later is reachable without a list."""
    default = getattr(KernelConfig(), field)
    cfg = KernelConfig.from_string(f"{field}={_text(default)}")
    assert getattr(cfg, field) == default


def test_a_new_field_is_parsed_to_its_type():
    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Extended(KernelConfig):
        extra_int: int = 3
        extra_flag: bool = False

    cfg = Extended.from_string("extra_int=7,extra_flag=yes,order=reverse")
    assert (cfg.extra_int, cfg.extra_flag, cfg.order) == (7, True, "reverse")
    assert "extra_int=7" in cfg.to_string() and "extra_flag=true" in cfg.to_string()


@pytest.mark.parametrize("text, key", [
    ("bogus=1", "'bogus'"), ("order=sideways", "order"), ("block_kv=1.5", "block_kv"),
    ("scale=abc", "scale"), ("causal=maybe", "causal"), ("order=reverse,order=forward", "'order'"),
    ("scale", "'scale'"), ("kv_splits=0", "kv_splits"), ("name=", "name"), ("order=reverse,,scale=2", "key=value"),
    ("", "key=value"),
])
def test_from_string_errors_name_the_key(text, key):
    with pytest.raises(PcastError, match=key):
        KernelConfig.from_string(text)


# --------------------------------------------------------------------------------------------
# Shared option parsers
# --------------------------------------------------------------------------------------------


def test_one_range_syntax():
    assert _options.floats("--delta", "4:6:0.5") == (4.0, 4.5, 5.0, 5.5, 6.0)
    assert _options.floats("--delta", "5,7") == (5.0, 7.0)
    assert _options.ints("--n", "1024:4096:1024") == (1024, 2048, 3072, 4096)
    assert _options.ints("--n", "300") == (300,)
    assert _options.interval("--delta-range", "4:13") == (4.0, 13.0)
    for bad in ("4,13", "13:4", "4:5:6"):
        with pytest.raises(PcastError, match="--delta-range"):
            _options.interval("--delta-range", bad)
    with pytest.raises(PcastError, match="--n"):
        _options.ints("--n", "1:9:0")


def test_config_file_reads_kernel_tables(tmp_path):
    path = tmp_path / "k.toml"
    path.write_text('[[kernel]]\nname = "a"\norder = "reverse"\nscale = 64\n\n'
                    '[[kernel]]\nname = "b"\nqkv = "e4m3"\ncausal = true\n')
    a, b = _options.config_file(path)
    assert (a.name, a.order, a.scale) == ("a", "reverse", 64.0)
    assert (b.name, b.qkv, b.causal) == ("b", "e4m3", True)
    path.write_text('[[kernel]]\nname = "a"\nblock = 3\n')
    with pytest.raises(PcastError, match="'block'"):
        _options.config_file(path)
    path.write_text('name = "a"\n')
    with pytest.raises(PcastError, match=r"\[\[kernel\]\]"):
        _options.config_file(path)


# --------------------------------------------------------------------------------------------
# pcast sweep with kernels of one's own, --metrics, --format
# --------------------------------------------------------------------------------------------

TINY = ["--n", "64", "--seeds", "2", "--q-len", "2", "--d", "4", "--delta", "5:7:2", "--no-progress"]


@pytest.fixture(scope="module")
def mixed_sweep(tmp_path_factory):
    """One tiny sweep mixing a preset, a --config kernel and a --config-file kernel."""
    tmp = tmp_path_factory.mktemp("mixed")
    toml = tmp / "kernels.toml"
    toml.write_text('[[kernel]]\nname = "filed"\nqkv = "e4m3"\ncausal = true\n')
    out = tmp / "sweep"
    args = ["sweep", "--configs", "fwd_s1", "--config", "name=mine,order=reverse,scale=64,block_kv=128,accumulator=f16",
            "--config-file", str(toml), "--out", str(out), *TINY]
    assert cli.main(args) == 0
    return out


def test_sweep_runs_kernels_from_the_command_line(mixed_sweep):
    spec = json.loads((mixed_sweep / "spec.json").read_text())["spec"]
    cfgs = [KernelConfig.from_dict(c) for c in spec["configs"]]
    assert [c.name for c in cfgs] == ["fwd_s1", "mine", "filed"]
    assert cfgs[1] == KernelConfig(order="reverse", scale=64.0, block_kv=128, accumulator="f16")
    assert cfgs[2].qkv == "e4m3" and cfgs[2].causal


def test_sweep_refuses_duplicate_names_and_bad_kernels(tmp_path, capsys):
    for extra in (["--configs", "fwd_s1", "--config", "name=fwd_s1,scale=2"],
                  ["--config", "order=reverse,order=forward"], ["--config", "fwd_s1,rev_s1"],
                  ["--config-file", str(tmp_path / "none.toml")], ["--metrics", "mse,bogus"]):
        assert cli.main(["sweep", *TINY, "--out", str(tmp_path / "o"), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("pcast: error:") and "\n" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt", ["csv", "json", "md", "table"])
def test_sweep_formats(mixed_sweep, capsys, fmt):
    """Rerunning into the finished folder only reads it back; the output is in the asked format."""
    assert cli.main(["sweep", "--configs", "fwd_s1", "--config",
                     "name=mine,order=reverse,scale=64,block_kv=128,accumulator=f16",
                     "--config-file", str(mixed_sweep.parent / "kernels.toml"), "--out", str(mixed_sweep), *TINY,
                     "--metrics", "mse,frac_zeroed", "--format", fmt]) == 0
    out = capsys.readouterr().out
    result = load_result(mixed_sweep)
    want = float(np.mean(result.get("frac_zeroed", config="fwd_s1", n=64, delta=7.0).astype(np.float64)))
    if fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(out)))
        assert list(rows[0]) == ["n", "config", "delta", "seeds", "mse_mean", "mse_sem", "frac_zeroed_mean",
                                 "frac_zeroed_sem"]
        assert len(rows) == 6
        row = next(r for r in rows if r["config"] == "fwd_s1" and float(r["delta"]) == 7.0)
        assert float(row["frac_zeroed_mean"]) == pytest.approx(want)  # a fraction, not percent
    elif fmt == "json":
        rows = json.loads(out)
        assert len(rows) == 6 and set(rows[0]) >= {"mse_mean", "frac_zeroed_sem"}
        assert "nonsink_mass_mean" not in rows[0]
    elif fmt == "md":
        lines = out.strip().splitlines()
        assert lines[0].startswith("| N | config |") and len(lines) == 8
    else:
        assert "frac. zeroed %" in out and "non-sink" not in out


def test_a_refused_out_folder_never_says_resuming(mixed_sweep, capsys):
    """A folder holding another sweep is refused before the banner could say it resumes."""
    before = sorted(p.name for p in mixed_sweep.iterdir())
    assert cli.main(["sweep", "--configs", "rev_s1", "--out", str(mixed_sweep), *TINY]) == 2
    cap = capsys.readouterr()
    assert "resuming" not in cap.out + cap.err and "pcast sweep:" not in cap.out
    assert cap.err.startswith("pcast: error:") and "holds a different sweep" in cap.err
    assert sorted(p.name for p in mixed_sweep.iterdir()) == before


# --------------------------------------------------------------------------------------------
# Results as data
# --------------------------------------------------------------------------------------------


def test_fingerprint_is_unchanged():
    assert SweepSpec(deltas=(7.0,), ns=(4096,), seeds=4).fingerprint() == "109b3b7528d3467c"


def test_to_dataframe_is_long_format(mixed_sweep):
    result = load_result(mixed_sweep)
    df = result.to_dataframe()
    assert len(df) == 1 * 3 * 2 * 2
    for col in ("n", "config", "delta", "seed", "mse", "mse_expected", "frac_zeroed", "zeroed_mass",
                "nonsink_mass", "q_len", "d", "k_sink", "sigma", "sigma_v"):
        assert col in df.columns, col
    row = df[(df["config"] == "mine") & (df["delta"] == 7.0) & (df["seed"] == 1)]
    assert len(row) == 1
    assert row["mse"].item() == result.get("mse", config="mine", n=64, delta=7.0)[1]
    assert (df["q_len"] == 2).all() and (df["d"] == 4).all()


def test_to_xarray_has_labelled_coordinates(mixed_sweep):
    result = load_result(mixed_sweep)
    ds = result.to_xarray()
    assert list(ds["mse"].dims) == ["n", "config", "delta", "seed"]
    assert list(ds["config"].values) == ["fwd_s1", "mine", "filed"]
    got = ds["frac_zeroed"].sel(config="filed", delta=5.0, n=64).values
    np.testing.assert_array_equal(got, result.get("frac_zeroed", config="filed", n=64, delta=5.0))
    assert KernelConfig.from_string(str(ds["config_spec"].sel(config="mine").item())).block_kv == 128
    assert ds.attrs["q_len"] == 2 and ds.attrs["fingerprint"] == result.spec.fingerprint()


def test_to_xarray_describes_every_variable_and_coordinate(mixed_sweep):
    from pcast_jax.metrics import QUANTITIES

    ds = load_result(mixed_sweep).to_xarray()
    for name in [*ds.data_vars, *ds.coords]:
        attrs = ds[name].attrs
        assert attrs["long_name"] and attrs["description"] == QUANTITIES[name].description, name
        if ds[name].dtype.kind in "fiu":  # a number has a unit; a string label has none
            assert attrs["units"], name
    assert ds["mse"].attrs["units"] == "V²" and ds["frac_zeroed"].attrs["units"] == "1"
    assert ds["delta"].attrs["units"] == "nats" and ds["n"].attrs["units"] == "keys"
    assert "units" not in ds["config"].attrs
    # flags are booleans, the sink positions the keys that are sinks (k_sink = 4 by default)
    assert ds.attrs["expected_mse"] is True and ds.attrs["sampled_mse"] is True
    assert ds.attrs["sink_positions"].dtype == np.int64 and ds.attrs["sink_positions"].tolist() == [0, 1, 2, 3]
    assert ds.attrs["jax_version"] and ds.attrs["format_version"] == FORMAT_VERSION


def test_to_dataframe_attrs_describe_the_columns(mixed_sweep):
    from pcast_jax.metrics import axis_label, describe

    df = load_result(mixed_sweep).to_dataframe()
    assert df.attrs["variables"]["mse"] == describe("mse") and df.attrs["variables"]["mse"]["units"] == "V²"
    assert set(df.attrs["variables"]) >= {"n", "config", "delta", "seed", "mse", "frac_zeroed"}
    assert df.attrs["sampled_mse"] is True and df.attrs["fingerprint"] == load_result(mixed_sweep).spec.fingerprint()
    assert (df["sink_positions"] == "0 1 2 3").all()
    assert describe("mse_sem")["units"] == "V²" and "standard error" in describe("mse_sem")["long_name"]
    assert axis_label("mse") == "output MSE vs FP32 reference [V²]"
    with pytest.raises(PcastError, match="not a sweep metric"):
        describe("bogus")


def test_results_without_every_metric_or_their_fingerprint_are_refused(mixed_sweep, tmp_path):
    """A results.npz that lacks a metric or its fingerprint is not this sweep's: refused, named."""
    import shutil

    out = tmp_path / "partial"
    shutil.copytree(mixed_sweep, out)
    with np.load(out / "results.npz") as z:
        entries = {k: z[k] for k in z.files}
    for drop in ("saturated_mass", "fingerprint"):
        with open(out / "results.npz", "wb") as f:
            np.savez(f, **{k: v for k, v in entries.items() if k != drop})
        with pytest.raises(PcastError, match="results.npz"):
            load_result(out)


def test_missing_data_extra_names_it(mixed_sweep, monkeypatch):
    result = load_result(mixed_sweep)
    monkeypatch.setitem(sys.modules, "pandas", None)
    monkeypatch.setitem(sys.modules, "xarray", None)
    with pytest.raises(PcastError, match=r"pcast_jax\[data\]"):
        result.to_dataframe()
    with pytest.raises(PcastError, match=r"pcast_jax\[data\]"):
        result.to_xarray()


def test_results_npz_stores_its_coordinates(mixed_sweep, tmp_path):
    import shutil

    with np.load(mixed_sweep / "results.npz") as z:
        entries = {k: z[k] for k in z.files}
    assert entries["coord_n"].tolist() == [64]
    assert entries["coord_config"].tolist() == ["fwd_s1", "mine", "filed"]
    assert entries["coord_delta"].tolist() == [5.0, 7.0]
    assert entries["coord_seed"].tolist() == [0, 1]
    # a results.npz whose coordinates disagree with spec.json is refused
    out = tmp_path / "copy"
    shutil.copytree(mixed_sweep, out)
    with open(out / "results.npz", "wb") as f:
        np.savez(f, **{**entries, "coord_delta": np.array([5.0, 9.0])})
    with pytest.raises(PcastError, match="coordinate 'delta'"):
        load_result(out)
    # files written before the coordinates existed still load
    with open(out / "results.npz", "wb") as f:
        np.savez(f, **{k: v for k, v in entries.items() if not k.startswith("coord_")})
    assert load_result(out).spec.config_names == ("fwd_s1", "mine", "filed")


def test_summary_csv_carries_the_workload(mixed_sweep):
    with open(mixed_sweep / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6
    for col in ("q_len", "d", "k_sink", "sink_positions", "sigma", "sigma_v", "base_seed", "implementation"):
        assert col in rows[0], col
    assert rows[0]["q_len"] == "2" and rows[0]["d"] == "4"


def test_plot_writes_a_png(mixed_sweep, tmp_path, capsys):
    out = tmp_path / "mse.png"
    assert cli.main(["plot", str(mixed_sweep), "--x", "delta", "--y", "mse", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["plot", str(mixed_sweep), "--x", "delta", "--y", "frac_zeroed", "--configs", "mine"]) == 0
    assert (mixed_sweep / "plot_frac_zeroed_vs_delta.png").exists()
    capsys.readouterr()
    assert cli.main(["plot", str(mixed_sweep), "--x", "n"]) == 2  # one N: no line to draw against it
    assert "one n value (64)" in capsys.readouterr().err
    for bad in (["--y", "bogus"], ["--configs", "fa3"], ["--out", str(tmp_path / "x.jpg")]):
        assert cli.main(["plot", str(mixed_sweep), *bad]) == 2
        assert capsys.readouterr().err.startswith("pcast: error:")
    assert cli.main(["plot", str(tmp_path)]) == 2


# --------------------------------------------------------------------------------------------
# presets --show, --version, renamed flags
# --------------------------------------------------------------------------------------------


def test_presets_show_prints_the_config_form(capsys):
    assert cli.main(["presets", "--show", "sageattn2pp"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    cfg = KernelConfig.from_string(first)
    assert cfg == PRESETS["sageattn2pp"] and cfg.name == "sageattn2pp"
    assert cli.main(["presets", "--show", "fa9"]) == 2


def test_presets_show_at_a_head_dim_prints_the_tile_that_runs(capsys):
    assert cli.main(["presets", "--show", "fa3", "--head-dim", "32"]) == 0
    out = capsys.readouterr().out
    cfg = KernelConfig.from_string(out.splitlines()[0])
    # FA3's FP8 tile at d <= 64 is 160 (hopper/tile_size.h), not the 224 it runs at d = 128
    assert cfg.block_kv == 160 and cfg.name == "fa3" and "runs block_kv = 160" in out
    assert cli.main(["presets", "--head-dim", "32"]) == 2
    assert cli.main(["presets", "--show", "fa3", "--head-dim", "0"]) == 2


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("pcast ") and "jax " in out


@pytest.mark.parametrize("argv, new", [
    (["whatif", "dynamic", "--deltas", "4:5:1"], "use --delta"),
    (["whatif", "dynamic", "--ns", "1024"], "use --n"),
    (["whatif", "dynamic", "--statics", "fwd_s256"], "use --configs"),
    (["whatif", "calibrate", "--deltas", "4:13:1"], "use --delta"),
    (["whatif", "worst-delta", "--range", "4,13"], "use --delta-range"),
])
def test_old_spellings_are_refused_with_a_hint(argv, new, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("pcast: error: ") and new in err and err.count("\n") == 1


def _parse(argv):
    return cli.build_parser(argv).parse_args(argv)


def test_list_flags_take_comma_lists(capsys):
    args = _parse(["kernels", "--configs", "fa3,fwd_s1", "--backends", "triton,mosaic", "--num-warps", "4,8",
                   "--num-stages", "2,3"])
    assert (args.configs, args.backends, args.num_warps, args.num_stages) == (
        ["fa3", "fwd_s1"], ["triton", "mosaic"], [4, 8], [2, 3])
    assert capsys.readouterr().err == ""
    args = _parse(["kernels"])
    assert (args.configs, args.backends, args.num_warps) == (["fa3", "fwd_s1"], ["triton", "mosaic"], [None])


def test_space_separated_lists_are_refused_with_the_comma_spelling(capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(["kernels", "--configs", "fa3", "fwd_s1"])
    assert exc.value.code == 2
    assert "--configs fa3,fwd_s1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, option", [
    (["kernels", "--backends", "triton,cuda"], "--backends"), (["kernels", "--num-warps", "4,x"], "--num-warps"),
    (["kernels", "--configs", "fa3,,fwd_s1"], "--configs"),
])
def test_bad_list_items_are_refused_naming_the_flag(argv, option, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("pcast") and "error" in err and option in err and err.count("\n") == 1


def test_list_flags_show_one_metavar_in_the_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["kernels", "--help"])
    out = capsys.readouterr().out
    assert "--configs PRESET[,PRESET]" in out and "[PRESET[,PRESET] ...]" not in out


LONG_RUNNING = [["sweep"], ["whatif", "worst-delta"], ["whatif", "calibrate"], ["whatif", "dynamic"],
                ["whatif", "report"], ["analyze", "t.npz"], ["model-report"], ["reproduce"]]


@pytest.mark.parametrize("command", LONG_RUNNING, ids=" ".join)
def test_one_progress_flag(command, capsys):
    assert _parse(command).progress is None  # the default: decided by the terminal
    assert _parse([*command, "--progress"]).progress is True
    assert _parse([*command, "--no-progress"]).progress is False
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command", [["analyze", "t.npz"], ["model-report"]], ids=" ".join)
def test_quiet_is_not_a_flag(command, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse([*command, "--quiet"])
    assert exc.value.code == 2 and "--quiet" in capsys.readouterr().err


def test_kernels_json_is_format_json(capsys):
    assert _parse(["kernels"]).format == "table"
    assert _parse(["kernels", "--format", "json"]).format == "json"
    with pytest.raises(SystemExit) as exc:
        _parse(["kernels", "--json"])
    assert exc.value.code == 2 and "use --format json" in capsys.readouterr().err


WORST = ["whatif", "worst-delta", "--configs", "fwd_s1", "--n", "256", "--q-len", "2", "--seeds", "2", "--steps", "3",
         "--delta-range", "4:10", "--no-progress"]


@pytest.fixture(scope="module")
def worst_rows():
    from pcast_jax import whatif

    r = whatif.worst_case_delta(PRESETS["fwd_s1"], 256, objective="total", delta_range=(4.0, 10.0), seeds=2,
                                q_len=2, steps=3, base_seed=0)
    return r.rows()


def test_whatif_format_csv_and_json_print_only_the_rows(capsys, worst_rows):
    assert cli.main([*WORST, "--format", "csv"]) == 0
    cap = capsys.readouterr()
    rows = list(csv.DictReader(io.StringIO(cap.out)))
    assert [r["config"] for r in rows] == ["fwd_s1"] and list(rows[0]) == list(worst_rows[0])
    assert float(rows[0]["worst_delta"]) == pytest.approx(worst_rows[0]["worst_delta"])
    assert " s)" in cap.err and "|" not in cap.out
    assert cli.main([*WORST, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc[0]["config"] == "fwd_s1" and doc[0]["worst_delta"] == pytest.approx(worst_rows[0]["worst_delta"])
    assert cli.main(WORST) == 0
    assert "| config |" in capsys.readouterr().out  # the default: the table


def test_whatif_out_file_and_the_old_csv_flag(tmp_path, capsys, worst_rows):
    assert cli.main([*WORST, "--out", str(tmp_path / "rows.json")]) == 0
    assert json.loads((tmp_path / "rows.json").read_text())[0]["config"] == "fwd_s1"
    assert f"wrote {tmp_path / 'rows.json'}" in capsys.readouterr().out
    assert cli.main([*WORST, "--out", str(tmp_path / "rows.csv")]) == 0
    assert (tmp_path / "rows.csv").read_text().startswith("config,")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        cli.main([*WORST, "--csv", str(tmp_path / "old.csv")])
    assert exc.value.code == 2 and "use --out FILE.csv" in capsys.readouterr().err
    assert not (tmp_path / "old.csv").exists()
    progress_on = [a for a in WORST if a != "--no-progress"]  # step lines would show any work begun
    assert cli.main([*progress_on, "--out", str(tmp_path / "rows.txt")]) == 2
    err = capsys.readouterr().err
    assert "--out=" in err and ".csv or .json" in err and "worst-delta fwd_s1" not in err
    assert not (tmp_path / "rows.txt").exists()


def test_whatif_subcommands_have_a_description(capsys):
    with pytest.raises(SystemExit):
        cli.main(["whatif", "dynamic", "--help"])
    out = capsys.readouterr().out
    assert "Dynamic per-block 2^k scale vs static 256 and 448." in out
    assert "--delta" in out and "--configs" in out and "--config-file" in out


# --------------------------------------------------------------------------------------------
# whatif progress
# --------------------------------------------------------------------------------------------


def test_progress_step_lines_and_bar():
    from pcast_jax.whatif import progress

    stream = io.StringIO()  # not a terminal: step lines
    with progress.reporting("demo", stream=stream):
        progress.plan(2)
        progress.stage("first")
        progress.stage("second")
    lines = stream.getvalue().splitlines()
    assert [ln.split(" (")[0] for ln in lines] == ["demo: [1/2] first", "demo: [2/2] second"]
    stream = io.StringIO()
    with progress.reporting("demo", show=True, stream=stream):
        progress.plan(1)
        progress.stage("only")
    assert "demo" in stream.getvalue() and "1/1" in stream.getvalue()
    progress.stage("nobody listens")  # outside reporting: silent no-op
    stream = io.StringIO()
    with progress.reporting("demo", show=False, stream=stream):
        progress.plan(1)
        progress.stage("hidden")
    assert stream.getvalue() == ""


def test_whatif_prints_steps_when_not_on_a_terminal(capsys):
    assert cli.main(["whatif", "worst-delta", "--configs", "fwd_s1", "--n", "256", "--q-len", "2", "--seeds", "2",
                     "--steps", "3", "--delta-range", "4:10"]) == 0
    err = capsys.readouterr().err
    assert "pcast whatif worst-delta: [1/2] worst-delta fwd_s1 (total): Adam ascent" in err
    assert "[2/2]" in err


# --------------------------------------------------------------------------------------------
# Figures the issue named
# --------------------------------------------------------------------------------------------


def _png_size(path):
    import struct

    head = path.read_bytes()[:24]
    return struct.unpack(">II", head[16:24])


def test_model_theory_has_no_empty_panel(tmp_path):
    from pcast_experiments import model_report as fp8_report

    rows = [{"layer": i % 3, "measured_fwd_s1": x, "eq7_sigma_s1": x, "eq7_sigma1_s1": x * 0.8,
             "eq6_count_s1": x} for i, x in enumerate(np.linspace(0, 1, 9))]
    one = fp8_report._fig_theory(rows, tmp_path / "one.png")
    both_rows = [{**r, **{k.replace("_s1", "_s256"): v for k, v in r.items() if k != "layer"}} for r in rows]
    two = fp8_report._fig_theory(both_rows, tmp_path / "two.png")
    w1, _ = _png_size(one)
    w2, _ = _png_size(two)
    assert w1 < 0.7 * w2  # one panel when only S = 1 was measured
    assert fp8_report._fig_theory([{"layer": 0}], tmp_path / "none.png") is None


def test_model_heatmaps_tick_both_signs_and_resist_one_extreme_head():
    from pcast_experiments import model_report as fp8_report

    fig, axes = report.new_figure(ncols=2)
    ratio = np.array([[-0.4, 0.1, 1.6], [0.2, -0.1, 0.9]])
    bar = fp8_report._heatmap(axes[0], ratio, "ratio", "RdBu_r", "log10 ratio", fig, center=0.0)
    fig.canvas.draw()
    ticks = [t for t in bar.get_ticks() if bar.vmin <= t <= bar.vmax]
    assert min(ticks) < 0 < max(ticks) and bar.vmin == -bar.vmax  # symmetric about 0, ticked on both sides
    gaps = np.concatenate([np.linspace(5.0, 12.0, 63), [30.0]]).reshape(8, 8)
    bar = fp8_report._heatmap(axes[1], gaps, "sink gap", "viridis", "Δ", fig, robust=True)
    assert bar.extend == "max" and bar.vmax < 13.0 and "max 30" in axes[1].get_title()
    fig, axes = report.new_figure()
    bar = fp8_report._heatmap(axes, np.linspace(5.0, 12.0, 64).reshape(8, 8), "gap", "viridis", "Δ", fig,
                              robust=True)
    assert bar.extend == "neither" and bar.vmax == 12.0  # no extreme head: the full range
    fig, axes = report.new_figure()
    ratio = np.concatenate([np.linspace(-0.3, 0.5, 63), [2.6]]).reshape(8, 8)
    bar = fp8_report._heatmap(axes, ratio, "ratio", "RdBu_r", "log10 ratio", fig, center=0.0, robust=True)
    assert bar.extend == "max" and bar.vmax < 1.0 and bar.vmin == -bar.vmax and "2.6" in axes.get_title()


def test_model_per_layer_ratio_axis_reads_plain_numbers(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from pcast_experiments import model_report as fp8_report

    saved = []
    monkeypatch.setattr(report, "save_figure", lambda fig, path: saved.append(fig))
    mse = np.array([[2.0, 3.0], [1.5, 1.2]])
    study = SimpleNamespace(heads={"fwd_s1": {"mse": mse}, "rev_s256": {"mse": np.ones((2, 2))}})
    rows = [{"layer": 0, "ratio_fwd_s1/rev_s256": 1.2}, {"layer": 1, "ratio_fwd_s1/rev_s256": 3.4}]
    fp8_report._fig_mse_ratio(study, rows, tmp_path / "r.png")
    ax = saved[0].axes[1]
    saved[0].canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert labels and all("10^" not in t and "times" not in t for t in labels), labels
    assert {"1", "1.5", "2", "3"} <= set(labels), labels


def test_paper_forward_s256_stays_visible_over_reverse_s256():
    from pcast_experiments.common import paper_line

    fwd, rev = paper_line("fwd_s256"), paper_line("rev_s256")
    assert fwd["linestyle"] != rev["linestyle"] and fwd["marker"] != rev["marker"]
    assert fwd["zorder"] > rev["zorder"] and fwd["lw"] < rev["lw"]


def test_model_e2e_draws_no_bar_for_zero(tmp_path):
    from matplotlib.figure import Figure

    from pcast_experiments import model_report as fp8_report

    fig = Figure()
    ax = fig.subplots()
    fp8_report._log_bars(ax, np.arange(3), [1e-3, 0.0, 2e-2], color="C0", xlabel="x", zero_text="zero")
    widths = [p.get_width() for p in ax.patches]
    assert np.isnan(widths[1]) and widths[0] == 1e-3
    assert ax.get_xlim()[0] > 1e-4  # the axis starts near the smallest real value, not at 1e-6
    assert [t.get_text() for t in ax.texts] == ["zero"]
    path = fp8_report._fig_e2e([{"config": "fp32", "kl": 0.0, "top1_agree": 1.0},
                                {"config": "a", "kl": 1e-4, "top1_agree": 1.0},
                                {"config": "b", "kl": 1e-3, "top1_agree": 0.99}], tmp_path / "e2e.png")
    assert path.exists()


def test_report_figure_helpers_write_png(tmp_path, mixed_sweep):
    fig = report.sweep_figure(load_result(mixed_sweep), x="delta", y="frac_zeroed")
    path = report.save_figure(fig, tmp_path / "f.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(PcastError, match="y="):
        report.sweep_figure(load_result(mixed_sweep), y="bogus")


_HELP_PROBE = """
import sys
from pcast_jax import cli
try:
    cli.main(sys.argv[1:])
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
heavy = [m for m in ("jax", "jaxlib", "matplotlib", "xarray") if m in sys.modules]
print("HEAVY=" + ",".join(heavy))
"""


@pytest.mark.parametrize("command", [None, *cli.COMMANDS, *cli.PROVIDED_ELSEWHERE])
def test_help_imports_no_jax(command):
    """`pcast --help` and every sub-command's --help parse and print without importing JAX (a
    fresh process: this one has JAX loaded already)."""
    import subprocess

    argv = ([command] if command else []) + ["--help"]
    proc = subprocess.run([sys.executable, "-c", _HELP_PROBE, *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: pcast" in proc.stdout
    assert "HEAVY=\n" in proc.stdout, proc.stdout.splitlines()[-1]


def test_whatif_report_is_rendered_by_the_experiments_package(tmp_path, capsys, monkeypatch):
    """`pcast whatif report` reaches the what-if report's writer through the pcast_jax.reports entry point
    (the library never imports pcast_experiments); without that package it says which one to install."""
    from importlib import metadata

    from pcast_experiments import whatif_report
    from pcast_jax.commands import whatif as whatif_command

    found = metadata.entry_points(group=whatif_command.REPORTS_GROUP, name="whatif")
    assert [ep.load() for ep in found] == [whatif_report.write_report]
    monkeypatch.setattr(metadata, "entry_points", lambda **kw: ())
    assert cli.main(["whatif", "report", "--out", str(tmp_path / "w"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "pcast_experiments package, which is not installed" in err and not (tmp_path / "w").exists()
