"""real_engine model + paged KV: the logits of a sequence do not depend on how its
prompt was packed (whole, in chunks, token by token among other sequences), and
they match a plain dense reference implementation."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore:index_reduce")
F = torch.nn.functional

from real_engine.kv import build_host_step, to_device  # noqa: E402
from real_engine.model import PRESETS, ModelConfig, build_model  # noqa: E402

ATOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", device="cpu", seed=0)


def reference_logits(m, ids: np.ndarray) -> torch.Tensor:
    """Dense causal forward over one whole sequence, written independently of the engine."""
    c = m.cfg
    D, Hq, Hkv = c.head_dim, c.n_heads, c.n_kv_heads
    T = len(ids)
    x = m.embed[torch.as_tensor(ids)]
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv).float()
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(t):  # t [H, T, D]
        half = D // 2
        rot = torch.cat([-t[..., half:], t[..., :half]], -1)
        return t * cos + rot * sin

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.norm_eps) * w

    for L in m.layers:
        h = rms(x, L.attn_norm)
        wq, wk, wv = L.wqkv.split([Hq * D, Hkv * D, Hkv * D])
        q = rope((h @ wq.T).view(T, Hq, D).transpose(0, 1))
        k = rope((h @ wk.T).view(T, Hkv, D).transpose(0, 1))
        v = (h @ wv.T).view(T, Hkv, D).transpose(0, 1)
        k = k.repeat_interleave(Hq // Hkv, 0)
        v = v.repeat_interleave(Hq // Hkv, 0)
        s = (q @ k.transpose(-1, -2)) / D ** 0.5
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        a = (s.softmax(-1) @ v).transpose(0, 1).reshape(T, Hq * D)
        x = x + a @ L.wo.T
        h = rms(x, L.ffn_norm)
        g, u = (h @ L.w13.T).chunk(2, -1)
        x = x + (F.silu(g) * u) @ L.w2.T
    return rms(x, m.norm) @ m.head.T


def run(m, cache, decodes=(), chunks=()):
    """One packed step; returns logits of every row."""
    h = build_host_step(list(decodes), list(chunks), cache)
    meta = to_device(h, cache, sample_all=True)
    with torch.no_grad():
        return m.logits(m(meta, cache))


def test_prefill_whole_matches_reference(model):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, model.cfg.vocab, 45)
    cache = model.new_cache(64)
    table = cache.reserve(0, 4)
    got = run(model, cache, chunks=[(table, 0, ids, True)])
    torch.testing.assert_close(got, reference_logits(model, ids), atol=ATOL, rtol=0)


def test_chunked_and_token_by_token_match_whole(model):
    rng = np.random.default_rng(2)
    V = model.cfg.vocab
    ids = rng.integers(0, V, 53)
    cache = model.new_cache(128)
    t_whole = cache.reserve(0, 4)
    whole = run(model, cache, chunks=[(t_whole, 0, ids, True)])

    # In 7-token chunks, each chunk packed after decodes of an unrelated sequence.
    other = rng.integers(0, V, 20)
    t_other = cache.reserve(1, 8)
    run(model, cache, chunks=[(t_other, 0, other, True)])
    t_chunk = cache.reserve(2, 4)
    chunked = []
    ctx_other = len(other)
    for s in range(0, len(ids), 7):
        part = ids[s:s + 7]
        ctx_other += 1
        out = run(model, cache, decodes=[(t_other, ctx_other, int(rng.integers(V)))],
                  chunks=[(t_chunk, s, part, s + len(part) == len(ids))])
        chunked.append(out[1:])
    torch.testing.assert_close(torch.cat(chunked), whole, atol=ATOL, rtol=0)

    # Token by token as decodes inside mixed batches: a third sequence prefills
    # 5-token chunks beside it, and the unrelated sequence keeps decoding.
    t_tok = cache.reserve(3, 4)
    third = rng.integers(0, V, 400)
    t_third = cache.reserve(4, 26)
    toks = [run(model, cache, chunks=[(t_tok, 0, ids[:1], True)])[0]]
    for i in range(1, len(ids)):
        ctx_other += 1
        p = 5 * (i - 1)
        out = run(model, cache,
                  decodes=[(t_other, ctx_other, int(rng.integers(V))), (t_tok, i + 1, int(ids[i]))],
                  chunks=[(t_third, p, third[p:p + 5], False)])
        toks.append(out[1])
    torch.testing.assert_close(torch.stack(toks), whole, atol=ATOL, rtol=0)


def test_decode_batch_with_different_contexts(model):
    """Batched paged decode == each sequence decoded alone (contexts cross block edges)."""
    rng = np.random.default_rng(3)
    V = model.cfg.vocab
    lens = [1, 15, 16, 17, 33, 70]
    cache = model.new_cache(64)
    tables = []
    for r, n in enumerate(lens):
        tables.append(cache.reserve(r, 6))
        run(model, cache, chunks=[(tables[-1], 0, rng.integers(0, V, n), True)])
    nxt = rng.integers(0, V, len(lens))
    batched = run(model, cache, decodes=[(t, n + 1, int(x)) for t, n, x in zip(tables, lens, nxt)])
    for i, (t, n, x) in enumerate(zip(tables, lens, nxt)):
        alone = run(model, cache, decodes=[(t, n + 1, int(x))])
        torch.testing.assert_close(alone[0], batched[i], atol=ATOL, rtol=0)


def test_presets_and_determinism():
    assert abs(PRESETS["llama3-8b"].num_params() - 8.03e9) / 8.03e9 < 0.01
    assert abs(PRESETS["llama3-70b"].num_params() - 70.6e9) / 70.6e9 < 0.01
    assert abs(PRESETS["llama3-1b"].num_params() - 1.5e9) / 1.5e9 < 0.02  # untied head
    a, b = build_model("tiny", seed=5), build_model("tiny", seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = build_model("tiny", seed=6)
    assert not torch.equal(a.embed, c.embed)
    assert a.embed.dtype == torch.float32


def test_load_safetensors_roundtrip(tmp_path, model):
    st = pytest.importorskip("safetensors.torch")
    c = model.cfg
    D = c.head_dim
    t = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm,
         "lm_head.weight": model.head}
    for i, L in enumerate(model.layers):
        q, k, v = L.wqkv.split([c.n_heads * D, c.n_kv_heads * D, c.n_kv_heads * D])
        g, u = L.w13.chunk(2)
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": L.attn_norm,
                  p + "post_attention_layernorm.weight": L.ffn_norm,
                  p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                  p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": L.wo,
                  p + "mlp.gate_proj.weight": g, p + "mlp.up_proj.weight": u,
                  p + "mlp.down_proj.weight": L.w2})
    st.save_file({k: v.detach().contiguous().clone() for k, v in t.items()},
                 str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": c.d_model, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "intermediate_size": c.ffn, "vocab_size": c.vocab, "rope_theta": c.rope_theta,
        "rms_norm_eps": c.norm_eps, "max_position_embeddings": 4096}))
    loaded = build_model(str(tmp_path))
    assert isinstance(loaded.cfg, ModelConfig) and loaded.cfg.d_model == c.d_model
    ids = np.arange(20) % c.vocab
    cache = loaded.new_cache(8)
    got = run(loaded, cache, chunks=[(cache.reserve(0, 2), 0, ids, True)])
    torch.testing.assert_close(got, reference_logits(model, ids), atol=ATOL, rtol=0)
