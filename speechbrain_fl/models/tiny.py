"""The ``tiny`` speech-LLM checkpoint of the embedded default, built from the real config classes.

The tiny model is a small Whisper encoder (``WhisperConfig``) and a small Llama decoder
(``LlamaConfig``), randomly initialised with a fixed seed, saved with ``save_pretrained`` to a
cache folder in the same layout as :meth:`SpeechLLM.save_pretrained` writes, and loaded back by
:func:`speechbrain_fl.models.presets.build_speech_llm` through the same
``WhisperModel.from_pretrained`` / ``AutoModelForCausalLM.from_pretrained`` /
``AutoTokenizer.from_pretrained`` / ``AutoFeatureExtractor.from_pretrained`` calls the real
models use.

Short inputs: Whisper's encoder insists on ``2 * max_source_positions`` mel frames (3000 = 30 s for
the real models). Running 30 s of padding through even a tiny encoder wastes CPU, so the tiny
encoder has ``max_source_positions=125`` and its ``WhisperFeatureExtractor`` has
``chunk_length=5`` and a 20 ms hop (``hop_length=320``, 25 ms windows): every utterance is padded
(or truncated) to 5 s = 250 mel frames, and the encoder runs at 25 Hz instead of Whisper's 50 Hz.
That halves the encoder's cost, which is most of a CPU training step (fwd+bwd of a batch of 16:
104 ms at 250 positions, 46 ms at 125, 2 threads). Audio tokens past an utterance's real length are
dropped before the LLM (see ``SpeechLLM.encode``).

Tokenizer: one token per character over the lowercase alphabets of the 8 MLS languages (built with
the ``tokenizers`` library, wrapped as ``PreTrainedTokenizerFast``), so a ~100-entry vocabulary
keeps the LLM's embedding and output layers small.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperModel,
)

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")

# Lowercase letters of English, German, Dutch, French, Spanish, Italian, Portuguese and Polish
# (the 8 MLS languages), digits, space, apostrophe and hyphen.
MLS_ALPHABET = (
    "abcdefghijklmnopqrstuvwxyz"
    "äöüß"  # German
    "àâæçéèêëîïôœùûüÿ"  # French
    "áéíóúñ"  # Spanish
    "ìíòó"  # Italian
    "ãõâêô"  # Portuguese
    "ąćęłńóśźż"  # Polish
    "0123456789"
    " '-"
)

TINY_ENCODER = {
    "d_model": 128,
    "encoder_layers": 2,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 256,
    "decoder_layers": 1,
    "decoder_attention_heads": 4,
    "decoder_ffn_dim": 256,
    "num_mel_bins": 80,
    "max_source_positions": 125,
    "max_target_positions": 64,
    # The decoder exists only so the folder is a standard WhisperModel checkpoint; keep it small.
    "vocab_size": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
    "begin_suppress_tokens": None,
    "suppress_tokens": None,
}
TINY_CHUNK_SECONDS = 5
TINY_HOP_LENGTH = 320
TINY_LLM = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
TINY_SPEC = {
    "connector": "linear",
    "downsample_k": 4,
    "prompt": "transcribe:",
    "max_new_tokens": 128,
}


def tiny_config_tag() -> str:
    """Short hash of the tiny architecture (configs, front end, alphabet) for cache folder names.

    A cache written by an older version of the tiny configs gets a different folder instead of
    being loaded with weights of the wrong shape.
    """
    config = {
        "encoder": TINY_ENCODER,
        "llm": TINY_LLM,
        "spec": TINY_SPEC,
        "chunk": TINY_CHUNK_SECONDS,
        "hop": TINY_HOP_LENGTH,
        "alphabet": MLS_ALPHABET,
    }
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]


def build_char_tokenizer(alphabet: str = MLS_ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level ``PreTrainedTokenizerFast`` (NFC + lowercase, one token per character).

    Arguments
    ---------
    alphabet : str
        Characters given their own id; anything else maps to ``<unk>``.

    Returns
    -------
    PreTrainedTokenizerFast
        ids 0-3 are ``<pad> <s> </s> <unk>``; ``decode`` concatenates characters.

    Example
    -------
    >>> tok = build_char_tokenizer()
    >>> tok.decode(tok("Żółć ça", add_special_tokens=False).input_ids)
    'żółć ça'
    """
    chars = list(dict.fromkeys(alphabet))
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *chars])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def create_tiny_checkpoint(
    folder: str | Path, *, seed: int = 0, tokenizer: PreTrainedTokenizerFast | None = None
) -> Path:
    """Write a randomly initialised tiny speech-LLM checkpoint to ``folder`` (idempotent).

    Layout: ``encoder/`` (``WhisperModel`` + ``WhisperFeatureExtractor``), ``llm/``
    (``LlamaForCausalLM`` + char tokenizer), ``speech_llm.json`` (connector spec, prompt). The
    connector has no saved weights, so it is initialised from scratch when loaded, as in the paper.

    Arguments
    ---------
    folder : str or Path
        Target folder; if it already holds ``speech_llm.json`` nothing is written.
    seed : int
        Seed of the random initialisation (the same seed gives the same weights).
    tokenizer : PreTrainedTokenizerFast, optional
        The LLM's tokenizer; default: :func:`build_char_tokenizer`.

    Returns
    -------
    Path
        ``folder``.

    Example
    -------
    >>> import tempfile
    >>> path = create_tiny_checkpoint(tempfile.mkdtemp())
    >>> sorted(p.name for p in path.iterdir())
    ['encoder', 'llm', 'speech_llm.json']
    """
    folder = Path(folder)
    if (folder / "speech_llm.json").is_file():
        return folder
    tokenizer = tokenizer if tokenizer is not None else build_char_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        whisper = WhisperModel(WhisperConfig(**TINY_ENCODER))
        llm = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(tokenizer),
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **TINY_LLM,
            )
        )
    features = WhisperFeatureExtractor(
        feature_size=TINY_ENCODER["num_mel_bins"],
        chunk_length=TINY_CHUNK_SECONDS,
        hop_length=TINY_HOP_LENGTH,
    )
    whisper.save_pretrained(folder / "encoder")
    features.save_pretrained(folder / "encoder")
    llm.save_pretrained(folder / "llm")
    tokenizer.save_pretrained(folder / "llm")
    spec = {"kind": "whisper_llm", "encoder": "encoder", "llm": "llm", **TINY_SPEC}
    # Written last: its presence marks a complete checkpoint.
    (folder / "speech_llm.json").write_text(json.dumps(spec, indent=2))
    return folder
