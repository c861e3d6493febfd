"""Whisper (Radford et al. 2022, arXiv:2212.04356): the audio frontend against float64 formulas
and transformers' sinusoids, the log-mel features against WhisperFeatureExtractor, and the
`whisper` converter against WhisperForConditionalGeneration — tiny random-weight models built
from configs (no downloads), fp32, eval mode: encoder output, logits with decoder padding, cached
decoding, greedy and beam generation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attnlab as al
from attnlab.config import ConfigError, ModelConfig
from attnlab.data.audio import log_mel_features, mel_filter_bank
from attnlab.interop import ConversionError
from attnlab.nn.frontends.audio import AudioEmbedding, whisper_sinusoids

TOL = 1e-4
# ids chosen apart from 0: transformers' beam search fills finished rows with EOS, not the pad
# id, when the pad id is 0 (`pad_token_id or eos_token_id`, a tensor 0 being falsy)
IDS = dict(pad_token_id=4, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3)
SIZES = dict(
    vocab_size=96, d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=8,
    max_source_positions=12, max_target_positions=40,
)  # fmt: skip


def _transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def hf_model(seed: int = 0, **over) -> torch.nn.Module:
    """A WhisperForConditionalGeneration with every parameter moved off its init (norms off 1,
    biases off 0), so a swapped or dropped tensor shows."""
    transformers = _transformers()
    torch.manual_seed(seed)
    values = {**SIZES, **IDS, "begin_suppress_tokens": None, **over}
    config = transformers.WhisperConfig(**values, attn_implementation="eager")
    model = transformers.WhisperForConditionalGeneration(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_positions.weight") and ".encoder." in name:
                continue  # the frozen sinusoids stay what Whisper computes
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def features(b: int = 3, frames: int = 24, mels: int = 8, seed: int = 2) -> torch.Tensor:
    return torch.randn(b, mels, frames, generator=torch.Generator().manual_seed(seed))


# --- the frontend ---------------------------------------------------------------------------------


def test_sinusoids_equal_whisper_bit_for_bit() -> None:
    modeling = pytest.importorskip("transformers.models.whisper.modeling_whisper")
    for length, channels in ((1500, 384), (1500, 512), (7, 8)):
        assert torch.equal(
            whisper_sinusoids(length, channels), modeling.sinusoids(length, channels)
        )


def test_sinusoids_follow_the_formula() -> None:
    """sin(t · 10000^(-i / (d/2 - 1))) then cos, in float64: the layout and frequencies."""
    length, d = 50, 16
    t = torch.arange(length, dtype=torch.float64)[:, None]
    i = torch.arange(d // 2, dtype=torch.float64)[None, :]
    angle = t * 10000.0 ** (-i / (d // 2 - 1))
    ref = torch.cat([angle.sin(), angle.cos()], dim=1)
    assert (whisper_sinusoids(length, d).double() - ref).abs().max() < 1e-5


def test_frontend_equals_its_float64_formula() -> None:
    """conv (k 3, pad 1, stride 1) + GELU, conv (k 3, pad 1, stride 2) + GELU, + table, written
    as explicit sums over the kernel taps."""
    torch.manual_seed(0)
    fe = AudioEmbedding(d_model=16, num_mel_bins=6, max_source_positions=5).double()
    with torch.no_grad():
        fe.conv1.bias.normal_()
        fe.conv2.bias.normal_()
    x = torch.randn(2, 6, 10, dtype=torch.float64)

    def conv(x, w, b, stride):
        xp = F.pad(x, (1, 1))  # (B, C, T + 2)
        n = (x.shape[-1] - 1) // stride + 1
        cols = [sum(w[:, :, k] @ xp[:, :, t * stride + k].T for k in range(3)).T for t in range(n)]
        return torch.stack(cols, dim=-1) + b[None, :, None]

    def gelu(v):
        return 0.5 * v * (1 + torch.erf(v / math.sqrt(2)))

    h = gelu(conv(x, fe.conv1.weight, fe.conv1.bias, 1))
    h = gelu(conv(h, fe.conv2.weight, fe.conv2.bias, 2)).transpose(1, 2)
    ref = h + whisper_sinusoids(5, 16).double()
    assert (fe(x) - ref).abs().max() < 1e-12


def test_the_table_is_a_frozen_parameter_that_init_leaves_alone() -> None:
    cfg = al.presets.tiny(al.presets.get("whisper-tiny"))
    model = al.build_model(cfg)
    table = model.frontend.embed_positions
    assert not table.requires_grad
    assert torch.equal(table, whisper_sinusoids(16, cfg.d_model))
    assert any(p is table for p in model.parameters())  # counted, as transformers counts it


@pytest.mark.parametrize(
    ("x", "error", "words"),
    [
        (torch.zeros(2, 8, 24, dtype=torch.long), TypeError, ["floating point", "log_mel"]),
        (torch.zeros(8, 24), ValueError, ["(batch, num_mel_bins 8, frames)", "features[None]"]),
        (torch.zeros(2, 7, 24), ValueError, ["num_mel_bins 8"]),
        (torch.zeros(2, 8, 20), ValueError, ["20 frames", "exactly 24", "pad or truncate"]),
    ],
)
def test_frontend_refuses_bad_features(x, error, words) -> None:
    fe = AudioEmbedding(d_model=16, num_mel_bins=8, max_source_positions=12)
    with pytest.raises(error) as info:
        fe(x)
    for w in words:
        assert w in str(info.value)


# --- log-mel features -----------------------------------------------------------------------------


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filter_bank_equals_transformers(n_mels: int) -> None:
    audio_utils = pytest.importorskip("transformers.audio_utils")
    ref = audio_utils.mel_filter_bank(
        num_frequency_bins=201,
        num_mel_filters=n_mels,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=16000,
        norm="slaney",
        mel_scale="slaney",
    )
    assert (mel_filter_bank(n_mels).double() - torch.from_numpy(ref)).abs().max() < 1e-7


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_equals_whisper_feature_extractor(n_mels: int) -> None:
    """A tone in noise (7 s, padded), 31 s of noise (truncated), and near-silence."""
    transformers = _transformers()
    g = torch.Generator().manual_seed(0)
    t = torch.arange(16000 * 7) / 16000
    clips = [
        0.5 * torch.sin(2 * math.pi * 440 * t) + 0.05 * torch.randn(t.shape, generator=g),
        0.1 * torch.randn(16000 * 31, generator=g),
        1e-4 * torch.randn(1000, generator=g),
    ]
    fe = transformers.WhisperFeatureExtractor(feature_size=n_mels)
    ref = fe([c.numpy() for c in clips], sampling_rate=16000, return_tensors="pt").input_features
    ours = log_mel_features(clips, n_mels=n_mels)
    assert ours.shape == ref.shape == (3, n_mels, 3000)
    assert (ours - ref).abs().max() < TOL
    one = log_mel_features(clips[0], n_mels=n_mels)  # a single clip: a batch of one
    assert torch.equal(one, ours[:1])


def test_log_mel_refuses_other_rates_and_stereo() -> None:
    with pytest.raises(ValueError, match="resample first"):
        log_mel_features(torch.zeros(8000), sampling_rate=8000)
    with pytest.raises(ValueError, match="mono"):
        log_mel_features([torch.zeros(2, 100)])


# --- config rules ----------------------------------------------------------------------------------

AUDIO = dict(
    arch="encoder-decoder",
    vocab_size=32,
    d_model=16,
    n_layers=1,
    n_heads=2,
    positional={"kind": "learned", "max_len": 8},
    frontend={"kind": "audio", "num_mel_bins": 4, "max_source_positions": 4},
)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (dict(arch="encoder"), ["frontend ('audio')", "only for arch 'encoder-decoder'"]),
        (dict(vocab_size=0), ["vocab_size (0) must be > 0", "decoder reads"]),
        (dict(share_encoder_decoder_embeddings=False), ["set it to True"]),
        (dict(attention={"k_bias": False}), ["k_bias (False)", "remove k_bias"]),
    ],
)
def test_audio_config_rules(change: dict, words: list[str]) -> None:
    ModelConfig.from_dict(AUDIO)  # valid as it is
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict({**AUDIO, **change})
    for w in words:
        assert w in str(info.value)


def test_model_with_an_audio_frontend_refuses_token_ids_and_masks() -> None:
    model = al.build_model(ModelConfig.from_dict(AUDIO)).eval()
    x, dec = torch.randn(2, 4, 8), torch.zeros(2, 3, dtype=torch.long)
    assert model(input_features=x, decoder_input_ids=dec).logits.shape == (2, 3, 32)
    with pytest.raises(ValueError, match="reads input_features"):
        model(torch.zeros(2, 8, dtype=torch.long), dec)
    with pytest.raises(ValueError, match="attends to every frame"):
        model(input_features=x, decoder_input_ids=dec, attention_mask=torch.ones(2, 8))
    plain = al.build_model(ModelConfig.from_dict({**AUDIO, "frontend": None}))
    with pytest.raises(ValueError, match="has no frontend"):
        plain(dec, dec, input_features=x)


# --- the converter ---------------------------------------------------------------------------------


def _compare(hf, ours, x, dec, mask) -> tuple[float, float]:
    with torch.no_grad():
        ref = hf(input_features=x, decoder_input_ids=dec, decoder_attention_mask=mask)
        out = ours(input_features=x, decoder_input_ids=dec, decoder_attention_mask=mask)
    enc = (out.encoder_hidden - ref.encoder_last_hidden_state).abs().max().item()
    real = mask.bool()  # padded positions' logits are nobody's business
    return enc, (out.logits[real] - ref.logits[real]).abs().max().item()


def test_parity_both_directions_with_decoder_padding() -> None:
    hf = hf_model()
    ours = al.interop.from_hf(hf).eval()
    x = features()
    dec = torch.randint(5, 96, (3, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(dec)
    mask[1, 6:] = 0  # right padding, as transformers' collators pad labels
    mask[2, 3:] = 0
    enc, logits = _compare(hf, ours, x, dec, mask)
    assert enc < TOL and logits < TOL, (enc, logits)
    back = al.interop.to_hf(ours)
    enc, logits = _compare(back, ours, x, dec, mask)
    assert enc < TOL and logits < TOL, (enc, logits)
    ref_sd, back_sd = hf.state_dict(), back.state_dict()
    assert sorted(ref_sd) == sorted(back_sd)
    assert all(torch.equal(ref_sd[k], back_sd[k]) for k in ref_sd)
    # the decoder padding is really used: without the mask the padded rows' logits change
    with torch.no_grad():
        free = ours(input_features=x, decoder_input_ids=dec).logits
        masked = ours(input_features=x, decoder_input_ids=dec, decoder_attention_mask=mask).logits
    assert not torch.allclose(free[1, 7:], masked[1, 7:], atol=1e-3)


def test_parity_untied_head_and_real_length_features() -> None:
    """30 s of log-mel features (3000 frames, 1500 encoder tokens) from our feature function, an
    untied proj_out, and GELU-tanh: what config.json may say, carried both ways."""
    hf = hf_model(
        seed=5,
        num_mel_bins=80,
        max_source_positions=1500,
        tie_word_embeddings=False,
        activation_function="gelu_new",
    )
    ours = al.interop.from_hf(hf).eval()
    assert not ours.config.tie_embeddings and ours.config.ffn.activation == "gelu-tanh"
    g = torch.Generator().manual_seed(0)
    x = log_mel_features([0.1 * torch.randn(16000 * n, generator=g) for n in (3, 12)])
    dec = torch.randint(5, 96, (2, 6), generator=g)
    enc, logits = _compare(hf, ours, x, dec, torch.ones_like(dec))
    assert enc < TOL and logits < TOL, (enc, logits)
    back = al.interop.to_hf(ours)
    assert back.config.tie_word_embeddings is False
    assert torch.equal(back.proj_out.weight, hf.proj_out.weight)


@pytest.mark.parametrize("name", ["whisper-tiny", "whisper-base"])
def test_preset_is_what_the_converter_reads_from_its_config(name: str) -> None:
    """WhisperConfig's defaults are whisper-tiny's sizes; base differs in width and depth."""
    conv = al.interop.converter.converter_for("whisper")
    sizes = {} if name == "whisper-tiny" else dict(d_model=512, encoder_layers=6, decoder_layers=6)
    heads = (
        {} if name == "whisper-tiny" else dict(encoder_attention_heads=8, decoder_attention_heads=8)
    )
    ffn = {} if name == "whisper-tiny" else dict(encoder_ffn_dim=2048, decoder_ffn_dim=2048)
    cfg = conv.config_from_hf({**sizes, **heads, **ffn, "pad_token_id": 50257})
    assert cfg == al.presets.get(name).replace(init=cfg.init)
    assert conv.config_from_hf(conv.config_to_hf(cfg)) == cfg


def test_converter_reports_every_misfit_at_once() -> None:
    conv = al.interop.converter.converter_for("whisper")
    hf = {
        **SIZES,
        "decoder_attention_heads": 2,
        "scale_embedding": True,
        "apply_spec_augment": True,
    }
    with pytest.raises(ConversionError) as info:
        conv.config_from_hf(hf)
    for w in ("decoder_attention_heads", "scale_embedding", "apply_spec_augment"):
        assert w in str(info.value)
    bart = al.presets.tiny(al.presets.get("bart-base"))
    with pytest.raises(ConversionError) as info:
        conv.config_to_hf(bart)
    for w in ("frontend.kind", "norm_placement", "attention.k_bias"):
        assert w in str(info.value)


def test_save_and_load_pretrained_folder(tmp_path) -> None:
    hf = hf_model(seed=7)
    hf.save_pretrained(tmp_path)
    ours = al.interop.load_pretrained(tmp_path).eval()
    x, dec = features(), torch.randint(5, 96, (3, 5))
    enc, logits = _compare(hf, ours, x, dec, torch.ones_like(dec))
    assert enc < TOL and logits < TOL, (enc, logits)


# --- decoding ---------------------------------------------------------------------------------------


def test_cached_decoding_equals_recomputation() -> None:
    """Greedy tokens through the cache (cross-attention K/V computed once) equal an argmax over
    the whole prefix recomputed every step, and so do the step logits."""
    ours = al.interop.from_hf(hf_model(seed=11)).eval()
    ours.generation = None
    x = features()
    got = al.generate(ours, x, max_new_tokens=12, decoder_start_token_id=3)
    seq = torch.full((3, 1), 3)
    with torch.no_grad():
        for _ in range(12):
            logits = ours(input_features=x, decoder_input_ids=seq).logits[:, -1]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
        full = ours(input_features=x, decoder_input_ids=seq).logits
        memory, cache = ours.encode(input_features=x), ours.new_cache(3, 13)
        steps = [ours.decode(seq[:, i : i + 1], memory, cache=cache).logits for i in range(13)]
    assert torch.equal(got, seq)
    assert (torch.cat(steps, dim=1) - full).abs().max() < TOL


def _sequences(hf, x, **kw) -> torch.Tensor:
    with torch.no_grad():
        return hf.generate(x, return_dict_in_generate=True, **kw).sequences


@pytest.mark.parametrize("num_beams", [1, 3])
def test_generation_equals_transformers(num_beams: int) -> None:
    """Assumption (so that transformers' Whisper generate() is plain generation): a generation
    config without lang_to_id / task_to_id / forced_decoder_ids / no_timestamps_token_id, as an
    English-only model built from a config has, so the decoder prompt is the start token alone;
    short-form audio (exactly 2·max_source_positions frames); no temperature fallback. Its
    suppress_tokens and begin_suppress_tokens are set and carried by from_hf. transformers' raw
    `sequences` (return_dict_in_generate) keep the start token and EOS, which its default return
    strips; they are what is compared. EOS is a token a run without EOS emits, so rows end early."""
    extra = dict(suppress_tokens=[7, 8], begin_suppress_tokens=[5, 6])
    probe = al.interop.from_hf(hf_model(seed=13, **extra)).eval()
    x = features(b=4, seed=21)
    probe_ids = al.generate(probe, x, max_new_tokens=4, num_beams=num_beams, eos_token_id=None)
    eos = int(probe_ids[0, 3])
    hf = hf_model(seed=13, **extra, eos_token_id=eos)
    ours = al.interop.from_hf(hf).eval()
    assert ours.generation.suppress_tokens == (7, 8)
    assert ours.generation.begin_suppress_tokens == (5, 6)
    assert (ours.generation.decoder_start_token_id, ours.generation.eos_token_id) == (3, eos)
    ref = _sequences(hf, x, max_new_tokens=14, num_beams=num_beams)
    got = al.generate(ours, x, max_new_tokens=14, num_beams=num_beams)
    assert torch.equal(got, ref), (got, ref)
    assert (got == eos).any(dim=1).any()  # EOS was reached by some row
    assert not torch.isin(got[:, 1:], torch.tensor([7, 8])).any()
    assert not torch.isin(got[:, 1], torch.tensor([5, 6])).any()


def test_generation_with_explicit_settings() -> None:
    """The same decoding with the settings passed by hand instead of model.generation."""
    hf = hf_model(seed=17)
    ours = al.interop.from_hf(hf).eval()
    ours.generation = None
    x = features(b=2, seed=4)
    ref = _sequences(hf, x, max_new_tokens=8, num_beams=2)
    got = al.generate(
        ours,
        x,
        max_new_tokens=8,
        num_beams=2,
        decoder_start_token_id=3,
        eos_token_id=2,
        pad_token_id=4,
    )
    assert torch.equal(got, ref)
