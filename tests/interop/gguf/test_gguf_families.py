"""`load_gguf` on the llama.cpp architectures of the issue-19 families, against transformers.

No real GGUF file of these families is available offline: each test builds a tiny random-weight
transformers model, writes it as llama.cpp's converter would (tests/helpers/gguf_writing.py: its
metadata keys, tensor names, permutations, norm offsets, split experts, generated RoPE tensors,
tokenizer), loads the file with `load_gguf` and compares the logits with the model it was written
from (F32 storage: within 1e-4), at a length past the sliding window and, where the family scales
RoPE, past the original context (8x for Llama 3's factor 8, 4x elsewhere). The SentencePiece
tokenizers are checked against transformers' own GGUF tokenizer conversion of the same file.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlab.interop import CONVERTERS
from attnlab.interop.converter import ConversionError

gguf_pkg = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from attnlab.interop.gguf import load_gguf  # noqa: E402
from attnlab.interop.gguf.archs.llama import llama3_from_factors  # noqa: E402
from attnlab.interop.gguf.config import gguf_config  # noqa: E402
from attnlab.interop.gguf.reader import read_metadata  # noqa: E402
from attnlab.interop.gguf.tokenizer import tokenizer_from_gguf  # noqa: E402
from helpers.gguf_families import FAMILIES, LLAMA3, MODEL_TYPES, SMALL, tiny  # noqa: E402
from helpers.gguf_writing import (  # noqa: E402
    GEMMA_TEMPLATE,
    TEMPLATE,
    llama3_rope_factors,
    spm_vocab,
    vocab_size,
    write_gguf,
)

Q = gguf_pkg.GGMLQuantizationType


def _ids(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (2, n), generator=g)


def _needs_converter(family: str) -> None:
    if MODEL_TYPES[family] not in CONVERTERS:
        pytest.skip(f"the {MODEL_TYPES[family]} converter is not in this attnlab")


@pytest.mark.hf
@pytest.mark.parametrize("family", list(FAMILIES))
def test_f32_file_is_the_model_it_was_written_from(tmp_path, family):
    _needs_converter(family)
    arch, _, _, tokenizer, length = FAMILIES[family]
    hf = tiny(family)
    template = GEMMA_TEMPLATE if arch.startswith("gemma") else TEMPLATE
    path = write_gguf(tmp_path / "m.gguf", hf, arch, tokenizer=tokenizer, template=template)
    g = load_gguf(path)
    assert g.model.hf_model_type == MODEL_TYPES[family]
    ids = _ids(length, hf.config.vocab_size)
    with torch.no_grad():
        got, want = g.model(ids).logits, hf(ids).logits
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= 1e-4, f"{family}: logits differ by {err:.2e} at length {length}"
    assert g.chat_template == template
    assert g.name == f"tiny-{arch}"


@pytest.mark.hf
@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma2", "gemma3"])
def test_sentencepiece_tokenizer_equals_transformers(tmp_path, arch):
    """The three ways SentencePiece vocabularies write spaces (Llama's Metaspace, Phi-3's
    normalizer, Gemma's, with its all-space piece stored as spaces) against transformers'
    GGUF tokenizer conversion of the same file; a BOS by default (no add_bos_token key)."""
    family = {"llama": "llama3", "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3"}[arch]
    _, stem, config, _, _ = FAMILIES[family]
    cfg_name, _, model_stem = stem.partition("/")
    cfg = getattr(transformers, cfg_name if model_stem else f"{stem}Config")(
        vocab_size=vocab_size("spm", arch), **config
    )
    hf = getattr(transformers, f"{model_stem or stem}ForCausalLM")(cfg)
    path = write_gguf(
        tmp_path / "t.gguf", hf, arch, tokenizer="spm", add_bos=None, template=GEMMA_TEMPLATE
    )
    tok = tokenizer_from_gguf(read_metadata(gguf_pkg.GGUFReader(path)))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = [
        "the world", " the  world\n", "héllo wörld 日本語 😀", "hello<end_of_turn>x",
        "<|user|>hi<|end|>", "", "   ", "a\tb", "  x  ",
    ]  # fmt: skip
    tokens = spm_vocab(arch)[0]
    for text in texts:
        ids = tok.encode(text).ids
        assert ids == ref(text).input_ids, text
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
    assert tok.encode("x").ids[0] == spm_vocab(arch)[3]["bos"]  # BOS by default
    # the merges were recovered: "▁world" is one piece (Gemma adds no prefix space), the bytes
    # of "日" are byte pieces
    word = " world" if arch.startswith("gemma") else "world"
    assert tok.encode(word, add_special_tokens=False).ids == [tokens.index("▁world")]
    assert tokens.index("<0xE6>") in tok.encode("日", add_special_tokens=False).ids


def test_llama3_parameters_are_recovered_from_rope_freqs():
    """llama.cpp writes Llama 3's scaling only as the divisor of each frequency (rope_freqs);
    the parameters come back exactly for Llama 3.1 (factor 8, 8192) and 3.2 (factor 32) at their
    real base and head size, and for the tiny test model."""
    for factor, base, dim, length, high in (
        (8.0, 500000.0, 128, 8192, 4.0),
        (32.0, 500000.0, 64, 8192, 4.0),
        (8.0, 10000.0, 32, 32, 4.0),
        (4.0, 10000.0, 64, 64, 8.0),
    ):
        rope = dict(LLAMA3, rope_theta=base, factor=factor, high_freq_factor=high,
                    original_max_position_embeddings=length)  # fmt: skip
        hp = dict(
            rope_parameters=rope,
            head_dim=dim,
            hidden_size=dim,
            num_attention_heads=1,
            original_max_position_embeddings=length,
        )
        got = llama3_from_factors(llama3_rope_factors(hp), base, dim)
        assert got == dict(
            rope_type="llama3",
            factor=factor,
            low_freq_factor=1.0,
            high_freq_factor=high,
            original_max_position_embeddings=length,
        ), (factor, base, dim)
    assert llama3_from_factors(np.linspace(1.0, 3.0, 16), 10000.0, 32) == {}


@pytest.mark.hf
def test_llama3_file_carries_its_scaling(tmp_path):
    hf = tiny("llama3")
    g = load_gguf(write_gguf(tmp_path / "m.gguf", hf, "llama"))
    s = g.model.config.positional.scaling
    assert (s.kind, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_len) == (
        "llama3",
        8.0,
        1.0,
        4.0,
        32,
    )


@pytest.mark.hf
@pytest.mark.parametrize(
    "family, types",
    [
        ("qwen3moe", {"exps": Q.Q8_0, "attn_q": Q.F16}),
        ("gpt-oss", {"exps": Q.MXFP4, "attn_v": Q.Q8_0}),
    ],
)
def test_quantized_experts_are_the_dequantized_model(tmp_path, family, types):
    """Expert tensors stored quantized (Q8_0; GPT-OSS's MXFP4, which the installed gguf package
    dequantizes): the model equals the transformers model given the dequantized weights."""
    _needs_converter(family)
    arch, _, _, tokenizer, length = FAMILIES[family]
    hf = tiny(family)
    path = write_gguf(tmp_path / "q.gguf", hf, arch, tokenizer=tokenizer, types=types)
    g = load_gguf(path)
    reader = gguf_pkg.GGUFReader(path)
    assert {t.tensor_type for t in reader.tensors} >= set(types.values())
    # the reference: transformers' model with every weight replaced by the file's dequantized one
    ref = load_gguf(write_gguf(tmp_path / "f.gguf", hf, arch, tokenizer=tokenizer))
    ref.model.load_state_dict(g.model.state_dict())
    ids = _ids(length, hf.config.vocab_size)
    with torch.no_grad():
        exact, got = hf(ids).logits, g.model(ids).logits
        torch.testing.assert_close(got, ref.model(ids).logits, atol=0, rtol=0)
    assert (got - exact).abs().max() > 0, "quantized experts came back exact: were they stored so?"


def test_unsupported_metadata_is_refused_by_key(tmp_path):
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=vocab_size("gpt2"), **dict(SMALL, intermediate_size=32))
    )
    cases = [
        ({"llama.attention.head_count_kv": [2, 1]}, r"head_count\(_kv\) = .*a head count per layer"),
        ({"llama.rope.scaling.type": "yarn"}, r"rope\.scaling\.type = 'yarn': supported: .*yarn' for gpt-oss"),
        ({"llama.rope.dimension_count": 8}, r"rope\.dimension_count = 8: .*partial rotary"),
        ({"tensor:blk.0.attn_gate.weight": np.ones((4, 64), np.float32)}, r"cannot place: blk\.0\.attn_gate\.weight"),
        ({"tensor:rope_freqs.weight": np.linspace(1, 3, 8, dtype=np.float32)}, r"rope_freqs\.weight = .*not Llama 3's RoPE scaling"),
    ]  # fmt: skip
    for i, (extra, message) in enumerate(cases):
        with pytest.raises(ConversionError, match=message):
            load_gguf(write_gguf(tmp_path / f"{i}.gguf", hf, "llama", **extra))
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model 'llama' \(SentencePiece\) needs"):
        load_gguf(
            write_gguf(
                tmp_path / "s.gguf",
                hf,
                "llama",
                tokenizer="gpt2",
                **{"tokenizer.ggml.model": "llama"},
            )
        )


@pytest.mark.hf
def test_deepseek_gating_function_is_checked(tmp_path):
    _needs_converter("deepseek-v3")
    hf = tiny("deepseek-v3")
    path = write_gguf(tmp_path / "d.gguf", hf, "deepseek2", **{"deepseek2.expert_gating_func": 3})
    with pytest.raises(ConversionError, match=r"deepseek2\.expert_gating_func = 3: supported"):
        load_gguf(path)


@pytest.mark.parametrize(
    "arch, layers, scalar", [("gemma2", 26, 256), ("gemma2", 46, 144), ("gemma3", 62, 168)]
)
def test_gemma_query_scale_is_llama_cpps(arch, layers, scalar):
    """The file holds no query_pre_attn_scalar: llama.cpp's loader takes d_model / heads for the
    27B models (Gemma 2: 46 layers, 4608 / 32 = 144; Gemma 3: 62, 5376 / 32 = 168) and the head
    size (256) for the others, which is what their config.json files state."""
    d_model = {26: 2304, 46: 4608, 62: 5376}[layers]
    meta = {
        "general.architecture": arch,
        f"{arch}.block_count": layers,
        f"{arch}.embedding_length": d_model,
        f"{arch}.attention.head_count": 32 if layers != 26 else 8,
        f"{arch}.attention.head_count_kv": 16 if layers != 26 else 4,
        f"{arch}.attention.key_length": 128 if layers == 46 else 256,
        f"{arch}.attention.value_length": 128 if layers == 46 else 256,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.attention.sliding_window": 4096,
        f"{arch}.feed_forward_length": 9216,
        f"{arch}.context_length": 8192,
    }
    hf = gguf_config(meta, {"token_embd.weight"})
    assert hf["query_pre_attn_scalar"] == scalar
    kinds = hf["layer_types"]
    assert kinds[:6] == (
        ["sliding_attention", "full_attention"] * 3
        if arch == "gemma2"
        else ["sliding_attention"] * 5 + ["full_attention"]
    )


@pytest.mark.hf
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_written_files_read_alike_in_transformers(tmp_path, family, monkeypatch):
    """A second reader checks the writer: transformers' own GGUF loading (its Gemma support
    subtracts llama.cpp's +1 from the norms) reads the same files as the model they were written
    from. It takes query_pre_attn_scalar, the soft-caps and the RoPE bases from its config
    defaults, so the model here has those values (head size 256, caps 50 / 30, bases 1e6 / 1e4)."""
    pytest.importorskip("accelerate")
    arch, stem, config, tokenizer, length = FAMILIES[family]
    config = dict(config, head_dim=256, query_pre_attn_scalar=256)
    if family == "gemma2":
        config.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    else:
        config["rope_parameters"] = {
            "full_attention": dict(rope_type="default", rope_theta=1_000_000.0),
            "sliding_attention": dict(rope_type="default", rope_theta=10_000.0),
        }
    monkeypatch.setitem(FAMILIES, family, (arch, stem, config, tokenizer, length))
    hf = tiny(family)
    path = write_gguf(tmp_path / "m.gguf", hf, arch, tokenizer=tokenizer)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
    ids = _ids(length, hf.config.vocab_size)
    with torch.no_grad():
        want = hf(ids).logits
        assert (ref(ids).logits - want).abs().max() <= 1e-5
        assert (load_gguf(path).model(ids).logits - want).abs().max() <= 1e-4


@pytest.mark.hf
def test_olmo3_file_is_refused(tmp_path):
    """llama.cpp writes OLMo 3 under olmo2 too, with a window (Olmo2Model.set_gguf_parameters):
    refused by key, not read as OLMo 2."""
    path = write_gguf(
        tmp_path / "o.gguf", tiny("olmo2"), "olmo2", **{"olmo2.attention.sliding_window": 16}
    )
    with pytest.raises(ConversionError, match=r"olmo2\.attention\.sliding_window = 16: an OLMo 3"):
        load_gguf(path)


@pytest.mark.hf
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cached_greedy_decoding_equals_transformers_generate(tmp_path, family):
    """The loaded model decodes with attnlab's cache as transformers' generate does with the
    model the file came from (20 + 12 tokens: past every sliding window of 16)."""
    _needs_converter(family)
    import attnlab as al

    arch, _, _, tokenizer, _ = FAMILIES[family]
    hf = tiny(family)
    g = load_gguf(write_gguf(tmp_path / "m.gguf", hf, arch, tokenizer=tokenizer))
    ids = _ids(20, hf.config.vocab_size)[:1]
    with torch.no_grad():
        want = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert al.generate(g.model, ids, 12, eos_token_id=None)[0].tolist() == want[0].tolist()
