"""The GGUF writer (src/attnlab/interop/gguf/writer.py), for every architecture attnlab reads:

- GGUF -> attnlab -> GGUF is the same file: every metadata key of the source (written as
  llama.cpp's converter writes it, tests/helpers/gguf_writing.py) with its value, every tensor with
  its storage type and bytes (F32 bit for bit; Q8_0 / Q4_0 / Q4_1 / F16 / BF16 re-quantized from the
  dequantized values to the same blocks), read back by the gguf package's own reader;
- transformers -> attnlab -> GGUF (f32) -> attnlab gives transformers' logits within fp32 rounding;
- storage types follow llama.cpp's converter (norms, biases, 1-D tensors and routers F32; rows
  that are not whole blocks F16), and what cannot be written is refused with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnlab as al
from attnlab.interop.converter import ConversionError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from attnlab.interop.gguf import load_gguf  # noqa: E402
from attnlab.interop.gguf.writer import (  # noqa: E402
    Vocab,
    save_gguf,
    storage_type,
    vocab_from_gguf,
)
from helpers.gguf_families import FAMILIES, tiny  # noqa: E402
from helpers.gguf_writing import GEMMA_TEMPLATE, TEMPLATE, write_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
# keys the writer adds that the converter emulation (tests/helpers/gguf_writing.py) leaves out
OWN_KEYS = {"general.type", "general.file_type", "general.quantization_version"}
# source keys attnlab's config does not carry, none of which llama.cpp's graph for that
# architecture reads: Qwen3-MoE's dense intermediate_size (every layer is sparse; attnlab writes
# the expert width there), and an rms_norm_eps the tiny Cohere config was given besides its
# layer_norm_eps (CohereConfig keeps unknown keys; a real Command R config.json has none)
UNCARRIED = {"qwen3moe.feed_forward_length", "command-r.attention.layer_norm_rms_epsilon"}


def _source(tmp_path, family: str, types: dict | None = None):
    arch, _, _, tokenizer, _ = FAMILIES[family]
    template = GEMMA_TEMPLATE if arch.startswith("gemma") else TEMPLATE
    hf = tiny(family)
    return hf, write_gguf(tmp_path / "src.gguf", hf, arch, tokenizer=tokenizer, template=template,
                          types=types)  # fmt: skip


def _fields(path) -> tuple[dict, dict]:
    """(metadata key -> (value, types), tensor name -> (type, shape, bytes)) of a GGUF file."""
    from attnlab.interop.gguf.reader import _value

    r = gguf.GGUFReader(str(path))
    keys = {
        k: (_value(f), tuple(f.types)) for k, f in r.fields.items() if not k.startswith("GGUF.")
    }
    tensors = {t.name: (t.tensor_type, tuple(t.shape), bytes(t.data)) for t in r.tensors}
    return keys, tensors


def _same_file(src, out) -> None:
    want_keys, want_tensors = _fields(src)
    got_keys, got_tensors = _fields(out)
    assert set(got_keys) - set(want_keys) == OWN_KEYS
    for k, v in want_keys.items():
        if k not in UNCARRIED:
            assert got_keys[k] == v, k
    assert sorted(got_tensors) == sorted(want_tensors)  # the converter's names (order is free)
    for name, (qtype, shape, data) in want_tensors.items():
        assert got_tensors[name][:2] == (qtype, shape), name
        assert got_tensors[name][2] == data, name


def _keep(path):
    """A tensor name -> its storage type in the file at path (to re-write each as it was)."""
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    return kinds.get


@pytest.mark.hf
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_to_attnlab_to_gguf_is_the_same_file(tmp_path, family):
    _, src = _source(tmp_path, family)
    g = load_gguf(src)
    out = save_gguf(g.model, tmp_path / "out.gguf", vocab=vocab_from_gguf(src), name=g.name)
    _same_file(src, out)


@pytest.mark.hf
@pytest.mark.parametrize("family", ["llama3", "qwen3moe", "gemma2", "deepseek-v3"])
def test_quantized_tensors_are_requantized_to_the_same_blocks(tmp_path, family):
    """Q8_0 attention, Q4_0 / Q4_1 feed-forward maps, F16 / BF16 others (the expert stacks, the
    embedding): dequantized by the reader, quantized again by the writer."""
    types = {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.F16,
             "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_1, "ffn_down": Q.BF16, "token_embd": Q.Q8_0}  # fmt: skip
    _, src = _source(tmp_path, family, types)
    g = load_gguf(src)
    out = save_gguf(
        g.model, tmp_path / "out.gguf", vocab=vocab_from_gguf(src), name=g.name, types=_keep(src)
    )
    _same_file(src, out)
    assert {t for t, _, _ in _fields(out)[1].values()} >= {Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16}


@pytest.mark.hf
@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_to_gguf_and_back_gives_its_logits(tmp_path, family):
    hf, src = _source(tmp_path, family)
    ours = al.interop.from_hf(hf)
    out = save_gguf(ours, tmp_path / "out.gguf", vocab=vocab_from_gguf(src))
    back = load_gguf(out).model
    ids = torch.randint(
        3, hf.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        got, want = back(ids).logits, hf(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.hf
@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_each_outtype_stores_the_weights_as_the_converter_does(tmp_path, outtype):
    _, src = _source(tmp_path, "qwen3moe")
    g = load_gguf(src)
    out = save_gguf(g.model, tmp_path / "out.gguf", vocab=vocab_from_gguf(src), outtype=outtype)
    reader = gguf.GGUFReader(str(out))
    for t in reader.tensors:
        a = np.zeros(tuple(reversed(t.shape.tolist())), np.float32)
        assert t.tensor_type == storage_type(t.name, a, outtype), t.name
    stored = {t.name: t.tensor_type for t in reader.tensors}
    assert stored["blk.0.attn_norm.weight"] == Q.F32  # norms
    assert stored["blk.0.ffn_gate_inp.weight"] == Q.F32  # the router
    assert stored["blk.0.attn_q.weight"] == Q[outtype.upper()]
    meta = reader.fields["general.file_type"]
    assert (
        int(meta.parts[meta.data[0]][0])
        == gguf.LlamaFileType[
            {"f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16"}.get(outtype, f"MOSTLY_{outtype.upper()}")
        ]
    )
    # the file loads, and its logits are the source's within the storage's rounding
    ids = torch.randint(3, g.model.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = (load_gguf(out).model(ids).logits - g.model(ids).logits).abs().max().item()
    assert err < {"f16": 0.02, "bf16": 0.1}.get(outtype, 0.5), err


def test_rows_that_are_not_whole_blocks_fall_back_to_f16():
    """llama.cpp's converter: QuantError -> F16 (a row of 48 is not whole Q8_0 blocks of 32)."""
    from attnlab.interop.gguf.writer import encode

    data, qtype = encode(np.ones((4, 48), np.float32), Q.Q8_0)
    assert qtype == Q.F16 and data.dtype == np.float16
    data, qtype = encode(np.ones((4, 64), np.float32), Q.Q8_0)
    assert qtype == Q.Q8_0


def test_what_cannot_be_written_is_refused_with_the_reason(tmp_path):
    model = al.build_model(al.presets.tiny(al.presets.get("llama3.2-1b")))
    model.hf_model_type = "llama"
    vocab = Vocab(())
    with pytest.raises(ValueError, match=r"cannot quantize K-quants.*llama-quantize"):
        save_gguf(model, tmp_path / "a.gguf", vocab=vocab, outtype="q4_k")
    with pytest.raises(ValueError, match="outtype 'q3' is not one of f32, f16"):
        save_gguf(model, tmp_path / "a.gguf", vocab=vocab, outtype="q3")
    bert = al.build_model(al.presets.tiny(al.presets.get("bert-base")))
    bert.hf_model_type = "bert"
    with pytest.raises(ConversionError, match=r"no GGUF writer for model_type 'bert'.*--to hf"):
        save_gguf(bert, tmp_path / "b.gguf", vocab=vocab)
    assert not list(tmp_path.iterdir())  # nothing written, not even a partial


def _falcon(**changes):
    cfg = al.presets.tiny(al.presets.get("falcon-7b"))
    model = al.build_model(cfg.model_copy(update=changes))
    model.hf_model_type = "falcon"
    return model


def test_falcon_that_llama_cpp_does_not_compute_is_refused(tmp_path):
    """llama.cpp's falcon graph (src/models/falcon.cpp) runs the parallel block only and loads no
    linear biases; both are Falcon checkpoints transformers holds, so the HF folder is the way."""
    with pytest.raises(ConversionError, match=r"sequential Falcon block .* --to hf"):
        save_gguf(_falcon(residual="sequential"), tmp_path / "a.gguf", vocab=Vocab(()))
    attention = al.presets.tiny(al.presets.get("falcon-7b")).attention
    biased = _falcon(attention=attention.model_copy(update={"qkv_bias": True, "o_bias": True}),
                     ffn=al.config.DenseFFN(activation="gelu", bias=True))  # fmt: skip
    with pytest.raises(ConversionError, match=r"Falcon with linear biases .* --to hf"):
        save_gguf(biased, tmp_path / "b.gguf", vocab=Vocab(()))
    assert not list(tmp_path.iterdir())
    save_gguf(_falcon(), tmp_path / "c.gguf", vocab=Vocab(()))  # the 7B layout is written


def test_falcon_layout_is_read_back_from_the_head_counts_and_norms(tmp_path):
    """The file states no layout flags: multi-query 7B, GQA with two norms (40B) and with one
    (Falcon 2) come back as transformers' layouts; the fused q/k/v is stored as the converter
    re-orders it, [every query | every key | every value] from transformers' per-group rows."""
    from attnlab.interop.converter import converter_for

    for family, want in [
        ("falcon", dict(new_decoder_architecture=False, multi_query=True, num_kv_heads=1)),
        ("falcon-40b", dict(new_decoder_architecture=True, num_kv_heads=2)),
        ("falcon2-11b", dict(new_decoder_architecture=True, num_ln_in_parallel_attn=1)),
    ]:
        hf, src = _source(tmp_path, family)
        cfg = load_gguf(src).model.config
        back = converter_for("falcon").config_to_hf(cfg)
        assert {k: back[k] for k in want} == want, family
        qkv = hf.transformer.h[0].self_attention.query_key_value.weight.detach().numpy()
        stored = next(
            t for t in gguf.GGUFReader(str(src)).tensors if t.name == "blk.0.attn_qkv.weight"
        )
        rows = np.asarray(stored.data).reshape(qkv.shape)
        h, kv, d = cfg.n_heads, cfg.kv_heads, cfg.d_model // cfg.n_heads
        groups = qkv.reshape(kv, h // kv + 2, d, -1)  # transformers: [q_1..q_g, k, v] per group
        np.testing.assert_array_equal(rows[: h * d], groups[:, :-2].reshape(h * d, -1))
        np.testing.assert_array_equal(rows[h * d : (h + kv) * d], groups[:, -2].reshape(kv * d, -1))
        np.testing.assert_array_equal(rows[(h + kv) * d :], groups[:, -1].reshape(kv * d, -1))


@pytest.mark.hf
def test_deepseek_v2_group_routing_warns_that_llama_cpp_routes_otherwise(tmp_path, recwarn):
    hf, src = _source(tmp_path, "deepseek-v2")  # 1 of 2 groups, group-limited greedy
    with pytest.warns(RuntimeWarning, match=r"group-limited routing \(1 of 2 expert groups\)"):
        save_gguf(al.interop.from_hf(hf), tmp_path / "v2.gguf", vocab=vocab_from_gguf(src))
    hf, src = _source(tmp_path, "deepseek-v3")  # sigmoid routing: llama.cpp's own
    recwarn.clear()
    save_gguf(al.interop.from_hf(hf), tmp_path / "v3.gguf", vocab=vocab_from_gguf(src))
    assert not [w for w in recwarn if "routing" in str(w.message)]
