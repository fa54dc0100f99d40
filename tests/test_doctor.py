"""pcast doctor: the deployment table, a checkpoint's scales, and the verdict and fix held to the oracle."""

import json
import re

import numpy as np
import pytest

from pcast_jax import cli, criterion, deployments
from pcast_jax.errors import PcastError
from pcast_jax.presets import PRESETS, get_preset

import oracle


@pytest.mark.parametrize("row", deployments.DEPLOYMENTS, ids=lambda d: f"{d.engine}-{d.backend}-{d.gpus[0]}")
def test_every_row_is_found_and_names_real_presets(row):
    for gpu in row.gpus:
        assert deployments.find(row.engine, row.backend, gpu, row.kv_cache_dtypes[0]) is row
    assert all(name in PRESETS for name in row.presets) and row.source


#: A citation: an owner/repository, a file path (source, or a kernel table read as source), and a commit of at
#: least 7 hex digits.
_CITATION = re.compile(r"[\w.-]+/[\w.-]+ [\w./-]+\.(py|cu|h|cuh|hpp|csv)\b.* at [0-9a-f]{7,40}\b")


@pytest.mark.parametrize("row", deployments.DEPLOYMENTS, ids=lambda d: f"{d.engine}-{d.backend}-{d.gpus[0]}")
def test_every_row_cites_the_engines_selection_at_a_commit(row):
    """Every row says where the engine picks the backend and its FP8 path: a file at a named commit, with
    the lines (or the symbol) read, or says plainly what was not read; capabilities are cited where set."""
    assert _CITATION.search(row.selection), row.selection
    assert re.search(r"lines? \d+|\(\w+|: \w+|not read", row.selection), row.selection
    cap = row.capabilities
    if cap != deployments.UNREAD:
        assert re.search(r" at [0-9a-f]{7,40}\b|not pinned", cap.source), cap.source


def test_an_unknown_combination_is_refused_with_the_known_ones():
    with pytest.raises(PcastError, match="no known FP8 attention.*known for vllm: .*triton_attn"):
        deployments.find("vllm", "xformers", "sm90")
    with pytest.raises(PcastError, match="gpu='sm75'.*sm90"):
        deployments.find("vllm", "triton_attn", "sm75")
    with pytest.raises(PcastError, match="engine='ollama'"):
        deployments.find("ollama", "x", "sm90")
    with pytest.raises(PcastError, match="kv_cache_dtype='fp8_e5m2'"):
        deployments.find("vllm", "triton_attn", "sm90", "fp8_e5m2")


def _oracle_masses(cfg, delta, seeds=4):
    """Zeroed and clipped mass (mean over rows and draws) of the float64 Algorithm 1, on its own draws."""
    rng = np.random.default_rng(1)
    zeroed, clipped = [], []
    for _ in range(seeds):
        s, v, mask = oracle.sink_scores(rng, q=8, n=4096, d=16, delta=delta)
        r = oracle.attention(s.astype(np.float64), v.astype(np.float64), count_mask=mask,
                             **oracle.config_kwargs(cfg))
        zeroed.append(r.zeroed_mass.mean())
        clipped.append(r.saturated_mass.mean())
    return float(np.mean(zeroed)), float(np.mean(clipped))


def test_the_verdict_and_the_recommended_scale_s_agree_with_the_oracle():
    """JAX's cuDNN FP8 attention on Hopper at Δ = 2 and 9: the oracle sees the doctor's collapse, meets the
    criterion at the recommended scale_s, and does not at half of it (the recommendation is the smallest
    power of two that passes with a margin of 2 s.e., so the oracle's own draws agree with it)."""
    row = deployments.find("jax", "cudnn", "sm90")
    deltas = (2.0, 9.0)
    diag = deployments.diagnose(row, deltas=deltas)
    base = get_preset(row.presets[0])
    limit_z, limit_c = criterion.ZEROED_MASS_LIMIT, criterion.CLIPPED_MASS_LIMIT

    def passes(scale):
        return all(z <= limit_z and c <= limit_c for z, c in
                   (_oracle_masses(base.replace(scale=scale), d) for d in deltas))

    at_one = {d: _oracle_masses(base, d) for d in deltas}
    assert diag.safe is False and diag.collapse_delta == 9.0
    assert [r["verdict"] for r in diag.rows] == ["under", "over"]
    assert at_one[2.0][0] <= limit_z < at_one[9.0][0]  # the oracle sees the same collapse
    rec = diag.recommended
    assert rec is not None and passes(rec) and not passes(rec / 2)
    assert f"scale_s = {rec:g}" in diag.advice
    # the report never contradicts itself: the rows at the current setting exceed the limit where it says
    assert any(r["zeroed_mass"] > limit_z and r["delta"] == 9.0 for r in diag.rows)


def test_a_safe_deployment_says_so_and_recommends_nothing():
    diag = deployments.diagnose(deployments.find("flash-attention", "fa3", "sm90"), deltas=(4.0, 8.0))
    assert diag.safe is True and diag.recommended is None and "nothing to change" in diag.advice
    for r in diag.rows:
        z, c = _oracle_masses(get_preset("fa3"), r["delta"], seeds=2)
        assert z <= criterion.ZEROED_MASS_LIMIT and c <= criterion.CLIPPED_MASS_LIMIT


def _write_checkpoint(folder, tensors):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    folder.mkdir(exist_ok=True)
    safetensors_numpy.save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_checkpoint_scales_read_only_the_scale_tensors(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "ckpt", {
        "model.layers.0.self_attn.prob_scale": np.array(0.5, np.float32),
        "model.layers.1.self_attn.prob_scale": np.array(0.25, np.float32),
        "model.layers.0.self_attn.k_scale": np.array([2.0], np.float32),
        "model.layers.0.self_attn.q_proj.weight": np.ones((4, 4), np.float32)})
    scales = deployments.checkpoint_scales(ckpt)
    assert scales["prob_scale"] == {"model.layers.0.self_attn.prob_scale": 0.5,
                                    "model.layers.1.self_attn.prob_scale": 0.25}
    assert scales["k_scale"] == {"model.layers.0.self_attn.k_scale": 2.0} and scales["v_scale"] == {}
    assert deployments.scale_from_knob("prob_scale", 0.25) == 4.0
    assert deployments.knob_from_scale("prob_scale", 4.0) == 0.25


@pytest.mark.parametrize("bad", [np.nan, 0.0, -1.0, np.inf])
def test_a_checkpoint_scale_that_is_not_positive_and_finite_is_refused(tmp_path, bad):
    ckpt = _write_checkpoint(tmp_path / "ckpt", {"a.prob_scale": np.array(bad, np.float32)})
    with pytest.raises(PcastError, match="model.safetensors: tensor 'a.prob_scale'.*(finite positive|non-finite)"):
        deployments.checkpoint_scales(ckpt)


def test_checkpoint_folder_errors_name_the_folder(tmp_path):
    with pytest.raises(PcastError, match="is not a folder"):
        deployments.checkpoint_scales(tmp_path / "missing")
    with pytest.raises(PcastError, match="holds no \\*.safetensors"):
        deployments.checkpoint_scales(tmp_path)
    (tmp_path / "x.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(PcastError, match="x.safetensors: field 'header' is not valid JSON"):
        deployments.checkpoint_scales(tmp_path)


@pytest.mark.parametrize("argv, words", [
    (["--engine", "vllm", "--backend", "nope", "--gpu", "sm90"], ["no known FP8 attention", "triton_attn"]),
    (["--engine", "vllm", "--backend", "triton_attn", "--gpu", "sm90", "--prob-scale", "0.5"],
     ["--prob-scale", "fixed by the kernel"]),
    (["--engine", "jax", "--backend", "cudnn", "--gpu", "sm90", "--scale-s", "0"], ["scale_s=0.0", "positive"]),
    (["--engine", "jax", "--backend", "cudnn", "--gpu", "sm90", "--seeds", "1"], ["--seeds", "standard error"]),
])
def test_doctor_refuses_bad_input_in_one_line(argv, words, capsys):
    assert cli.main(["doctor", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err


def test_doctor_prints_the_kernel_the_rows_and_the_verdict(tmp_path, capsys):
    assert cli.main(["doctor", "--engine", "vllm", "--backend", "triton_attn", "--gpu", "sm90",
                     "--delta", "8", "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "runs: vllm_triton_fp8, vllm_triton_fp8_3d" in out and "Verdict: P-collapse" in out
    assert "no setting of this backend avoids it" in out
    assert cli.main(["doctor", "--engine", "vllm", "--backend", "triton_attn", "--gpu", "sm90",
                     "--delta", "8", "--seeds", "2", "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["safe"] is False and got["collapse_delta"] == 8.0 and got["knob"] == "none"
    assert all(r["verdict"] == "over" and r["zeroed_mass_sem"] >= 0 for r in got["rows"])
    assert {r["preset"] for r in got["rows"]} == {"vllm_triton_fp8", "vllm_triton_fp8_3d"}


def test_vllm_rocm_flash_takes_the_checkpoints_prob_scale_doubled_on_mi300(tmp_path):
    """The one backend whose P scale is the checkpoint's prob_scale: S = 1/(2·prob_scale) on MI300 (the loader
    doubles it there), the preset as it is without one, and a recommendation written as a prob_scale."""
    from pcast_jax.presets import amd

    row = deployments.find("vllm", "rocm_flash", "gfx942")
    assert row.knob == "prob_scale"
    assert deployments.scale_from_knob("prob_scale", 0.25, row.knob_factor) == amd.vllm_rocm_flash_scale(0.25)
    ckpt = _write_checkpoint(tmp_path / "ckpt", {"l0.prob_scale": np.array(1 / 512, np.float32)})
    diag = deployments.diagnose(row, scales=deployments.checkpoint_scales(ckpt), deltas=(9.0,), seeds=2)
    assert {r["scale"] for r in diag.rows} == {256.0} and {r["knob_value"] for r in diag.rows} == {1 / 512}
    plain = deployments.diagnose(row, deltas=(9.0,), seeds=2)
    assert {r["scale"] for r in plain.rows} == {1.0} and plain.safe is False
    assert plain.recommended is not None
    assert deployments.scale_from_knob("prob_scale", plain.recommended, row.knob_factor) >= 64


def test_a_diagnosis_publishes_the_checkpoints_scales_not_the_candidates(tmp_path, capsys):
    """With a knob and an "over" verdict the recommendation searches candidate S values; what
    ``Diagnosis.scales`` and the JSON ``scales`` carry is still the checkpoint's scales as read."""
    ckpt = _write_checkpoint(tmp_path / "ckpt", {"l0.prob_scale": np.array(0.5, np.float32),
                                                 "l0.k_scale": np.array(2.0, np.float32)})
    scales = deployments.checkpoint_scales(ckpt)
    row = deployments.find("vllm", "rocm_flash", "gfx942")
    diag = deployments.diagnose(row, scales=scales, deltas=(9.0,), seeds=2)
    assert diag.safe is False and diag.recommended is not None  # the candidate search ran
    assert diag.scales == scales == {"prob_scale": {"l0.prob_scale": 0.5}, "k_scale": {"l0.k_scale": 2.0},
                                     "q_scale": {}, "v_scale": {}, "layers": {"l0": 0.5}, "unindexed": []}
    argv = ["doctor", "--engine", "vllm", "--backend", "rocm_flash", "--gpu", "gfx942", "--checkpoint", str(ckpt),
            "--delta", "9", "--seeds", "2", "--format", "json"]
    assert cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["safe"] is False and got["scales"] == scales


def test_knob_setting_translates_a_scale_into_each_deployments_knob():
    """One place for the knobs: cuDNN's scale_s is the config's scale (at any τ), vLLM ROCm's prob_scale is
    0.5/S on MI300, a kernel no deployment tunes keeps the KernelConfig field."""
    assert deployments.knob_setting(get_preset("cudnn_fp8_tau0"), 256.0) == ("scale_s", 256.0, "jax cudnn")
    assert deployments.knob_setting(get_preset("cudnn_fp8_tau0").replace(scale=8.0), 16.0) == (
        "scale_s", 16.0, "jax cudnn")
    # the open SM100 kernel ignores scale_s, and the older reference at τ = 4 nats is in no row: no knob
    assert deployments.knob_setting(get_preset("cudnn_sm100_fp8"), 16.0) == ("scale", 16.0, "")
    assert deployments.knob_setting(get_preset("cudnn_fp8"), 256.0) == ("scale", 256.0, "")
    assert deployments.knob_setting(get_preset("vllm_rocm_flash_fp8"), 16.0) == (
        "prob_scale", 0.5 / 16.0, "vllm rocm_flash")
    assert deployments.knob_setting(get_preset("fa3"), 4.0) == ("scale", 4.0, "")


@pytest.mark.parametrize("kind", ["sink at 0", "no sink"])
def test_doctor_on_a_trace_is_the_numpy_kernel(kind, tmp_path, capsys):
    """``pcast doctor --trace``: JAX's cuDNN FP8 attention on SM90 (the closed engine's reference: τ = 0,
    S = scale_s) analysed on a trace with a sink and on one without. The verdict of the default scale_s = 1
    and the recommended scale_s equal an independent NumPy cuDNN kernel's (forward, 128-key blocks) on the
    same trace; the JSON carries the same answer, and a knob given runs at that knob."""
    from test_analysis import character_trace, numpy_forward_losses

    from pcast_jax import deployments
    from pcast_jax.analysis import diagnose_trace

    trace = character_trace(kind, T=320)
    row = deployments.find("jax", "cudnn", "sm90")
    limit = 1e-3

    def passes(scale_s):
        zeroed, clipped = numpy_forward_losses(trace.q[0, 0], trace.k[0, 0], 320, -1, 128, scale_s, 16)
        return zeroed.max() <= limit and clipped.max() <= limit

    diag = diagnose_trace(row, trace, mass_limit=limit)
    assert diag.safe == passes(1.0)
    want = None if diag.safe else next((2.0 ** e for e in range(13) if passes(2.0 ** e)), None)
    assert diag.recommended == want
    if want is not None:
        assert f"set scale_s = {want:g}" in diag.advice
        assert diagnose_trace(row, trace, knob_value=want, mass_limit=limit).safe
    path = trace.save(tmp_path / "t.npz")
    argv = ["doctor", "--engine", "jax", "--backend", "cudnn", "--gpu", "sm90", "--trace", str(path)]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "jax cudnn on sm90 with KV cache fp8 runs: cudnn_fp8_tau0"
    assert lines[-1] == f"Verdict on this model: {'safe' if diag.safe else 'not safe'} to serve — {diag.advice}."
    assert cli.main(argv + ["--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["safe"], out["recommended"]) == (diag.safe, diag.recommended)
    assert out["analysis"]["verdicts"] == {r["config"]: r["verdict"] for r in diag.analysis.config_rows()}
    assert cli.main(["doctor", "--engine", "jax", "--backend", "cudnn", "--gpu", "sm100", "--model", "m.gguf"]) == 2
    assert "--model needs --trace" in capsys.readouterr().err


def _sharded_checkpoint(folder, shards: dict, weight_map: dict, layers: int | None = None):
    """A checkpoint folder of ``shards`` ({file: {tensor: array}}), an index with ``weight_map`` and, with
    ``layers``, a config.json giving num_hidden_layers."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    folder.mkdir(exist_ok=True)
    for file, tensors in shards.items():
        safetensors_numpy.save_file(tensors, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if layers is not None:
        (folder / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    return folder


def _mi300_checkpoint(tmp_path):
    """Five layers as an MI300 checkpoint of 2026 writes them: per-head q_scale [8] and k/v_scale [2], a
    per-token-head v_scale [4, 2], prob_scale 1/256 on layers 0 and 2, 1/4 on layer 3 (in its shard but
    left out of the index's weight_map), none on layers 1 and 4."""
    f32 = np.float32
    a = {"model.layers.0.self_attn.prob_scale": np.array(1 / 256, f32),
         "model.layers.0.self_attn.q_scale": np.linspace(0.5, 1.0, 8).astype(f32),
         "model.layers.0.self_attn.k_scale": np.array([0.25, 0.5], f32),
         "model.layers.0.self_attn.v_scale": np.array([0.125, 0.25], f32),
         "model.layers.1.self_attn.v_scale": np.full((4, 2), 0.5, f32)}
    b = {"model.layers.2.self_attn.prob_scale": np.array(1 / 256, f32),
         "model.layers.3.self_attn.prob_scale": np.array(1 / 4, f32),
         "model.layers.0.mlp.up_proj.weight": np.ones((2, 2), f32)}
    listed = {name: "a.safetensors" for name in a} | {"model.layers.2.self_attn.prob_scale": "b.safetensors",
                                                      "model.layers.0.mlp.up_proj.weight": "b.safetensors"}
    return _sharded_checkpoint(tmp_path / "ckpt", {"a.safetensors": a, "b.safetensors": b}, listed, layers=5)


def test_per_head_scales_are_read_and_every_layer_is_accounted_for(tmp_path):
    """Per-head and per-token-head q/k/v scales are read (values as written), a prob_scale the index leaves
    out is read and named, and each of the five layers has its prob_scale or None (the engine's default)."""
    scales = deployments.checkpoint_scales(_mi300_checkpoint(tmp_path))
    np.testing.assert_array_equal(scales["q_scale"]["model.layers.0.self_attn.q_scale"],
                                  np.linspace(0.5, 1.0, 8).astype(np.float32))
    assert scales["k_scale"] == {"model.layers.0.self_attn.k_scale": [0.25, 0.5]}
    assert scales["v_scale"]["model.layers.1.self_attn.v_scale"] == [[0.5, 0.5]] * 4
    assert scales["unindexed"] == ["model.layers.3.self_attn.prob_scale"]
    assert scales["layers"] == {"layers.0": 1 / 256, "layers.1": None, "layers.2": 1 / 256, "layers.3": 0.25,
                                "layers.4": None}
    assert deployments.layer_groups(scales) == [(1 / 256, ["layers.0", "layers.2"]), (0.25, ["layers.3"]),
                                                (None, ["layers.1", "layers.4"])]


def test_a_per_head_prob_scale_is_refused_naming_it(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "ckpt", {"model.layers.0.self_attn.prob_scale": np.full(8, 0.5, np.float32)})
    with pytest.raises(PcastError, match="prob_scale'.*shape' = \\[8\\] must hold one number.*vLLM refuses"):
        deployments.checkpoint_scales(ckpt)


def test_each_group_of_layers_gets_the_verdict_of_the_scale_p_sees(tmp_path, capsys):
    """vLLM ROCm on MI300: P sees S = 1/(2·prob_scale) where the layer has one (the loader doubles it on
    FNUZ) and S = 1 where it has none (prob_scale 1.0, not doubled), written here from that rule alone;
    each group's verdict is the float64 oracle's on its own draws at that S (far from the limit at Δ = 9)."""
    row = deployments.find("vllm", "rocm_flash", "gfx942")
    scales = deployments.checkpoint_scales(_mi300_checkpoint(tmp_path))
    diag = deployments.diagnose(row, scales=scales, deltas=(9.0,), seeds=2)
    sees = {1 / 256: 128.0, 0.25: 2.0, None: 1.0}  # what P is multiplied by, per prob_scale read
    assert [(g["prob_scale"], g["scale"]) for g in diag.layers] == list(sees.items())
    assert {r["scale"] for r in diag.rows} == set(sees.values())
    base = get_preset(row.presets[0])
    for group in diag.layers:
        z, c = _oracle_masses(base.replace(scale=sees[group["prob_scale"]]), 9.0, seeds=2)
        over = z > criterion.ZEROED_MASS_LIMIT or c > criterion.CLIPPED_MASS_LIMIT
        assert group["verdict"] == ("over" if over else "under"), (group, z, c)
    assert [g["verdict"] for g in diag.layers] == ["under", "over", "over"]
    assert diag.to_dict()["layers"][2]["layers"] == ["layers.1", "layers.4"]
    assert cli.main(["doctor", "--engine", "vllm", "--backend", "rocm_flash", "--gpu", "gfx942", "--checkpoint",
                     str(tmp_path / "ckpt"), "--delta", "9", "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "layers without prob_scale: layers.1, layers.4" in out and "S = 1), simulated" in out
    assert "not in its weight_map" in out and "model.layers.3.self_attn.prob_scale" in out
    assert "checkpoint q_scale: 1 tensors (per head ×8)" in out and "quantize Q, K and V only" in out
    assert "| layers.1, layers.4 | none: default 1 | 1 | over |" in out


def test_a_backend_without_the_knob_says_the_checkpoint_does_not_reach_p(tmp_path, capsys):
    assert cli.main(["doctor", "--engine", "vllm", "--backend", "triton_attn", "--gpu", "sm90", "--checkpoint",
                     str(_mi300_checkpoint(tmp_path)), "--delta", "9", "--seeds", "2", "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["layers"] == [] and got["scales"]["unindexed"] == ["model.layers.3.self_attn.prob_scale"]
    assert cli.main(["doctor", "--engine", "vllm", "--backend", "triton_attn", "--gpu", "sm90", "--checkpoint",
                     str(tmp_path / "ckpt"), "--delta", "9", "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint prob_scale: 3 tensors (per tensor), 0.00390625 … 0.25 (not used for P by this backend)" in out
    assert "P's cast takes its scale from nothing: the kernel fixes S" in out and "layers without" not in out


def test_on_a_trace_each_group_of_layers_gets_its_own_verdict():
    """``doctor --trace`` with a checkpoint whose layers differ in prob_scale: layer 0 at 1/256 (S = 128 on
    MI300), layer 1 without one (S = 1); each group's verdict is the float64 oracle's worst head on that
    layer of the trace at that S, cast to E4M3FNUZ (``oracle.causal_head_masses``)."""
    from test_analysis import character_trace

    from pcast_jax.analysis import Trace, diagnose_trace

    one = character_trace("sink at 0", T=320)
    trace = Trace(q=np.concatenate([one.q] * 2), k=np.concatenate([one.k] * 2), v=np.concatenate([one.v] * 2),
                  lengths=one.lengths, layers=("attn0", "attn1"))
    row = deployments.find("vllm", "rocm_flash", "gfx942")
    scales = {"prob_scale": {"model.layers.0.self_attn.prob_scale": 1 / 256},
              "layers": {"layers.0": 1 / 256, "layers.1": None}}
    limit = 1e-3
    diag = diagnose_trace(row, trace, scales=scales, mass_limit=limit)
    block = deployments.configured(row, head_dim=trace.q.shape[-1])[0].block_kv
    want = []
    for layer, scale in ((0, 128.0), (1, 1.0)):
        masses = oracle.causal_head_masses(trace.q[layer, 0], trace.k[layer, 0], block_kv=block,
                                           scales=[scale], min_keys=16, line=oracle.E4M3FNUZ)
        want.append("safe to serve" if masses.zeroed.max() <= limit and masses.clipped.max() <= limit else "fails")
    assert [(g["prob_scale"], g["trace_layers"], g["verdict"]) for g in diag.layers] == [
        (1 / 256, ["attn0"], want[0]), (None, ["attn1"], want[1])]
    assert want == ["safe to serve", "fails"]  # the two groups part: the test can tell them apart
    assert diag.to_dict()["layers"][1]["layers"] == ["layers.1"]
def test_sm100_cudnn_never_recommends_scale_s(tmp_path, capsys):
    """cuDNN's open SM100 kernels ignore scale_s: the doctor has no knob for it, refuses --scale-s, never
    tells the user to pass one (over a Δ range or on a trace), and its masses on a trace are the NumPy
    kernel's at the baked S = 16 with a lag of τ = 4 (log2) = 4 ln 2 logits."""
    import math

    from test_analysis import character_trace, numpy_forward_losses

    from pcast_jax.analysis import diagnose_trace

    row = deployments.find("jax", "cudnn", "sm100")
    assert row.knob == "none" and row.presets == ("cudnn_sm100_fp8",)
    diag = deployments.diagnose(row, deltas=(4.0, 12.0), seeds=2)
    assert diag.recommended is None and "scale_s" not in diag.advice
    # the verdict word and the advice never say the same thing twice
    for d in (diag, deployments.diagnose(deployments.find("flash-attention", "fa3", "sm90"), deltas=(4.0,), seeds=2)):
        word = {True: "safe", False: "P-collapse", None: "undecided"}[d.safe]
        assert not d.advice.lower().startswith(word.lower()), d.advice
    assert cli.main(["doctor", "--engine", "jax", "--backend", "cudnn", "--gpu", "sm100", "--scale-s", "16"]) == 2
    assert "--scale-s: jax cudnn sets the P scale through nothing" in capsys.readouterr().err
    trace = character_trace("sink at 0", T=320, D=64)  # a head dim the open kernels take
    tdiag = diagnose_trace(row, trace, mass_limit=1e-3)
    assert tdiag.recommended is None and "scale_s" not in tdiag.advice
    zeroed, clipped = numpy_forward_losses(trace.q[0, 0], trace.k[0, 0], 320, -1, 128, 16.0, 16,
                                           tau=4 * math.log(2))
    assert tdiag.safe == (zeroed.max() <= 1e-3 and clipped.max() <= 1e-3)
    path = trace.save(tmp_path / "t.npz")
    assert cli.main(["doctor", "--engine", "jax", "--backend", "cudnn", "--gpu", "sm100", "--trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "scale_s =" not in out and "set scale_s" not in out
    assert "What-if only (this deployment fixes S" in out  # the scan is not a setting


def _gemma_like_trace():
    """One soft-capped (cap 50), windowed (64 keys back) layer: what Gemma-2's local layers ask of a backend."""
    import dataclasses

    from test_analysis import character_trace

    return dataclasses.replace(character_trace("sink at 0", T=160, D=32), logits_soft_cap=np.array([50.0]),
                               local_window_size=np.array([64]))


def test_the_doctor_says_when_a_backend_cannot_run_the_model(tmp_path, capsys):
    """vLLM's V0 ROCm Triton flash attention refuses logit soft-capping and has no sliding window (cited on
    the row): on a soft-capped, windowed trace the doctor says so before any verdict, names what the engine
    advises instead, simulates nothing and never says "safe to serve"; a backend that supports both
    (vLLM TRITON_ATTN on CUDA) gets its verdict."""
    from pcast_jax.analysis import diagnose_trace

    trace = _gemma_like_trace()
    features = deployments.ModelFeatures.of_trace(trace)
    assert (features.soft_cap, features.sliding_window, features.learned_sinks) == (True, True, False)
    assert (features.head_dim, features.gqa_ratio) == (32, 2)
    row = deployments.find("vllm", "rocm_flash", "gfx942")
    diag = diagnose_trace(row, trace)
    assert diag.safe is None and diag.analysis is None and len(diag.cannot_run) == 2
    assert "soft-capping" in diag.advice and "VLLM_USE_TRITON_FLASH_ATTN=0" in diag.advice
    path = trace.save(tmp_path / "t.npz")
    assert cli.main(["doctor", "--engine", "vllm", "--backend", "rocm_flash", "--gpu", "gfx942", "--trace",
                     str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  can it run this model: no"))
    assert lines[-1].startswith("Verdict on this model: none") and at < len(lines) - 1
    assert not any("safe to serve" in line for line in lines)
    ok = diagnose_trace(deployments.find("vllm", "triton_attn", "sm90"), trace)
    assert ok.cannot_run == () and ok.safe is not None and ok.analysis is not None
    # a head dim the backend does not take is refused too (FlashInfer takes 64, 128, 256)
    fi = deployments.find("vllm", "flashinfer", "sm90")
    assert any("head dim 32" in why for why in fi.cannot_run(features))


def test_a_backend_that_casts_no_p_to_fp8_says_so():
    """vLLM's FlashInfer backend on Hopper keeps Q in the model dtype, so FlashInfer's FP8 kernel never runs:
    the doctor says there is no FP8 P instead of a verdict on a kernel that does not run."""
    row = deployments.find("vllm", "flashinfer", "sm90")
    assert not row.casts_p and row.knob == "none"
    diag = deployments.diagnose(row, deltas=(8.0,), seeds=2)
    assert diag.rows == () and diag.safe is True and "casts no P to FP8" in diag.advice
    rocm = deployments.find("vllm", "triton_attn", "gfx942")
    assert not rocm.casts_p and rocm is deployments.find("vllm", "triton_attn", "gfx950")


def test_the_backends_the_help_names_are_rows_of_the_table():
    """``--backend``'s list names exactly the backends the table knows, each under its engine."""
    import argparse

    from pcast_jax.commands import doctor

    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    text = next(a.help for a in parser._actions if a.dest == "backend")
    listed = re.search(r"\((.*)\); an unknown one", text)[1]
    known = {(d.engine, d.backend) for d in deployments.DEPLOYMENTS}
    named = {(engine, backend.strip()) for part in listed.split("; ")
             for engine, _, backends in [part.partition(": ")] for backend in backends.split(",")}
    assert named == known, named ^ known
