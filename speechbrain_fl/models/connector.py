"""Cross-modal connector of the speech-LLM: frame stacking by k, then a projection.

The connector C of the alpha-split paper (Sec. II-A, Eq. 1) maps encoder frames H (B, T, d_enc)
to LLM input embeddings (B, ceil(T/k), d_llm). It concatenates k consecutive frames (the
"downsample by k" of Fig. 1) and projects them with either one linear layer (the paper's Whisper +
TinyLlama/EuroLLM connector, weight + bias) or a 2-layer MLP ``linear_1 -> act -> linear_2`` (the
Voxtral projector). The MLP's submodule names equal those of transformers'
``VoxtralMultiModalProjector`` so Voxtral's pretrained projector loads into it with
``load_state_dict``; Voxtral stacks frames with ``reshape(-1, 4 * d_enc)``, which is exactly the
stacking done here.

Hand-written because neither SpeechBrain nor transformers ships a standalone stack-and-project
module for decoder-only speech-LLMs.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

CONNECTOR_KINDS = ("linear", "mlp")


class FrameStackConnector(nn.Module):
    """Stack ``k`` consecutive encoder frames and project them to the LLM hidden size.

    Arguments
    ---------
    input_size : int
        Encoder output size d_enc.
    output_size : int
        LLM hidden size d_llm.
    downsample_k : int
        Number of frames concatenated into one audio token (sequence length divided by k).
    kind : str
        ``"linear"`` (one ``nn.Linear`` named ``linear``) or ``"mlp"`` (``linear_1``, ``act``,
        ``linear_2`` with hidden size d_llm).
    bias : bool
        Whether the projections have a bias (Voxtral's projector has none).
    activation : str
        transformers activation name for the MLP (Voxtral: ``"gelu"``).

    Example
    -------
    >>> conn = FrameStackConnector(input_size=8, output_size=16, downsample_k=4)
    >>> conn(torch.randn(2, 10, 8)).shape
    torch.Size([2, 3, 16])
    """

    def __init__(
        self,
        *,
        input_size: int,
        output_size: int,
        downsample_k: int = 4,
        kind: str = "linear",
        bias: bool = True,
        activation: str = "gelu",
    ) -> None:
        super().__init__()
        if kind not in CONNECTOR_KINDS:
            raise ValueError(f"connector kind {kind!r} is not one of {CONNECTOR_KINDS}")
        if downsample_k < 1:
            raise ValueError(f"downsample_k must be >= 1, got {downsample_k}")
        self.downsample_k = downsample_k
        self.kind = kind
        stacked = input_size * downsample_k
        if kind == "linear":
            self.linear = nn.Linear(stacked, output_size, bias=bias)
        else:
            self.linear_1 = nn.Linear(stacked, output_size, bias=bias)
            self.act = ACT2FN[activation]
            self.linear_2 = nn.Linear(output_size, output_size, bias=bias)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """Number of audio tokens for ``lengths`` valid encoder frames: ceil(T / k)."""
        return torch.div(lengths + self.downsample_k - 1, self.downsample_k, rounding_mode="floor")

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """Map (B, T, d_enc) frames to (B, ceil(T/k), d_llm) audio tokens (zero-padded tail)."""
        batch, time, dim = frames.shape
        remainder = time % self.downsample_k
        if remainder:
            pad = frames.new_zeros(batch, self.downsample_k - remainder, dim)
            frames = torch.cat([frames, pad], dim=1)
        stacked = frames.reshape(batch, -1, dim * self.downsample_k)
        weight = self.linear.weight if self.kind == "linear" else self.linear_1.weight
        stacked = stacked.to(weight.dtype)
        if self.kind == "linear":
            return self.linear(stacked)
        return self.linear_2(self.act(self.linear_1(stacked)))
