"""speechbrain-fl: SpeechBrain recipes for private federated speech training.

Subpackages
-----------
privacy   component-aware DP: layouts, clip budgets, clipping, noise, accounting (torch only)
fl        Flower integration: ClientApp/ServerApp factories, DP strategy, telemetry
models    speech LLM (encoder + connector + LLM with LoRA), its presets and seed pretraining;
          a multi-exit wav2vec 2.0 for the SUPERB recipe is planned
distill   planned (empty today): DP teacher helpers and offline knowledge distillation
data      corpus preparation helpers, client partitions and the embedded synthetic corpora
metrics   speaker-level bootstrap confidence intervals (WER, classification)

Modules
-------
recipe        layered hparams loading and run options shared by the recipe scripts
run_outputs   the rounds.csv / group_norms.csv contract, their readers, results tables
plots         the figures every federated run writes
atomic        atomic file and folder writes
"""

__version__ = "0.1.0"
