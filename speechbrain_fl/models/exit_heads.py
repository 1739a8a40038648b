"""The exit heads of the multi-exit wav2vec 2.0 (:mod:`speechbrain_fl.models.multi_exit_wav2vec2`).

- :class:`StatPoolHead`: statistical pooling (mean and standard deviation over the valid
  frames, Cai et al., 2018) followed by one linear layer (KWS, SID, ER; ASV embeddings);
- :class:`WeightedSumHead`: SUPERB's frozen-upstream protocol, a learned softmax-weighted sum of
  hidden states before a head;
- :class:`CTCHead`: one frame-level linear layer with log-softmax (ours: the paper describes
  pooled heads only).

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CTCHead", "StatPoolHead", "WeightedSumHead"]


class StatPoolHead(nn.Module):
    """Masked mean and standard deviation over time, then one linear layer.

    Arguments
    ---------
    hidden_size : int
        Frame dimension H.
    num_outputs : int
        Classes (or embedding size).

    Example
    -------
    >>> head = StatPoolHead(4, 3)
    >>> x, mask = torch.randn(2, 5, 4), torch.tensor([[1, 1, 1, 0, 0], [1] * 5]).bool()
    >>> head(x, mask).shape
    torch.Size([2, 3])
    """

    def __init__(self, hidden_size: int, num_outputs: int, pooling: str = "stat") -> None:
        super().__init__()
        if pooling not in ("stat", "mean"):
            raise ValueError(f"pooling: {pooling!r} must be 'stat' or 'mean'")
        self.pooling = pooling
        self.linear = nn.Linear((2 if pooling == "stat" else 1) * hidden_size, num_outputs)

    @staticmethod
    def pool(frames: torch.Tensor, mask: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
        """``[mean, std]`` over the frames where ``mask`` is True -> (B, 2H)."""
        weights = mask.unsqueeze(-1).to(frames.dtype)
        count = weights.sum(dim=1).clamp(min=1.0)
        mean = (frames * weights).sum(dim=1) / count
        var = (((frames - mean.unsqueeze(1)) ** 2) * weights).sum(dim=1) / count
        return torch.cat([mean, torch.sqrt(var + eps)], dim=-1)

    def forward(self, frames: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_outputs): ``[mean, std]`` (``stat``) or the masked mean (``mean``)."""
        pooled = self.pool(frames, mask)
        if self.pooling == "mean":
            pooled = pooled[:, : frames.shape[-1]]
        return self.linear(pooled)


class WeightedSumHead(nn.Module):
    """SUPERB's frozen-upstream protocol: a learned softmax-weighted sum of hidden states.

    ``h = sum_{l=0}^{L} softmax(w)_l * h_l`` over the hidden states 0..L of the exit's depth L
    (``hidden_states`` of ``Wav2Vec2Model``: 0 is the input of layer 1), then the exit's head.

    Example
    -------
    >>> head = WeightedSumHead(StatPoolHead(4, 3), num_states=4)
    >>> states = torch.randn(4, 2, 5, 4)  # (L + 1, B, T, H)
    >>> head(states, torch.ones(2, 5, dtype=torch.bool)).shape
    torch.Size([2, 3])
    """

    def __init__(self, head: nn.Module, num_states: int) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.zeros(num_states))
        self.head = head

    def forward(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``states`` (L + 1, B, T, H) -> the head's output of their weighted sum."""
        weights = torch.softmax(self.weights, dim=0).to(states.dtype)
        return self.head((weights[:, None, None, None] * states).sum(dim=0), mask)


class CTCHead(nn.Module):
    """Frame-level linear character head (ours: the paper describes pooled heads only)."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, vocab_size)

    def forward(self, frames: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Log-probabilities (B, T, V)."""
        del mask
        return self.linear(frames).log_softmax(dim=-1)
