"""Models: the speech-LLM of the alpha-split paper (encoder + connector + causal LLM, LoRA).

:func:`build_speech_llm` loads a preset (``whisper_tinyllama``, ``whisper_eurollm``, ``voxtral``,
``tiny``) or a checkpoint folder through ``from_pretrained``; :func:`pretrain_seed_model` trains
the tiny model centrally before federated training.
"""

from .presets import PRESETS, build_speech_llm
from .pretrain import pretrain_seed_model
from .speech_llm import SpeechLLM

__all__ = [
    "PRESETS",
    "SpeechLLM",
    "build_speech_llm",
    "pretrain_seed_model",
]
