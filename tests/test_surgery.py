"""al.surgery.to_gqa: MHA -> GQA/MQA by mean-pooling K/V heads (Ainslie et al. 2023), checked
against a float64 reference of the pooled attention written out here."""

from __future__ import annotations

import pytest
import torch

import attnlab as al


def _model(n_heads=4, n_kv_heads=None, qkv_bias=True):
    cfg = al.ModelConfig(
        arch="decoder", vocab_size=50, d_model=32, n_layers=2, n_heads=n_heads,
        n_kv_heads=n_kv_heads, positional={"kind": "rope"},
        attention={"qkv_bias": qkv_bias}, init="normal",
    )  # fmt: skip
    torch.manual_seed(0)
    return al.build_model(cfg).eval()


def test_same_number_of_heads_is_the_identity():
    model = _model()
    ids = torch.randint(0, 50, (2, 9))
    same = al.surgery.to_gqa(model, 4)
    assert same is not model
    torch.testing.assert_close(same(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("n_kv", [2, 1])
def test_pooled_weights_and_outputs_equal_a_float64_reference(n_kv):
    model = _model()
    conv = al.surgery.to_gqa(model, n_kv)
    assert conv.config.n_kv_heads == n_kv and model.config.n_kv_heads is None  # original kept
    attn, new = model.decoder.blocks[0].self_attn, conv.decoder.blocks[0].self_attn
    assert new.n_kv_heads == n_kv and new.k_proj.out_features == n_kv * 8
    # reference: head j of the new K is the float64 mean of old heads j·g .. j·g + g - 1
    g, D = 4 // n_kv, 8
    wk = attn.k_proj.weight.double()
    ref = torch.stack([wk[j * g * D : (j + 1) * g * D].view(g, D, -1).mean(0) for j in range(n_kv)])
    torch.testing.assert_close(new.k_proj.weight.double(), ref.reshape(n_kv * D, -1))
    bv = attn.v_proj.bias.double().view(4, D)
    ref_b = torch.stack([bv[j * g : (j + 1) * g].mean(0) for j in range(n_kv)]).reshape(-1)
    torch.testing.assert_close(new.v_proj.bias.double(), ref_b)

    # the layer's output equals attention written out in float64 with the pooled K/V shared by
    # each group of query heads (causal, RoPE off: rotation=None context)
    from attnlab.nn.attention.layer import AttnContext
    from attnlab.nn.attention.masks import MaskSpec

    x = torch.randn(1, 6, 32)
    pos = torch.arange(6)[None]
    out, _ = new(x, AttnContext(mask=MaskSpec(pos, pos, causal=True, aligned=True)))
    xd = x.double()
    q = (xd @ attn.q_proj.weight.double().T + attn.q_proj.bias.double()).view(1, 6, 4, D)
    k = (xd @ ref.reshape(n_kv * D, -1).T + new.k_proj.bias.double()).view(1, 6, n_kv, D)
    wv = attn.v_proj.weight.double().view(4, D, -1)
    wv = torch.stack([wv[j * g : (j + 1) * g].mean(0) for j in range(n_kv)]).reshape(n_kv * D, -1)
    v = (xd @ wv.T + ref_b).view(1, 6, n_kv, D)
    heads = []
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    for h in range(4):
        s = q[0, :, h] @ k[0, :, h // g].T / D**0.5
        w = s.masked_fill(~causal, float("-inf")).softmax(-1)
        heads.append(w @ v[0, :, h // g])
    ref_out = torch.cat(heads, -1) @ attn.o_proj.weight.double().T
    torch.testing.assert_close(out[0].double(), ref_out, rtol=1e-5, atol=1e-5)


def test_cached_decoding_of_the_converted_model_matches_recompute():
    conv = al.surgery.to_gqa(_model(), 2)
    ids = torch.randint(0, 50, (1, 4))
    full = al.generate(conv, ids, max_new_tokens=5, strategy="greedy")
    step = [conv(full[:, : i + 1]).logits[0, -1].argmax() for i in range(3, 8)]
    assert full[0, 4:].tolist() == [int(t) for t in step]


def test_gqa_model_pools_further_and_bad_counts_are_refused():
    model = _model(n_heads=4, n_kv_heads=2)
    assert al.surgery.to_gqa(model, 1).decoder.blocks[1].self_attn.n_kv_heads == 1
    with pytest.raises(ValueError, match=r"n_kv_heads \(3\) must divide the 2 key/value heads"):
        al.surgery.to_gqa(model, 3)
    with pytest.raises(ValueError, match="choose one of"):
        al.surgery.to_gqa(model, 0)
    with pytest.raises(TypeError, match="must be an int"):
        al.surgery.to_gqa(model, 2.0)


def test_init_from_a_run_pools_kv_heads_on_load(tmp_path, monkeypatch):
    """model.init_from (src/attnlab/train/run.py): a GQA run started from an MHA run's
    checkpoint holds exactly al.surgery.to_gqa of those weights."""
    import gzip

    from attnlab.train import checkpoint as ckpt
    from attnlab.train.recipes import Recipe
    from attnlab.train.run import init_from, train

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    data = tmp_path / "data" / "tinyshakespeare"
    data.mkdir(parents=True)
    (data / "input.txt.gz").write_bytes(gzip.compress(b"ROMEO: speak, speak.\n" * 200))
    raw = {
        "steps": 2, "precision": "fp32", "data": {"kind": "lm", "context": 16},
        "batch": {"size": 2}, "eval": {"every": 2, "batches": 1},
        "model": {"preset": "llama2-7b", "overrides": {
            "d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 4, "d_ff": 64}},
    }  # fmt: skip
    train(Recipe.from_dict(raw), tmp_path / "mha", tmp_path / "data", "cpu", progress=False)
    mha, cfg = ckpt.load(ckpt.resolve(tmp_path / "mha", "best"))
    gqa = al.build_model(cfg.replace(n_kv_heads=2))
    init_from(gqa, tmp_path / "mha")
    want = al.surgery.to_gqa(mha, 2).state_dict()
    for k, v in gqa.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0)
    wrong = al.build_model(cfg.replace(d_ff=32))
    with pytest.raises(ValueError, match="do not fit this architecture"):
        init_from(wrong, tmp_path / "mha")
    with pytest.raises(ValueError, match="no checkpoint"):
        init_from(gqa, tmp_path / "nothing")
