"""The PyTorch capture's conversion of recorded calls into a trace (NumPy only: torch is not installed here), fed
with the arrays a gemma2 checkpoint's JAX forward records, laid out as transformers hands them to an attention
function: the trace equals the one the JAX path's Recorder writes."""

import math

import numpy as np
import pytest
from test_model_archs import CASES, TOKENS, write_checkpoint

from pcast_jax.analysis.torch_capture import AttentionCall, trace_from_calls
from pcast_jax.errors import PcastError


def hf_mask(lengths, tokens: int, window: int | None) -> np.ndarray:
    """[B, T, T] as transformers' masks define it: causal, real keys, and keys j > i − window."""
    i, j = np.arange(tokens)[:, None], np.arange(tokens)[None, :]
    out = []
    for n in lengths:
        vis = (j <= i) & (j < n)
        if window is not None:
            vis &= j > i - window
        out.append(vis)
    return np.stack(out)


def test_calls_of_a_gemma2_model_give_the_trace_of_the_jax_path(tmp_path):
    from pcast_jax.analysis import Recorder
    from pcast_jax.models import forward, load_model

    arch, extra = CASES["gemma2"]
    folder, cfg_json, _ = write_checkpoint(tmp_path / "g2", arch, extra, seed=2)
    cfg, params = load_model(folder)
    tokens = np.stack([TOKENS, np.resize(TOKENS[::-1], TOKENS.size)])
    lengths = np.array([12, 9])
    rec = Recorder()
    forward(params, cfg, tokens, attention_fn=rec.hook(), lengths=lengths)
    want = rec.trace(tokens=tokens)
    # what transformers passes: the model's own queries (its scale not folded), [B, H, T, D], its window in keys
    scaling = cfg_json["query_pre_attn_scalar"] ** -0.5
    fold = scaling * math.sqrt(want.q.shape[-1])
    calls = []
    for layer, kind in enumerate(["sliding_attention", "full_attention"]):
        window = cfg_json["sliding_window"] if kind == "sliding_attention" else None
        calls.append(AttentionCall(
            layer=f"layer{layer}", q=np.swapaxes(want.q[layer], 1, 2) / fold, k=np.swapaxes(want.k[layer], 1, 2),
            v=np.swapaxes(want.v[layer], 1, 2), visible=hf_mask(lengths, tokens.shape[1], window), scaling=scaling,
            sliding_window=window, softcap=cfg_json["attn_logit_softcapping"]))
    got = trace_from_calls(calls, tokens=tokens)
    assert got.layers == want.layers and got.lengths.tolist() == [12, 9]
    assert got.local_window_size.tolist() == want.local_window_size.tolist() == [3, -1]
    np.testing.assert_array_equal(got.logits_soft_cap, want.logits_soft_cap)
    # q is divided and multiplied back by one float32 factor: two roundings, 2^-23 relative
    np.testing.assert_allclose(got.q, want.q, rtol=2.0**-22, atol=0)
    np.testing.assert_array_equal(got.k, want.k)
    np.testing.assert_array_equal(got.v, want.v)
    assert got.sinks is None


def test_learned_sinks_and_what_cannot_be_recorded():
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(1, 4, 6, 8)), rng.normal(size=(1, 2, 6, 8))
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    trace = trace_from_calls([AttentionCall(layer="a", q=q, k=k, v=k, sliding_window=3, sinks=sinks)])
    np.testing.assert_array_equal(trace.sinks, sinks[None].astype(np.float32))
    assert trace.local_window_size.tolist() == [2] and trace.logits_soft_cap is None
    np.testing.assert_allclose(trace.q[0], np.swapaxes(q, 1, 2), rtol=1e-6)  # default scale 1/√D: nothing folded
    left = np.flip(hf_mask([4], 6, None), axis=(1, 2))  # left padding
    cases = {
        "pad on the right": dict(visible=left),
        "s_aux must hold one sink per query head": dict(sinks=sinks[:2]),
        "only self-attention": dict(k=k[:, :, :3]),
    }
    for message, change in cases.items():
        kw = dict(layer="a", q=q, k=k, v=k)
        kw.update(change)
        kw["v"] = kw["k"]
        with pytest.raises(PcastError, match=message):
            trace_from_calls([AttentionCall(**kw)])
    # transformers may leave padded query rows open to padded keys: the model's attention_mask says what is real
    open_rows = hf_mask([6], 6, None)
    open_rows[0, 4:, :] = np.tril(np.ones((6, 6), bool))[4:]
    call = AttentionCall(layer="a", q=q, k=k, v=k, visible=open_rows)
    assert trace_from_calls([call]).lengths.tolist() == [6]
    assert trace_from_calls([call], attention_mask=[[1, 1, 1, 1, 0, 0]]).lengths.tolist() == [4]
    with pytest.raises(PcastError, match="not right padding"):
        trace_from_calls([call], attention_mask=[[0, 0, 1, 1, 1, 1]])
    with pytest.raises(PcastError, match="nothing was recorded"):
        trace_from_calls([])
    with pytest.raises(PcastError, match="different windows"):
        trace_from_calls([AttentionCall(layer="a", q=q, k=k, v=k, sliding_window=3),
                          AttentionCall(layer="a", q=q, k=k, v=k)])
