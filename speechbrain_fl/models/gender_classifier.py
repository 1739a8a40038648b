"""Utterance classifiers of the Private-Gender recipe: DSAF front-end, privileged input, dropout.

From "Private Speech Classification without Collapse". The paper gives only
the aims of its parts; every formula below is our choice (YAML keys of
``recipes/Private-Gender/hparams``):

* :class:`DSAF`, the DP-stabilising acoustic front-end, aims at a lower spread of per-sample
  gradient norms. Ours, on log-mel filterbanks ``F`` (T x n_mels) of valid length ``L``:
  per-utterance normalisation with one scalar mean ``m`` and deviation ``s`` over all valid
  entries (``(F - m) / s``, which keeps the spectral shape, hence pitch and formants),
  range compression ``tanh(x / r)`` (bounded in (-1, 1)), and a fixed-length crop of
  ``crop_frames`` frames (random in training, centred otherwise; shorter inputs are tiled), so
  every record has the same length and scale. The encoder's activations are then bounded
  (``tanh``). Without DSAF the raw log-mels (dB scale) of variable length go through ReLU.
* :class:`PrivilegedEncoder` embeds the privileged input ``m`` (transcript words and/or
  metadata fields such as age and accent) as hashed tokens (``zlib.crc32`` into a fixed number
  of buckets: no vocabulary is built from the private data). The label, or any field derived
  from it, is never a token (the recipe refuses such fields).
* :class:`ModalityDropout` drops the whole privileged embedding of a record with probability
  ``p`` in training (one Bernoulli draw per record: no coupling between records, as per-sample
  gradients require).

Every part is per-record (no BatchNorm, no batch statistics), so Opacus's ``ModuleValidator``
accepts the models and per-sample gradients are exact.

Example
-------
>>> model = GenderClassifier(n_mels=40, num_classes=3, dsaf=True, privileged=True)
>>> feats, lengths = torch.randn(2, 120, 40), torch.tensor([120, 90])
>>> tokens = hash_tokens([["age=twenties", "w=hello"], []], buckets=256, max_tokens=4)
>>> model(feats, lengths, tokens).shape
torch.Size([2, 3])
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
from torch import nn

__all__ = [
    "DSAF",
    "AudioEncoder",
    "GenderClassifier",
    "ModalityDropout",
    "PrivilegedEncoder",
    "hash_tokens",
]


def hash_tokens(records: Sequence[Sequence[str]], *, buckets: int, max_tokens: int) -> torch.Tensor:
    """Token ids in [1, buckets) by ``crc32(token) % (buckets - 1) + 1``, 0-padded.

    Example
    -------
    >>> hash_tokens([["a", "b"], ["a"]], buckets=16, max_tokens=3).tolist()
    [[13, 12, 0], [13, 0, 0]]
    """
    if buckets < 2:
        raise ValueError(f"buckets must be >= 2, got {buckets}")
    out = torch.zeros(len(records), max_tokens, dtype=torch.long)
    for i, tokens in enumerate(records):
        ids = [zlib.crc32(t.encode("utf-8")) % (buckets - 1) + 1 for t in tokens][:max_tokens]
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def _mask(lengths: torch.Tensor, frames: int) -> torch.Tensor:
    return torch.arange(frames, device=lengths.device)[None, :] < lengths[:, None]


class DSAF(nn.Module):
    """Per-utterance normalisation, range compression and fixed-length crops (module docstring).

    Arguments
    ---------
    crop_frames : int
        Frames kept per record.
    compress_scale : float
        ``r`` of ``tanh(x / r)``.

    Example
    -------
    >>> x, n = DSAF(crop_frames=50).eval()(torch.randn(2, 80, 40) * 30, torch.tensor([80, 30]))
    >>> x.shape, n.tolist(), bool(x.abs().max() < 1)
    (torch.Size([2, 50, 40]), [50, 50], True)
    """

    def __init__(self, *, crop_frames: int = 150, compress_scale: float = 2.0):
        super().__init__()
        if crop_frames < 1 or not compress_scale > 0:
            raise ValueError(f"crop_frames >= 1 and compress_scale > 0 needed, got "
                             f"{crop_frames}, {compress_scale}")  # fmt: skip
        self.crop_frames = int(crop_frames)
        self.compress_scale = float(compress_scale)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor):
        batch, frames, n_mels = feats.shape
        lengths = lengths.clamp(min=1, max=frames)
        # Per-utterance statistics over the valid frames (one pass for the sum, one for the
        # squares), then crop first and normalise only the kept frames: the same output as
        # normalising every frame and cropping after, at crop/frames of the elementwise cost.
        mask = _mask(lengths, frames)[..., None].to(feats.dtype)
        masked = feats * mask
        count = lengths.to(feats.dtype) * n_mels
        mean = masked.sum(dim=(1, 2)) / count
        var = ((masked * masked).sum(dim=(1, 2)) / count - mean * mean).clamp(min=0.0)
        crop = self.crop_frames
        if self.training:
            room = (lengths - crop).clamp(min=0).to(torch.float32)
            start = (torch.rand(batch, device=feats.device) * (room + 1)).floor().long()
        else:
            start = ((lengths - crop).clamp(min=0) // 2).long()
        offsets = torch.arange(crop, device=feats.device)[None, :]
        index = start[:, None] + offsets % lengths[:, None]  # tiles records shorter than crop
        x = torch.gather(feats, 1, index[..., None].expand(-1, -1, n_mels))
        x = (x - mean[:, None, None]) / (var.sqrt()[:, None, None] + 1e-5)
        return torch.tanh(x / self.compress_scale), torch.full_like(lengths, crop)


class AudioEncoder(nn.Module):
    """Conv1d stack (0 or more layers) over frames, masked mean+std pooling, a linear embedding.

    With ``layers=0`` the encoder is statistics pooling of the input features followed by one
    linear layer: few parameters, which is what DP-SGD at a small epsilon can afford (the noise
    norm grows with the square root of the parameter count).

    Example
    -------
    >>> AudioEncoder(n_mels=40)(torch.randn(3, 50, 40), torch.tensor([50, 20, 1])).shape
    torch.Size([3, 64])
    >>> AudioEncoder(n_mels=40, layers=0, emb_dim=8)(torch.randn(2, 9, 40), torch.tensor([9, 4])).shape
    torch.Size([2, 8])
    """

    def __init__(self, *, n_mels: int, channels: int = 64, layers: int = 2,
                 kernel_size: int = 5, stride: int = 1, emb_dim: int = 64,
                 activation: str = "tanh"):  # fmt: skip
        super().__init__()
        acts = {"tanh": nn.Tanh, "relu": nn.ReLU}
        if activation not in acts:
            raise ValueError(f"activation must be one of {sorted(acts)}, got {activation!r}")
        if layers < 0 or stride < 1:
            raise ValueError(f"layers >= 0 and stride >= 1 needed, got {layers}, {stride}")
        convs, dim = [], n_mels
        for i in range(layers):
            convs += [nn.Conv1d(dim, channels, kernel_size, stride=stride if i == 0 else 1,
                                padding=kernel_size // 2), acts[activation]()]  # fmt: skip
            dim = channels
        self.stride = stride if layers else 1
        self.convs = nn.Sequential(*convs)
        self.proj = nn.Sequential(nn.Linear(2 * dim, emb_dim), acts[activation]())

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.convs(x.transpose(1, 2)).transpose(1, 2)  # (B, T', C)
        valid = torch.div(lengths.clamp(min=1) - 1, self.stride, rounding_mode="floor") + 1
        mask = _mask(valid, h.shape[1])[..., None].to(h.dtype)
        count = mask.sum(dim=1)
        mean = (h * mask).sum(dim=1) / count
        std = ((((h - mean[:, None]) * mask) ** 2).sum(dim=1) / count + 1e-5).sqrt()
        return self.proj(torch.cat([mean, std], dim=1))


class PrivilegedEncoder(nn.Module):
    """Mean of hashed-token embeddings (0 = padding, ignored), then ``tanh(Linear)``."""

    def __init__(self, *, buckets: int = 1024, dim: int = 32):
        super().__init__()
        self.embedding = nn.Embedding(buckets, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.contiguous()  # Opacus's ghost-clipping embedding norm uses .view
        mask = (tokens > 0).to(self.embedding.weight.dtype)[..., None]
        emb = (self.embedding(tokens) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return torch.tanh(self.proj(emb))


class ModalityDropout(nn.Module):
    """Zero a record's privileged embedding with probability ``p`` (training only).

    Example
    -------
    >>> drop = ModalityDropout(1.0).train()
    >>> drop(torch.ones(2, 3)).sum().item()
    0.0
    """

    def __init__(self, p: float = 0.0):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"modality dropout p must be in [0, 1], got {p}")
        self.p = float(p)

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return emb
        keep = (torch.rand(emb.shape[0], 1, device=emb.device) >= self.p).to(emb.dtype)
        return emb * keep


class GenderClassifier(nn.Module):
    """Audio-only or multimodal (audio + privileged input) utterance classifier.

    Arguments
    ---------
    n_mels, num_classes : int
        Input features and classes.
    dsaf : bool
        Use the :class:`DSAF` front-end and bounded (tanh) activations; else raw log-mels of
        variable length and ReLU.
    crop_frames, compress_scale : DSAF settings.
    channels, layers, kernel_size, stride, emb_dim : audio encoder size (``layers=0``: pooled
        statistics and one linear layer).
    privileged : bool
        Add the privileged branch (teacher only; the released student is audio-only).
    priv_buckets, priv_dim : privileged encoder size.
    modality_dropout : float
        ``p`` of :class:`ModalityDropout`.
    """

    def __init__(self, *, n_mels: int, num_classes: int, dsaf: bool = True,
                 crop_frames: int = 150, compress_scale: float = 2.0, channels: int = 64,
                 layers: int = 2, kernel_size: int = 5, stride: int = 1, emb_dim: int = 64,
                 privileged: bool = False, priv_buckets: int = 1024, priv_dim: int = 32,
                 modality_dropout: float = 0.0):  # fmt: skip
        super().__init__()
        self.dsaf = DSAF(crop_frames=crop_frames, compress_scale=compress_scale) if dsaf else None
        self.audio = AudioEncoder(n_mels=n_mels, channels=channels, layers=layers,
                                  kernel_size=kernel_size, stride=stride, emb_dim=emb_dim,
                                  activation="tanh" if dsaf else "relu")  # fmt: skip
        self.privileged = (
            PrivilegedEncoder(buckets=priv_buckets, dim=priv_dim) if privileged else None
        )
        self.modality_dropout = ModalityDropout(modality_dropout) if privileged else None
        self.head = nn.Linear(emb_dim + (priv_dim if privileged else 0), num_classes)

    @property
    def is_multimodal(self) -> bool:
        return self.privileged is not None

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor,
                tokens: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Logits (B, K). ``tokens`` (B, L) is required iff the model is multimodal."""
        if self.dsaf is not None:
            feats, lengths = self.dsaf(feats, lengths)
        h = self.audio(feats, lengths)
        if self.privileged is not None:
            if tokens is None:
                raise ValueError("a multimodal model needs the privileged tokens")
            h = torch.cat([h, self.modality_dropout(self.privileged(tokens))], dim=1)
        return self.head(h)
