"""Log-mel features for Whisper's encoder (Radford et al. 2022, arXiv:2212.04356, section 2.2):
"All audio is re-sampled to 16,000 Hz, and an 80-channel log-magnitude Mel spectrogram
representation is computed on 25-millisecond windows with a stride of 10 milliseconds."

    waveform (16 kHz) ─ pad / cut to 30 s ─ |STFT|² (Hann 400, hop 160, centred) ─ mel filters
                      ─ log10 (floor 1e-10) ─ max(·, max − 8) ─ (· + 4) / 4 ──► (n_mels, 3000)

The mel filter bank is Slaney's (the Auditory Toolbox's, librosa's default and openai/whisper's):
the Slaney mel scale (linear, 3 mels per 200 Hz, below 1 kHz; logarithmic above) with triangular
filters from 0 to 8 kHz, each scaled to unit area ("norm slaney": 2 / bandwidth). The dynamic
range is clipped to 8 decades (80 dB) below each clip's loudest bin, then mapped to about [-1, 1].
The STFT's last frame is dropped, so 30 s give 3000 frames: the encoder's 2·1500 input.

This follows transformers' WhisperFeatureExtractor (`_torch_extract_fbank_features`, its
`mel_filter_bank(norm="slaney", mel_scale="slaney")`), which tests/interop/test_whisper.py checks it
against; no librosa. Clips longer than 30 s are truncated (Whisper's long-form transcription,
which slides a 30 s window, is not implemented here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

SAMPLING_RATE = 16_000
N_FFT, HOP_LENGTH, CHUNK_SECONDS = 400, 160, 30


def hertz_to_mel(freq: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale: 3 mels per 200 Hz up to 1 kHz (15 mels), then log-spaced, 27 mels
    per factor 6.4."""
    log_step = math.log(6.4) / 27.0
    linear = 3.0 * freq / 200.0
    return torch.where(freq >= 1000.0, 15.0 + torch.log(freq / 1000.0) / log_step, linear)


def mel_to_hertz(mels: torch.Tensor) -> torch.Tensor:
    """The inverse of `hertz_to_mel`."""
    log_step = math.log(6.4) / 27.0
    linear = 200.0 * mels / 3.0
    return torch.where(mels >= 15.0, 1000.0 * torch.exp(log_step * (mels - 15.0)), linear)


def mel_filter_bank(
    n_mels: int,
    n_fft: int = N_FFT,
    sampling_rate: int = SAMPLING_RATE,
    f_min: float = 0.0,
    f_max: float = 8000.0,
) -> torch.Tensor:
    """(n_fft // 2 + 1, n_mels) triangular filters, Slaney mel scale and area normalisation,
    computed in float64 and returned in float32."""
    n_freqs = n_fft // 2 + 1
    fft_freqs = torch.linspace(0, sampling_rate // 2, n_freqs, dtype=torch.float64)  # (F,)
    lo, hi = hertz_to_mel(torch.tensor([f_min, f_max], dtype=torch.float64))
    edges = mel_to_hertz(torch.linspace(lo, hi, n_mels + 2, dtype=torch.float64))  # (M + 2,)
    width = edges.diff()  # (M + 1,): the rise of filter m spans width[m], its fall width[m + 1]
    dist = edges[None, :] - fft_freqs[:, None]  # (F, M + 2): edge minus bin frequency
    rising = -dist[:, :-2] / width[:-1]  # (F, M): 0 at the left edge, 1 at the centre
    falling = dist[:, 2:] / width[1:]  # (F, M): 1 at the centre, 0 at the right edge
    filters = torch.clamp(torch.minimum(rising, falling), min=0.0)
    area = 2.0 / (edges[2:] - edges[:-2])  # (M,): Slaney's norm, unit area per filter
    return (filters * area[None, :]).float()


def pad_or_trim(
    audio: torch.Tensor | Sequence, n_samples: int = CHUNK_SECONDS * SAMPLING_RATE
) -> torch.Tensor:
    """One clip (T,) or a batch ((B, T) or a list of 1-D clips of any lengths) -> (B, n_samples)
    float32 on the first clip's device: each clip cut or right-padded with silence (zeros)."""
    clips = [audio] if isinstance(audio, torch.Tensor) and audio.dim() == 1 else list(audio)
    if not clips:
        raise ValueError("audio is empty: pass one clip (T,) or a batch of clips")
    device = clips[0].device if isinstance(clips[0], torch.Tensor) else None
    out = torch.zeros(len(clips), n_samples, dtype=torch.float32, device=device)
    for i, clip in enumerate(clips):
        clip = torch.as_tensor(clip, dtype=torch.float32, device=device)
        if clip.dim() != 1:
            raise ValueError(
                f"each clip must be 1-D mono samples, got shape {tuple(clip.shape)}: mix "
                f"channels down (e.g. clip.mean(0)) first"
            )
        n = min(clip.shape[0], n_samples)
        out[i, :n] = clip[:n]
    return out


def log_mel_features(
    audio: torch.Tensor | Sequence, n_mels: int = 80, sampling_rate: int = SAMPLING_RATE
) -> torch.Tensor:
    """16 kHz mono audio -> Whisper's input_features (B, n_mels, 3000), float32.

    audio: one clip (T,), a batch (B, T), or a list of clips of different lengths, in [-1, 1];
    each is cut or padded with silence to 30 s. n_mels: 80 (Whisper up to large-v2) or 128
    (large-v3)."""
    if sampling_rate != SAMPLING_RATE:
        raise ValueError(
            f"sampling_rate {sampling_rate}: Whisper's features are for {SAMPLING_RATE} Hz audio; "
            f"resample first (e.g. torchaudio.functional.resample(x, {sampling_rate}, 16000))"
        )
    x = pad_or_trim(audio)  # (B, 480000)
    window = torch.hann_window(N_FFT, device=x.device)  # periodic, as torch.stft's usual one
    spec = torch.stft(x, N_FFT, HOP_LENGTH, window=window, return_complex=True)  # (B, F, 3001)
    power = spec[..., :-1].abs() ** 2  # (B, F, 3000): the last frame dropped
    mel = mel_filter_bank(n_mels).to(x.device).T @ power  # (M, F) @ (B, F, N) -> (B, M, N)
    log = torch.clamp(mel, min=1e-10).log10()
    peak = log.amax(dim=(1, 2), keepdim=True)  # (B, 1, 1): each clip's loudest bin
    log = torch.maximum(log, peak - 8.0)  # at most 8 decades (80 dB) of range
    return (log + 4.0) / 4.0
