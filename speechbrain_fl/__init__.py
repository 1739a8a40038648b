"""speechbrain-fl: SpeechBrain recipes for private federated speech training.

Subpackages
-----------
privacy   component-aware DP: layouts, clip budgets, clipping, noise, accounting (torch only)
fl        Flower integration: ClientApp/ServerApp factories, DP strategy
models    speech-LLM (encoder + connector + LLM with LoRA), multi-exit wav2vec 2.0
distill   DP teacher helpers and offline knowledge distillation
data      corpus preparation helpers and the embedded synthetic corpora
metrics   speaker-level bootstrap confidence intervals, classification metrics
"""

__version__ = "0.1.0"
