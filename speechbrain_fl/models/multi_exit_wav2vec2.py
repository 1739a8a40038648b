"""Multi-exit wav2vec 2.0: exit heads after chosen Transformer layers, truncated forward.

The early-exit federated fine-tuning system (``early-exit-federated-wav2vec2`` paper in the
repository's papers folder): a ``transformers`` ``Wav2Vec2Model`` backbone with prediction heads
after the Transformer layers in ``exits`` (the paper's E = {3, 6, 9, 12}). A client that trains
up to depth ``L_max`` runs the forward pass through layers 1..L_max only, so deeper layers are
neither computed nor given a gradient, and takes the loss at exit ``L_max`` alone (the paper
trains no joint multi-exit loss).

Heads (the paper describes pooled heads only; the CTC head is ours):

- ``utterance``: statistical pooling (mean and standard deviation over the valid frames,
  Cai et al., 2018) followed by one linear layer, for KWS, SID, ER (and ASV embeddings);
- ``ctc``: one frame-level linear layer over a character vocabulary, trained with CTC (ours).

Truncation reuses the backbone's own forward (feature encoder, projection, positional
convolution, padding mask, SpecAugment masking) with ``encoder.layers`` cut to its first
``depth`` layers for the duration of the call, so the exit representation is exactly the
backbone's hidden state after layer ``depth`` (``hidden_states[depth]`` of a full forward; for
the post-LN "base" architecture; a pre-LN encoder gives LayerNorm(hidden_states[depth]) through
its final, shared LayerNorm). Exits of one evaluation pass are read with forward hooks on
the exit layers.

Presets: ``wav2vec2-base-100h`` (``facebook/wav2vec2-base-100h``, the paper's initialisation:
Base fine-tuned on LibriSpeech 100 h), ``wav2vec2-base`` (``facebook/wav2vec2-base``) and
``tiny`` (a 12-layer, 64-wide random model built from ``Wav2Vec2Config`` and saved with
``save_pretrained``, for the embedded default and the tests). A folder written by
``save_pretrained`` works too. Every one loads through ``Wav2Vec2Model.from_pretrained``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import Wav2Vec2Config, Wav2Vec2Model

from speechbrain_fl.models.exit_heads import CTCHead, StatPoolHead, WeightedSumHead

__all__ = [
    "PRESETS",
    "TINY_CONFIG",
    "CTCHead",
    "MultiExitWav2Vec2",
    "StatPoolHead",
    "WeightedSumHead",
    "build_multi_exit",
    "checkpoint_normalizes",
    "create_tiny_wav2vec2",
    "layer_of",
    "resolve_backbone",
]

PRESETS = {
    "wav2vec2-base-100h": "facebook/wav2vec2-base-100h",
    "wav2vec2-base": "facebook/wav2vec2-base",
    "tiny": None,
}

#: The tiny preset (ours): Base's 12 layers and CNN shape (kernels/strides, 20 ms frames),
#: narrow widths. No LayerDrop (it would skip layers the depth test relies on).
TINY_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 12,
    "num_attention_heads": 2,
    "intermediate_size": 128,
    "conv_dim": (32, 32, 32, 32, 32, 32, 32),
    "conv_kernel": (10, 3, 3, 3, 3, 2, 2),
    "conv_stride": (5, 2, 2, 2, 2, 2, 2),
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 4,
    "feat_extract_norm": "group",
    "do_stable_layer_norm": False,
    "layerdrop": 0.0,
    "mask_time_prob": 0.05,
    "mask_time_length": 5,
    "vocab_size": 32,
}

_LAYER_RE = re.compile(r"(?:^|\.)encoder\.layers\.(\d+)\.")
_HEAD_RE = re.compile(r"(?:^|\.)heads\.(\d+)\.")


def layer_of(name: str) -> tuple[str, int | None]:
    """Classify a parameter name: ``("layer", l)`` (1-based), ``("exit", e)`` or ``("below", None)``.

    Example
    -------
    >>> layer_of("model.backbone.encoder.layers.2.attention.k_proj.weight")
    ('layer', 3)
    >>> layer_of("model.heads.6.linear.bias"), layer_of("model.backbone.feature_projection.projection.bias")
    (('exit', 6), ('below', None))
    """
    match = _LAYER_RE.search(name)
    if match:
        return "layer", int(match.group(1)) + 1
    match = _HEAD_RE.search(name)
    if match:
        return "exit", int(match.group(1))
    return "below", None


def create_tiny_wav2vec2(folder: str | Path, *, seed: int = 0) -> Path:
    """Write a random tiny ``Wav2Vec2Model`` (``TINY_CONFIG``) to ``folder`` (idempotent).

    Example
    -------
    >>> import tempfile
    >>> path = create_tiny_wav2vec2(tempfile.mkdtemp())
    >>> Wav2Vec2Model.from_pretrained(path).config.num_hidden_layers
    12
    """
    from speechbrain_fl.utils.atomic import atomic_folder

    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Wav2Vec2Model(Wav2Vec2Config(**TINY_CONFIG))
    with atomic_folder(folder) as tmp:
        model.save_pretrained(tmp)
    return folder


def tiny_config_tag() -> str:
    """Short hash of :data:`TINY_CONFIG` (cache folders change when the architecture does)."""
    return hashlib.sha256(json.dumps(TINY_CONFIG, sort_keys=True).encode()).hexdigest()[:8]


def resolve_backbone(model: str, *, cache_dir: str | Path, seed: int = 0) -> str:
    """Map a preset key or folder to what ``Wav2Vec2Model.from_pretrained`` loads.

    ``tiny`` is created in ``<cache_dir>/wav2vec2_tiny_<tag>_s<seed>`` on first use.
    """
    if model in PRESETS:
        if PRESETS[model] is not None:
            return PRESETS[model]
        folder = Path(cache_dir) / f"wav2vec2_tiny_{tiny_config_tag()}_s{seed}"
        return str(create_tiny_wav2vec2(folder, seed=seed))
    if (Path(model) / "config.json").is_file():
        return str(model)
    raise ValueError(
        f"model: {model!r} is neither a preset {sorted(PRESETS)} nor a folder with config.json"
    )


class MultiExitWav2Vec2(nn.Module):
    """A ``Wav2Vec2Model`` with one head per exit layer and a depth-truncated forward.

    Arguments
    ---------
    backbone : transformers.Wav2Vec2Model
        The pretrained model (its ``encoder.layers`` are the Transformer layers 1..12).
    num_outputs : int
        Classes for ``utterance`` heads, vocabulary size (blank = 0) for ``ctc`` heads.
    exits : sequence of int
        Exit layers, 1-based (default the paper's {3, 6, 9, 12}).
    head : str
        ``utterance`` (stat pooling + linear) or ``ctc``.
    freeze_feature_encoder : bool
        Keep the CNN feature encoder fixed (our key; default trained, as the paper's memory
        figures suggest).
    pooling : str
        Utterance heads: ``stat`` (mean and standard deviation) or ``mean``.
    upstream : str
        ``finetune`` (the paper: the backbone is trained up to the exit) or ``frozen`` (the
        SUPERB protocol: the backbone is fixed and each exit learns a weighted sum of the
        hidden states 0..L, :class:`WeightedSumHead`; clients then train and send heads only).
    normalize_input : bool
        Normalise each waveform to zero mean and unit variance over its valid samples before
        the feature encoder, ``x' = (x - mean) / sqrt(var + 1e-7)`` with padding set to 0, as
        ``Wav2Vec2FeatureExtractor`` does for checkpoints whose ``preprocessor_config.json``
        has ``do_normalize: true`` (``wav2vec2-base-100h``); see :func:`checkpoint_normalizes`.

    Example
    -------
    >>> import tempfile
    >>> backbone = Wav2Vec2Model.from_pretrained(create_tiny_wav2vec2(tempfile.mkdtemp()))
    >>> model = MultiExitWav2Vec2(backbone, num_outputs=12).eval()
    >>> wavs, lens = torch.randn(2, 8000), torch.tensor([1.0, 0.6])
    >>> model(wavs, lens, depth=3).shape
    torch.Size([2, 12])
    >>> sorted(model.forward_exits(wavs, lens, exits=[3, 6]))
    [3, 6]
    """

    def __init__(
        self,
        backbone: Wav2Vec2Model,
        *,
        num_outputs: int,
        exits: Sequence[int] = (3, 6, 9, 12),
        head: str = "utterance",
        freeze_feature_encoder: bool = False,
        normalize_input: bool = False,
        pooling: str = "stat",
        upstream: str = "finetune",
    ) -> None:
        super().__init__()
        num_layers = len(backbone.encoder.layers)
        exits = sorted({int(e) for e in exits})
        if not exits or exits[0] < 1 or exits[-1] > num_layers:
            raise ValueError(f"exits {exits} must lie in 1..{num_layers} (the backbone's layers)")
        if head not in ("utterance", "ctc"):
            raise ValueError(f"head: {head!r} must be 'utterance' or 'ctc'")
        # A pre-LN encoder (``do_stable_layer_norm``: Large checkpoints, or the tiny preset's
        # probe variant) applies its final LayerNorm after the last layer it runs, so with a
        # truncated stack every exit reads LayerNorm(h_exit) through that one shared norm (as
        # early-exit language models do); for a pre-LN *checkpoint* that norm was trained on
        # layer 12's output only. The norm is a "below" parameter: every client trains it.
        self.pre_ln = bool(getattr(backbone.config, "do_stable_layer_norm", False))
        if self.pre_ln and upstream == "frozen":
            raise ValueError(
                "upstream: 'frozen' (a weighted sum of hidden states) is not supported for a "
                "pre-LN (do_stable_layer_norm) backbone: its hidden states are un-normalised"
            )
        self.backbone = backbone
        self.exits = exits
        self.head_type = head
        hidden = backbone.config.hidden_size
        if upstream not in ("finetune", "frozen"):
            raise ValueError(f"upstream: {upstream!r} must be 'finetune' or 'frozen'")
        self.upstream = upstream

        def make(exit_):
            if head == "utterance":
                module = StatPoolHead(hidden, num_outputs, pooling=pooling)
            else:
                module = CTCHead(hidden, num_outputs)
            return WeightedSumHead(module, exit_ + 1) if upstream == "frozen" else module

        self.heads = nn.ModuleDict({str(e): make(e) for e in exits})
        if upstream == "frozen":
            for param in backbone.parameters():
                param.requires_grad_(False)
        self.freeze_feature_encoder = bool(freeze_feature_encoder)
        self.normalize_input = bool(normalize_input)
        if freeze_feature_encoder:
            backbone.freeze_feature_encoder()

    def param_groups(self, lr: float, backbone_lr: float) -> list[dict]:
        """AdamW parameter groups: the backbone at ``backbone_lr``, the exit heads at ``lr``.

        Only tensors with ``requires_grad`` are listed (a frozen CNN is left out); an empty
        group is dropped.

        Example
        -------
        >>> import tempfile
        >>> bb = Wav2Vec2Model.from_pretrained(create_tiny_wav2vec2(tempfile.mkdtemp()))
        >>> groups = MultiExitWav2Vec2(bb, num_outputs=2).param_groups(1e-3, 5e-5)
        >>> [(g["name"], g["lr"]) for g in groups]
        [('backbone', 5e-05), ('heads', 0.001)]
        """
        groups = [
            {"name": "backbone", "lr": float(backbone_lr), "params": []},
            {"name": "heads", "lr": float(lr), "params": []},
        ]
        for name, param in self.named_parameters():
            if param.requires_grad:
                groups[1 if name.startswith("heads.") else 0]["params"].append(param)
        return [g for g in groups if g["params"]]

    @staticmethod
    def normalize(wavs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Zero mean, unit variance per utterance over its valid samples; padding -> 0.

        ``x' = (x - mean) / sqrt(var + 1e-7)``, ``Wav2Vec2FeatureExtractor``'s
        ``zero_mean_unit_var_norm``.

        Example
        -------
        >>> x = torch.tensor([[1.0, 3.0, 9.0], [2.0, 4.0, 6.0]])
        >>> mask = torch.tensor([[True, True, False], [True, True, True]])
        >>> MultiExitWav2Vec2.normalize(x, mask)[0].tolist()
        [-1.0, 1.0, 0.0]
        """
        if mask is None:
            mask = torch.ones_like(wavs, dtype=torch.bool)
        weights = mask.to(wavs.dtype)
        count = weights.sum(dim=1, keepdim=True).clamp(min=1.0)
        mean = (wavs * weights).sum(dim=1, keepdim=True) / count
        var = (((wavs - mean) ** 2) * weights).sum(dim=1, keepdim=True) / count
        return (wavs - mean) / torch.sqrt(var + 1e-7) * weights

    @property
    def num_layers(self) -> int:
        """Transformer layers of the backbone."""
        return len(self.backbone.encoder.layers)

    def check_depth(self, depth: int) -> int:
        """Return ``depth`` if it is an exit, else raise naming the exits."""
        if int(depth) not in self.exits:
            raise ValueError(f"exit {depth!r} is not one of the model's exits {self.exits}")
        return int(depth)

    @contextlib.contextmanager
    def _truncated(self, depth: int) -> Iterator[None]:
        encoder = self.backbone.encoder
        full = encoder.layers
        encoder.layers = nn.ModuleList(list(full)[:depth])
        try:
            yield
        finally:
            encoder.layers = full

    def _attention_mask(self, wavs: torch.Tensor, wav_lens: torch.Tensor | None):
        if wav_lens is None:
            return None
        samples = torch.round(wav_lens.to(wavs.device) * wavs.shape[1]).long()
        return torch.arange(wavs.shape[1], device=wavs.device)[None, :] < samples[:, None]

    def hidden(
        self,
        wavs: torch.Tensor,
        wav_lens: torch.Tensor | None,
        *,
        depth: int,
        capture: Iterable[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """Run layers 1..``depth`` only.

        Returns
        -------
        tuple
            ``(hidden after layer depth (B, T, H), frame mask (B, T) bool,
            {l: hidden after layer l} for l in capture)``.
        """
        if not 1 <= depth <= self.num_layers:
            raise ValueError(f"depth {depth} outside 1..{self.num_layers}")
        mask = self._attention_mask(wavs, wav_lens)
        if self.normalize_input:
            wavs = self.normalize(wavs, mask)
        captured: dict[int, torch.Tensor] = {}
        hooks = []
        for layer in capture:
            if layer < depth:

                def hook(_module, _inputs, output, layer=layer):
                    captured[layer] = output[0] if isinstance(output, tuple) else output

                hooks.append(self.backbone.encoder.layers[layer - 1].register_forward_hook(hook))
        weighted = self.upstream == "frozen"
        stack = None
        try:
            with self._truncated(depth):
                out = self.backbone(wavs, attention_mask=mask, output_hidden_states=weighted)
        finally:
            for handle in hooks:
                handle.remove()
        if weighted:  # every exit reads the stack of hidden states 0..exit
            stack = torch.stack(out.hidden_states, dim=0)
            captured = {layer: stack[: layer + 1] for layer in capture if layer < depth}
        if self.pre_ln:  # as the truncated pass at that depth: its final LayerNorm applied
            norm = self.backbone.encoder.layer_norm
            captured = {layer: norm(state) for layer, state in captured.items()}
        frames = out.last_hidden_state
        if mask is None:
            frame_mask = torch.ones(frames.shape[:2], dtype=torch.bool, device=frames.device)
        else:
            frame_mask = self.backbone._get_feature_vector_attention_mask(
                frames.shape[1], mask
            ).bool()
        captured[depth] = stack if weighted else frames
        return frames, frame_mask, captured

    def forward(
        self, wavs: torch.Tensor, wav_lens: torch.Tensor | None, *, depth: int
    ) -> torch.Tensor:
        """The output of exit ``depth`` (the training path: layers past ``depth`` never run)."""
        depth = self.check_depth(depth)
        _, frame_mask, captured = self.hidden(wavs, wav_lens, depth=depth)
        return self.heads[str(depth)](captured[depth], frame_mask)

    def forward_exits(
        self, wavs: torch.Tensor, wav_lens: torch.Tensor | None, *, exits: Iterable[int]
    ) -> dict[int, torch.Tensor]:
        """Outputs of several exits from one pass up to the deepest of them."""
        exits = sorted({self.check_depth(e) for e in exits})
        _, frame_mask, captured = self.hidden(wavs, wav_lens, depth=exits[-1], capture=exits)
        return {e: self.heads[str(e)](captured[e], frame_mask) for e in exits}

    def frame_lengths(self, wavs: torch.Tensor, wav_lens: torch.Tensor) -> torch.Tensor:
        """Valid output frames per utterance (for CTC)."""
        mask = self._attention_mask(wavs, wav_lens)
        return self.backbone._get_feat_extract_output_lengths(mask.sum(-1)).long()

    def trained_parameter_names(self, depth: int, *, prefix: str = "") -> list[str]:
        """Trainable parameters a client training up to ``depth`` updates.

        Everything below the Transformer (CNN unless frozen, projection, positional
        convolution, the pre-layer LayerNorm, the SpecAugment mask embedding), layers
        1..``depth`` and the head of exit ``depth``.

        Example
        -------
        >>> import tempfile
        >>> bb = Wav2Vec2Model.from_pretrained(create_tiny_wav2vec2(tempfile.mkdtemp()))
        >>> names = MultiExitWav2Vec2(bb, num_outputs=2).trained_parameter_names(3)
        >>> sorted({layer_of(n)[1] for n in names if layer_of(n)[0] == "layer"})
        [1, 2, 3]
        """
        depth = self.check_depth(depth)
        names = []
        for name, param in self.named_parameters():
            if not param.requires_grad:
                continue
            kind, index = layer_of(name)
            if (kind == "layer" and index > depth) or (kind == "exit" and index != depth):
                continue
            names.append(prefix + name)
        return names


def build_multi_exit(
    model: str,
    *,
    num_outputs: int,
    cache_dir: str | Path,
    exits: Sequence[int] = (3, 6, 9, 12),
    head: str = "utterance",
    freeze_feature_encoder: bool = False,
    seed: int = 0,
    config_overrides: dict | None = None,
    normalize_input: bool | str = "auto",
    pooling: str = "stat",
    upstream: str = "finetune",
) -> MultiExitWav2Vec2:
    """Load a preset or folder with ``Wav2Vec2Model.from_pretrained`` and add the exit heads.

    Heads are initialised with ``seed`` (they are new for every task, as in the paper).
    ``config_overrides`` replace ``Wav2Vec2Config`` fields at load time (the recipe's
    ``layerdrop``, ``mask_time_prob``, ``mask_time_length``, ``mask_time_min_masks``); the
    config's own default LayerDrop (0.1) would otherwise skip layers in training.
    ``normalize_input``: True, False or ``"auto"`` (:func:`checkpoint_normalizes`).
    """
    source = resolve_backbone(model, cache_dir=cache_dir, seed=seed)
    overrides = dict(config_overrides or {})
    unknown = sorted(k for k in overrides if not hasattr(Wav2Vec2Config(), k))
    if unknown:
        raise ValueError(f"config_overrides: {unknown} are not Wav2Vec2Config fields")
    backbone = Wav2Vec2Model.from_pretrained(source, **overrides)
    if normalize_input == "auto":
        normalize_input = checkpoint_normalizes(source)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MultiExitWav2Vec2(
            backbone,
            num_outputs=num_outputs,
            exits=exits,
            head=head,
            freeze_feature_encoder=freeze_feature_encoder,
            normalize_input=bool(normalize_input),
            pooling=pooling,
            upstream=upstream,
        )


def checkpoint_normalizes(source: str | Path) -> bool:
    """Whether a checkpoint's feature extractor normalises waveforms (``do_normalize``).

    Reads ``preprocessor_config.json`` of a local folder, or of a hub id through the local
    ``transformers`` cache only (no download); a checkpoint without one (the tiny preset,
    ``wav2vec2-base``'s pretraining-only folder) is taken as not normalising.

    Example
    -------
    >>> import tempfile
    >>> checkpoint_normalizes(create_tiny_wav2vec2(tempfile.mkdtemp()))
    False
    """
    path = Path(source) / "preprocessor_config.json"
    if not path.is_file() and not Path(source).is_dir():
        try:
            from transformers.utils import cached_file

            found = cached_file(
                str(source), "preprocessor_config.json", local_files_only=True,
                _raise_exceptions_for_missing_entries=False,
            )  # fmt: skip
        except (OSError, ValueError):
            found = None
        path = Path(found) if found else path
    if not path.is_file():
        return False
    return bool(json.loads(path.read_text(encoding="utf-8")).get("do_normalize", False))
