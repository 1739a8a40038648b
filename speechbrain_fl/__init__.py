"""speechbrain-fl: SpeechBrain recipes for private federated speech training.

Subpackages
-----------
privacy   component-aware DP: layouts, clip budgets, clipping, noise, accounting (torch only)
fl        Flower integration: ClientApp/ServerApp factories, DP strategy, layer-wise partial
          aggregation, telemetry
models    speech LLM (encoder + connector + LLM with LoRA), its presets and seed pretraining;
          multi-exit wav2vec 2.0 (SUPERB); gender classifier with DSAF (Private-Gender)
distill   offline knowledge distillation: teacher-output store, KD loss, collapse-aware metrics
data      corpus preparation helpers, client partitions and the embedded synthetic corpora
metrics   speaker-level bootstrap confidence intervals (WER, classification)
recipe    the recipe kit: hparams loading and --debug, prepare once, cached seed model, typed
          run settings, the federated skeleton both engines load, the report, the run lock
utils     atomic file and folder writes; the per-output-folder run lock

Modules
-------
run_outputs   the rounds.csv / group_norms.csv contract, their readers, results tables
plots         the figures every federated run writes
cli           the ``speechbrain-fl`` console script
atomic        re-export of :mod:`speechbrain_fl.utils.atomic` (the old import path)
"""

__version__ = "0.1.0"

# Before SpeechBrain's train_logger module is imported (it warns at import time about
# torchvision, which no recipe here needs): see speechbrain_fl/utils/logging.py.
from speechbrain_fl.utils.logging import install_filters as _install_filters  # noqa: E402

_install_filters()
