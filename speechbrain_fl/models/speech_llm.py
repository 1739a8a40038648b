"""Speech-LLM: audio encoder + frame-stacking connector + causal LM decoder, with LoRA.

Implements the three-component model of the alpha-split paper (Sec. II-A, Eq. 1-2)::

    y_hat = L([C(E(x)); E_text]),   L_CE = -sum_s log p(y_s | C(E(x)), E_text, y_<s)

Layout of the LLM input for utterance i (prefix left-padded to the batch's longest prefix,
transcript right-padded, so the prefix ends at the same column for every row)::

    [pad ... | <bos> | audio tokens (ceil(enc_frames_i / k)) | prompt | y_1 ... y_S </s> | pad ...]

The loss is the token-averaged cross-entropy over transcript tokens and the appended EOS only
(labels -100 on padding, BOS, audio and prompt). Logits are computed only for the transcript region
(transformers' ``logits_to_keep``), which keeps memory low for 32k-128k vocabularies.

Components and parameter names (stable across presets; used by the privacy layout):

- ``encoder.*``: a transformers ``WhisperEncoder`` (or Voxtral's ``audio_tower``). LoRA adapters on
  ``q_proj/k_proj/v_proj``, e.g. ``encoder.layers.0.self_attn.q_proj.lora_A.default.weight``, only
  when the encoder is not frozen (the paper's ``-e`` variants). ``ctc_head.*`` (optional CTC
  auxiliary head on the encoder output) is labelled ``encoder`` too: it only exists when the
  encoder is trainable and its gradient comes from the audio.
- ``connector.*``: :class:`FrameStackConnector`, trained fully (``connector.linear.weight`` /
  ``connector.linear.bias``, or ``connector.linear_1/linear_2`` for the MLP).
- ``llm.*``: a ``LlamaForCausalLM``-style model; LoRA on ``q_proj/v_proj``, e.g.
  ``llm.model.layers.0.self_attn.q_proj.lora_A.default.weight``.

The encoder is used through transformers directly rather than SpeechBrain's ``Whisper`` lobe: the
lobe wraps the whole encoder-decoder (and its own feature pipeline), while here only the encoder is
needed and peft must see the plain ``WhisperEncoder`` module names.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from safetensors.torch import save_file
from torch import nn

from speechbrain_fl.models.connector import FrameStackConnector
from speechbrain_fl.utils.feature_cache import FeatureCache

ENCODER_LORA_TARGETS = ("q_proj", "k_proj", "v_proj")
LLM_LORA_TARGETS = ("q_proj", "v_proj")
COMPONENT_PATTERNS = {
    "encoder": ["encoder.*", "ctc_head.*"],
    "connector": ["connector.*"],
    "llm": ["llm.*"],
}


def add_lora(
    module: nn.Module,
    *,
    targets: tuple[str, ...],
    r: int = 8,
    alpha: int = 16,
    dropout: float = 0.0,
) -> nn.Module:
    """Inject peft LoRA adapters (adapter name ``default``) into ``module`` in place.

    Uses ``peft.inject_adapter_in_model`` on the bare module (not ``get_peft_model``), so parameter
    names stay ``<path>.lora_A.default.weight`` / ``<path>.lora_B.default.weight`` with no
    ``base_model.model`` prefix. LoRA (Hu et al., 2022): W x + (alpha / r) B A x, B initialised 0.

    Example
    -------
    >>> lin = nn.Sequential(nn.Linear(4, 4))
    >>> _ = add_lora(lin, targets=("0",), r=2)
    >>> sorted(n for n, _ in lin.named_parameters() if "lora" in n)
    ['0.lora_A.default.weight', '0.lora_B.default.weight']
    """
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets), bias="none"
    )
    return inject_adapter_in_model(config, module)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, reduction: str = "mean"):
    """Next-token cross-entropy: logits[:, t] predicts labels[:, t + 1]; -100 labels are ignored.

    Arguments
    ---------
    logits : torch.Tensor
        (B, T, V) scores.
    labels : torch.Tensor
        (B, T) token ids, -100 where no loss is taken.
    reduction : str
        ``"mean"`` (over counted tokens, Eq. 2 divided by the token count) or ``"sum"``.

    Example
    -------
    >>> logits = torch.zeros(1, 3, 5)
    >>> labels = torch.tensor([[-100, 2, -100]])
    >>> round(float(causal_lm_loss(logits, labels)), 4)  # log(5)
    1.6094
    """
    shifted = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shifted, targets, ignore_index=-100, reduction=reduction)


@dataclass
class SpeechLLMOutput:
    """Losses of one forward pass (``loss`` = ce + ctc_weight * ctc)."""

    loss: torch.Tensor
    ce_loss: torch.Tensor
    ctc_loss: torch.Tensor | None
    num_tokens: int


@dataclass
class LLMInputs:
    """Assembled decoder inputs; ``prefix_len`` is the column where transcripts start."""

    inputs_embeds: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    prefix_len: int


class SpeechLLM(nn.Module):
    """Encoder + connector + causal LM with a text prompt (alpha-split paper, Eq. 1-2).

    Build it with :func:`speechbrain_fl.models.presets.build_speech_llm`; the constructor takes
    already-loaded parts.

    Arguments
    ---------
    encoder : nn.Module
        Whisper-style encoder: ``encoder(input_features).last_hidden_state`` of shape
        (B, max_source_positions, d_enc) for (B, n_mels, 2 * max_source_positions) features.
    connector : FrameStackConnector
        Maps encoder frames to LLM embeddings.
    llm : nn.Module
        Causal LM with ``get_input_embeddings()``, ``generate`` and ``logits_to_keep``.
    tokenizer : transformers tokenizer
        The LLM's tokenizer (needs ``eos_token_id``; ``pad``/``bos`` are optional).
    feature_extractor : transformers.WhisperFeatureExtractor
        Log-mel front end; its ``nb_max_frames`` must equal 2 * ``max_source_positions``.
    prompt : str
        Task prompt placed after the audio tokens. It may name the utterance's language with a
        ``{language}`` placeholder (e.g. ``"transcribe {language}:"``); the callers then pass
        ``languages`` (one per utterance) to :meth:`forward` and :meth:`transcribe`.
    ctc_weight : float
        Weight of the CTC auxiliary loss; a ``ctc_head`` is created when > 0.
    max_new_tokens : int
        Default decoding length limit.
    """

    def __init__(
        self,
        *,
        encoder: nn.Module,
        connector: FrameStackConnector,
        llm: nn.Module,
        tokenizer,
        feature_extractor,
        prompt: str = "Transcribe the audio:",
        ctc_weight: float = 0.0,
        max_new_tokens: int = 256,
        input_token_noise: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0.0 <= input_token_noise < 1.0:
            raise ValueError(f"input_token_noise must be in [0, 1), got {input_token_noise}")
        self.input_token_noise = float(input_token_noise)
        self.encoder = encoder
        self.connector = connector
        self.llm = llm
        self.tokenizer = tokenizer
        self.feature_extractor = feature_extractor
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.ctc_weight = float(ctc_weight)
        if tokenizer.eos_token_id is None:
            raise ValueError("the LLM tokenizer has no eos_token_id; transcripts need an EOS")
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.bos_id = tokenizer.bos_token_id
        enc_config = encoder.config
        expected = 2 * enc_config.max_source_positions
        if feature_extractor.nb_max_frames != expected:
            raise ValueError(
                f"feature extractor pads to {feature_extractor.nb_max_frames} frames but the "
                f"encoder expects {expected} (2 * max_source_positions); set chunk_length to "
                f"{expected * feature_extractor.hop_length / feature_extractor.sampling_rate} s"
            )
        self._prompt_ids: dict[tuple[str, str | None], list[int]] = {}
        #: :meth:`use_feature_cache`'s cache of per-utterance features (None: off).
        self.feature_cache: FeatureCache | None = None
        self.ctc_head = None
        if self.ctc_weight > 0:
            # One extra class: the CTC blank is the last index.
            self.ctc_head = nn.Linear(enc_config.d_model, len(tokenizer) + 1)

    # ------------------------------------------------------------------ trainable parameters
    def component_patterns(self) -> dict[str, list[str]]:
        """fnmatch patterns labelling every parameter ``encoder``, ``connector`` or ``llm``."""
        return {label: list(patterns) for label, patterns in COMPONENT_PATTERNS.items()}

    def component_of(self, name: str) -> str:
        """The component label of parameter ``name`` (first matching pattern)."""
        for label, patterns in COMPONENT_PATTERNS.items():
            if any(fnmatch.fnmatchcase(name, p) for p in patterns):
                return label
        raise KeyError(f"parameter {name!r} matches no component pattern {COMPONENT_PATTERNS}")

    def set_trainable(
        self,
        *,
        train_encoder_lora: bool,
        train_base: bool = False,
        train_llm_lora: bool = True,
        train_connector: bool = True,
        train_ctc_head: bool = True,
    ) -> None:
        """Freeze everything, then unfreeze LoRA (LLM, encoder if asked), connector, CTC head.

        ``train_base=True`` unfreezes every weight (central seed pretraining of the tiny model).
        ``train_llm_lora=False`` keeps the LLM's adapters frozen (at B = 0 they change nothing),
        so adaptation goes through the audio side only. ``train_connector=False`` keeps a
        pretrained connector fixed (a large pretrained projector, e.g. Voxtral's 2-layer MLP,
        would otherwise take most of the LLM + connector pool's budget: its share of a
        size-proportional pool budget is sqrt(p_connector / p_pool)). ``train_ctc_head=False``
        keeps the CTC head fixed (the paper has none: its encoder pool is encoder LoRA only).
        """
        for name, param in self.named_parameters():
            if train_base:
                param.requires_grad_(True)
            elif name.startswith("connector."):
                param.requires_grad_(train_connector)
            elif name.startswith("ctc_head."):
                param.requires_grad_(train_ctc_head)
            elif "lora_" in name:
                llm = name.startswith("llm.")
                param.requires_grad_(train_llm_lora if llm else train_encoder_lora)
            else:
                param.requires_grad_(False)

    def param_groups(self, lr: float, encoder_lr_multiplier: float = 1.0) -> list[dict]:
        """AdamW parameter groups: encoder trainables at ``lr * encoder_lr_multiplier``.

        The encoder learning-rate multiplier is the paper's Appendix A ablation (x0.02 for
        Whisper + EuroLLM). Groups carry a ``name`` key; empty groups are left out.
        """
        groups = {"encoder": [], "llm_connector": []}
        for name, param in self.named_parameters():
            if param.requires_grad:
                key = "encoder" if self.component_of(name) == "encoder" else "llm_connector"
                groups[key].append(param)
        lrs = {"encoder": lr * encoder_lr_multiplier, "llm_connector": lr}
        return [{"params": p, "lr": lrs[k], "name": k} for k, p in groups.items() if p]

    # ------------------------------------------------------------------ audio side
    def use_feature_cache(self, max_bytes: int) -> None:
        """Serve :meth:`extract_features`' log-mels from an exact cache of at most ``max_bytes``.

        A client computes the same utterance's features every local epoch and every round it is
        sampled; :class:`~speechbrain_fl.utils.feature_cache.FeatureCache` keys each waveform by
        its bytes' digest, so a row is reused only for the identical input and the features are
        bit for bit the extractor's (``tests/unit/test_speech_llm_feature_cache.py``). One model
        per process (the recipes share it among a process's clients) has one cache. An
        extractor that dithers (random noise added to the audio) is refused: its features are
        not a function of the waveform. ``max_bytes = 0`` switches the cache off.
        """
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"feature cache size must be an integer >= 0 bytes, got {max_bytes!r}")
        if max_bytes == 0:
            self.feature_cache = None
            return
        dither = float(getattr(self.feature_extractor, "dither", 0.0) or 0.0)
        if dither != 0.0:
            raise ValueError(
                f"feature_cache_mb: the feature extractor dithers (dither={dither}), so its "
                "features are random and a cache would not be exact; set feature_cache_mb: 0"
            )
        self.feature_cache = FeatureCache(self._log_mel, max_bytes=max_bytes)

    def _log_mel(self, audio: list) -> torch.Tensor:
        """The feature extractor on a list of 1-D float32 waveforms (padded to the window)."""
        return self.feature_extractor(
            audio,
            sampling_rate=self.feature_extractor.sampling_rate,
            return_tensors="pt",
            padding="max_length",
            truncation=True,
        ).input_features

    def extract_features(self, wavs: torch.Tensor, wav_lens: torch.Tensor):
        """Log-mel features (B, n_mels, 2*max_source_positions) and valid encoder frames (B,).

        ``wav_lens`` are relative lengths in [0, 1] (SpeechBrain convention). Longer audio is
        truncated to the encoder's window (30 s for Whisper, 5 s for ``tiny``). With
        :meth:`use_feature_cache` the rows already computed for the same waveform are reused.
        """
        samples = torch.round(wav_lens.float() * wavs.shape[1]).long().clamp(min=1).cpu()
        audio = [w[:n].float().cpu().numpy() for w, n in zip(wavs, samples.tolist(), strict=True)]
        # The extractor computes on CPU in float32; a caller's CPU autocast must not reach it.
        with torch.autocast("cpu", enabled=False):
            if self.feature_cache is not None:
                features = self.feature_cache(audio)
            else:
                features = self._log_mel(audio)
        max_positions = self.encoder.config.max_source_positions
        mel_frames = torch.div(samples, self.feature_extractor.hop_length, rounding_mode="floor")
        enc_frames = torch.div(mel_frames + 1, 2, rounding_mode="floor").clamp(1, max_positions)
        return features, enc_frames

    def encode(self, wavs: torch.Tensor, wav_lens: torch.Tensor):
        """Encoder frames, their valid lengths, audio tokens (B, N, d_llm) and token counts."""
        features, enc_lens = self.extract_features(wavs, wav_lens)
        conv = self.encoder.conv1.weight
        frames = self.encoder(features.to(conv.device, conv.dtype)).last_hidden_state
        enc_lens = enc_lens.to(frames.device)
        audio = self.connector(frames)
        return frames, enc_lens, audio, self.connector.output_lengths(enc_lens)

    # ------------------------------------------------------------------ text side
    def tokenize_transcripts(self, transcripts: list[str]) -> list[list[int]]:
        """Token ids of each transcript with EOS appended."""
        ids = self.tokenizer(list(transcripts), add_special_tokens=False).input_ids
        return [row + [self.eos_id] for row in ids]

    def prompt_ids(self, language: str | None = None) -> list[int]:
        """Token ids of the task prompt, with ``{language}`` filled in when it has one.

        Raises
        ------
        ValueError
            The prompt names ``{language}`` and ``language`` is None.

        Example
        -------
        >>> import tempfile
        >>> from speechbrain_fl.models.presets import build_speech_llm
        >>> model = build_speech_llm("tiny", cache_dir=tempfile.mkdtemp(), prompt="in {language}")
        >>> model.tokenizer.decode(model.prompt_ids("dutch"))
        'in dutch'
        """
        if "{language}" not in self.prompt:
            language = None
        elif language is None:
            raise ValueError(
                f"the prompt {self.prompt!r} names the utterance's {{language}}: pass "
                "languages=[...] (one per utterance) to forward/transcribe"
            )
        key = (self.prompt, language)
        if key not in self._prompt_ids:
            text = self.prompt if language is None else self.prompt.format(language=language)
            self._prompt_ids[key] = self.tokenizer(text, add_special_tokens=False).input_ids
        return self._prompt_ids[key]

    def assemble(
        self,
        audio: torch.Tensor,
        audio_lens: torch.Tensor,
        targets: list[list[int]] | None = None,
        languages: list[str] | None = None,
        corrupt: float = 0.0,
    ) -> LLMInputs:
        """Build ``[pad | bos | audio_i | prompt_i | targets_i | pad]`` rows (module docstring).

        ``languages`` (one per row) fill the prompt's ``{language}`` placeholder, if it has one.
        Returns an :class:`LLMInputs` whose ``labels`` hold the target ids in the transcript
        region and -100 everywhere else (prefix, padding).
        """
        embed = self.llm.get_input_embeddings()
        device, dtype = embed.weight.device, embed.weight.dtype
        if languages is not None and len(languages) != audio.shape[0]:
            raise ValueError(f"{len(languages)} languages for a batch of {audio.shape[0]}")
        head = [self.bos_id] if self.bos_id is not None else []
        head_emb = embed(torch.tensor(head, dtype=torch.long, device=device))
        prompts = [
            self.prompt_ids(languages[i] if languages is not None else None)
            for i in range(audio.shape[0])
        ]
        prefixes = [
            torch.cat(
                [
                    head_emb,
                    audio[i, : int(n)].to(dtype),
                    embed(torch.tensor(prompts[i], dtype=torch.long, device=device)),
                ]
            )
            for i, n in enumerate(audio_lens.tolist())
        ]
        prefix_len = max(p.shape[0] for p in prefixes)
        targets = targets or [[] for _ in prefixes]
        target_len = max(len(t) for t in targets)
        batch = len(prefixes)
        total = prefix_len + target_len
        mask = torch.zeros(batch, total, dtype=torch.long, device=device)
        labels = torch.full((batch, total), -100, dtype=torch.long, device=device)
        target_ids = torch.full((batch, target_len), self.pad_id, dtype=torch.long, device=device)
        for i, (prefix, tgt) in enumerate(zip(prefixes, targets, strict=True)):
            mask[i, prefix_len - prefix.shape[0] : prefix_len + len(tgt)] = 1
            if tgt:
                target_ids[i, : len(tgt)] = torch.tensor(tgt, device=device)
                labels[i, prefix_len : prefix_len + len(tgt)] = target_ids[i, : len(tgt)]
        pad_emb = embed(torch.tensor([self.pad_id], device=device))
        padded = [torch.cat([pad_emb.expand(prefix_len - p.shape[0], -1), p]) for p in prefixes]
        input_ids = target_ids
        if corrupt > 0:
            input_ids = self.corrupt_inputs(target_ids, corrupt)
        inputs = torch.cat([torch.stack(padded), embed(input_ids)], dim=1)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        return LLMInputs(inputs, mask, position_ids, labels, prefix_len)

    def corrupt_inputs(self, ids: torch.Tensor, rate: float) -> torch.Tensor:
        """Teacher-forced input ids with a ``rate`` share replaced by random ordinary tokens.

        Only the decoder's *inputs* are corrupted; the labels stay the true transcript, so the
        model learns to predict the next token when its own history may be wrong, as it is in
        greedy decoding (exposure bias; a cheap form of scheduled sampling, Bengio et al. 2015,
        and of word dropout, Bowman et al. 2016). Replacement ids are drawn uniformly among the
        non-special tokens. The randomness is torch's global generator (training noise, not a
        privacy mechanism).

        Example
        -------
        >>> import tempfile
        >>> from speechbrain_fl.models.presets import build_speech_llm
        >>> model = build_speech_llm("tiny", cache_dir=tempfile.mkdtemp())
        >>> ids = torch.full((4, 50), 10)
        >>> float((model.corrupt_inputs(ids, 0.0) != ids).float().mean())
        0.0
        >>> 0.2 < float((model.corrupt_inputs(ids, 0.5) != ids).float().mean()) < 0.8
        True
        """
        special = set(self.tokenizer.all_special_ids)
        ordinary = [i for i in range(len(self.tokenizer)) if i not in special]
        if not ordinary or rate <= 0:
            return ids
        pool = torch.tensor(ordinary, device=ids.device)
        pick = torch.rand(ids.shape, device=ids.device) < rate
        random_ids = pool[torch.randint(len(pool), ids.shape, device=ids.device)]
        return torch.where(pick, random_ids, ids)

    # ------------------------------------------------------------------ training and decoding
    def forward(
        self,
        wavs: torch.Tensor,
        wav_lens: torch.Tensor,
        transcripts: list[str],
        languages: list[str] | None = None,
    ) -> SpeechLLMOutput:
        """Loss = CE over transcript tokens (+ ``ctc_weight`` * CTC on the encoder output).

        ``languages``: one per utterance, needed when the prompt names ``{language}``.
        """
        frames, enc_lens, audio, audio_lens = self.encode(wavs, wav_lens)
        targets = self.tokenize_transcripts(transcripts)
        batch = self.assemble(
            audio, audio_lens, targets, languages, corrupt=self.input_token_noise * self.training
        )
        keep = batch.labels.shape[1] - batch.prefix_len + 1
        logits = self.llm(
            inputs_embeds=batch.inputs_embeds,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=keep,
            use_cache=False,
        ).logits
        ce = causal_lm_loss(logits, batch.labels[:, batch.prefix_len - 1 :])
        ctc = None
        loss = ce
        if self.ctc_head is not None and self.ctc_weight > 0:
            ctc = self.ctc_loss(frames, enc_lens, [t[:-1] for t in targets])
            loss = ce + self.ctc_weight * ctc
        num_tokens = int((batch.labels != -100).sum())
        return SpeechLLMOutput(loss=loss, ce_loss=ce, ctc_loss=ctc, num_tokens=num_tokens)

    def ctc_loss(self, frames, enc_lens, targets: list[list[int]]) -> torch.Tensor:
        """CTC (blank = last class) of the auxiliary head over valid encoder frames."""
        head = self.ctc_head
        log_probs = head(frames.to(head.weight.dtype)).float().log_softmax(-1).transpose(0, 1)
        flat = torch.tensor([t for row in targets for t in row], dtype=torch.long)
        lengths = torch.tensor([len(row) for row in targets], dtype=torch.long)
        return F.ctc_loss(
            log_probs,
            flat.to(frames.device),
            enc_lens,
            lengths.to(frames.device),
            blank=head.out_features - 1,
            zero_infinity=True,
        )

    @torch.no_grad()
    def transcribe(
        self,
        wavs: torch.Tensor,
        wav_lens: torch.Tensor,
        *,
        max_new_tokens: int | None = None,
        num_beams: int = 1,
        languages: list[str] | None = None,
    ) -> list[str]:
        """Decode transcripts (greedy by default, beam search with ``num_beams > 1``).

        Uses transformers' ``generate`` on ``inputs_embeds`` of the left-padded prefix; it
        returns only the new tokens, which are decoded with ``skip_special_tokens``.
        ``languages``: one per utterance, needed when the prompt names ``{language}``.
        """
        _, _, audio, audio_lens = self.encode(wavs, wav_lens)
        batch = self.assemble(audio, audio_lens, languages=languages)
        tokens = self.llm.generate(
            inputs_embeds=batch.inputs_embeds,
            attention_mask=batch.attention_mask,
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            do_sample=False,
            num_beams=num_beams,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
        )
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        return [t.strip() for t in texts]

    # ------------------------------------------------------------------ persistence
    def save_pretrained(self, folder: str | Path) -> Path:
        """Save base weights in the checkpoint layout read by ``build_speech_llm(folder)``.

        Writes ``encoder/`` (as a ``WhisperModel``: the saved encoder plus a freshly initialised
        decoder, so the folder loads with ``WhisperModel.from_pretrained`` like the hub models),
        ``llm/``, tokenizer, feature extractor, ``extra.safetensors`` (connector, CTC head) and
        ``speech_llm.json``. Refuses a model with LoRA adapters (merge or save them separately
        with :func:`speechbrain_fl.models.checkpoint.save_federated_model`).
        """
        from transformers import WhisperModel

        if any("lora_" in n for n, _ in self.named_parameters()):
            raise ValueError("save_pretrained stores base weights only; this model has LoRA")
        folder = Path(folder)
        whisper = WhisperModel(self.encoder.config)
        whisper.encoder = self.encoder
        whisper.save_pretrained(folder / "encoder")
        self.feature_extractor.save_pretrained(folder / "encoder")
        self.llm.save_pretrained(folder / "llm")
        self.tokenizer.save_pretrained(folder / "llm")
        extra = {f"connector.{k}": v for k, v in self.connector.state_dict().items()}
        if self.ctc_head is not None:
            extra.update({f"ctc_head.{k}": v for k, v in self.ctc_head.state_dict().items()})
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in extra.items()},
            folder / "extra.safetensors",
        )
        spec = {
            "kind": "whisper_llm",
            "encoder": "encoder",
            "llm": "llm",
            "connector": self.connector.kind,
            "downsample_k": self.connector.downsample_k,
            "prompt": self.prompt,
            "max_new_tokens": self.max_new_tokens,
        }
        (folder / "speech_llm.json").write_text(json.dumps(spec, indent=2))
        return folder
