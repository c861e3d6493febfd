"""Audio as a token sequence: Whisper's convolutional stem over log-mel features (Radford et al.
2022, "Robust Speech Recognition via Large-Scale Weak Supervision", arXiv:2212.04356, section
2.2, figure 1).

    log-mel (B, n_mels, 2·P) ─ Conv1d(k 3, stride 1) ─ GELU ─ Conv1d(k 3, stride 2) ─ GELU
                             ─ transpose ─ + sinusoids (P, d_model) ──► (B, P, d_model)

The features are 30 s of 16 kHz audio as an 80- (or 128-) channel log-mel spectrogram with a hop
of 10 ms: 3000 frames (src/attnlab/data/audio.py computes them). Two convolutions of width 3
(padding 1) mix neighbouring frames; the second one's stride 2 halves the rate to one token per
20 ms, so P = max_source_positions = 1500 tokens. Then fixed sinusoidal positions are added, in
Whisper's own layout (`whisper_sinusoids`): all sines, then all cosines, with timescales spread
geometrically from 1 to 10000 over d_model/2 channels, i.e. frequency 10000^(-i/(d/2 - 1)) —
not the 2017 paper's 10000^(-2i/d) (src/attnlab/nn/positional/sinusoidal.py), so the table is
the frontend's own. Like transformers' WhisperEncoder (`embed_positions`, an nn.Embedding with
requires_grad False) it is a frozen parameter: it counts in the parameter total, travels in
checkpoints and is never trained (the init schemes leave frozen parameters alone).

Whisper has no encoder padding: shorter audio is padded with silence to 30 s and the encoder
attends to every frame. So, as transformers and openai/whisper do, the input must have exactly
2·max_source_positions frames.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import FRONTENDS, Frontend


def whisper_sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """(length, channels) table: sin(t·w_i) for i < channels/2, then cos(t·w_i), with
    w_i = max_timescale^(-i / (channels/2 - 1)); in float32 as openai/whisper computes it, so a
    fresh table equals the one its checkpoints carry bit for bit."""
    if channels % 2 or channels < 4:
        raise ValueError(f"sinusoids need an even number of channels >= 4, got {channels}")
    half = channels // 2
    step = math.log(max_timescale) / (half - 1)  # log-spaced timescales from 1 to max_timescale
    freq = torch.exp(-step * torch.arange(half, dtype=torch.float32))  # (half,)
    angle = torch.arange(length)[:, None] * freq[None, :]  # (length, 1) x (1, half): float32
    return torch.cat([angle.sin(), angle.cos()], dim=1)  # (length, channels)


@FRONTENDS.register("audio")
class AudioEmbedding(Frontend):
    input_name = "input_features"

    def __init__(self, *, d_model: int, num_mel_bins: int, max_source_positions: int) -> None:
        """Args:
        d_model: the width of each token (and of both convolutions).
        num_mel_bins: channels of the log-mel input (80; 128 for Whisper large-v3).
        max_source_positions: tokens after the stride-2 convolution, P; the input has 2·P frames.
        """
        super().__init__()
        self.num_mel_bins, self.max_source_positions = num_mel_bins, max_source_positions
        self.conv1 = nn.Conv1d(num_mel_bins, d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)
        table = whisper_sinusoids(max_source_positions, d_model)
        self.embed_positions = nn.Parameter(table, requires_grad=False)  # (P, d_model), fixed

    @property
    def n_frames(self) -> int:
        """Frames of log-mel input the encoder reads: 2·max_source_positions (3000 = 30 s)."""
        return 2 * self.max_source_positions

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        """input_features (B, num_mel_bins, 2·P) log-mel -> (B, P, d_model)."""
        self._check(input_features)
        x = input_features.to(self.conv1.weight.dtype)
        x = F.gelu(self.conv1(x))  # (B, d_model, 2P): exact (erf) GELU, as Whisper
        x = F.gelu(self.conv2(x))  # (B, d_model, P): stride 2
        x = x.transpose(1, 2)  # (B, d_model, P) -> (B, P, d_model)
        return x + self.embed_positions.to(x.dtype)  # (P, d_model) broadcast over B

    def _check(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input_features must be a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(
                f"input_features must be floating point log-mel features, got {x.dtype}: compute "
                f"them from audio with attnlab.data.audio.log_mel_features"
            )
        if x.dim() != 3 or x.shape[1] != self.num_mel_bins:
            raise ValueError(
                f"input_features must be (batch, num_mel_bins {self.num_mel_bins}, frames), got "
                f"shape {tuple(x.shape)}: add a batch dimension with features[None] for one clip"
            )
        if x.shape[2] != self.n_frames:
            raise ValueError(
                f"input_features have {x.shape[2]} frames; this encoder reads exactly "
                f"{self.n_frames} (2 x max_source_positions {self.max_source_positions}): pad or "
                f"truncate the audio first (log_mel_features pads to 30 s), as Whisper does"
            )
