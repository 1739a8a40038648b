"""SpeechBrain's ``TensorboardLogger`` for federated rounds: the round is the step.

A recipe YAML's ``train_logger`` receives the engine's round lines (``stats_meta={"round": r,
"epsilon": e}``, ``train_stats={"loss": ...}``, ``valid_stats`` = the server's metrics) and the
recipe's own (``{"round": 0, "stage": "test"}``, ``{"stage": "seed pretraining", "steps": 4}``).
SpeechBrain's :class:`~speechbrain.utils.train_logger.TensorboardLogger` writes every meta
value as a scalar (a text value such as ``stage: test`` fails) and counts its own steps per
call (so round 5's WER would sit at step 3 when rounds 2 and 4 were not evaluated).
:class:`RoundTensorboardLogger` is that logger with these changes: the step of a call is its
``round`` (else its ``epoch`` or ``steps``, else the logger's own count); text meta values are
written as TensorBoard text instead of scalars; a line without a round that names its
``stage`` (the seed pretraining) has its tags prefixed by it (``seed pretraining/loss/train``),
so it does not land on a round's step. Each call is flushed, so a killed run keeps its rounds.

Use it in a recipe YAML (``pip install speechbrain-fl[tensorboard]``)::

    train_logger: !new:speechbrain_fl.recipe.train_logger.RoundTensorboardLogger
        save_dir: !ref <output_folder>/tensorboard
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from speechbrain.utils.train_logger import TensorboardLogger

__all__ = ["RoundTensorboardLogger"]


class RoundTensorboardLogger(TensorboardLogger):
    """TensorBoard logging of federated rounds (see the module docstring).

    Arguments
    ---------
    save_dir : str
        Folder of the event files.

    Example
    -------
    >>> import tempfile
    >>> tb = RoundTensorboardLogger(tempfile.mkdtemp())  # doctest: +SKIP
    >>> tb.log_stats({"round": 3, "epsilon": 1.2}, valid_stats={"WER": 0.4})  # doctest: +SKIP
    """

    def log_stats(
        self,
        stats_meta: Mapping[str, Any],
        train_stats: Mapping[str, Any] | None = None,
        valid_stats: Mapping[str, Any] | None = None,
        test_stats: Mapping[str, Any] | None = None,
        verbose: bool = False,
    ) -> None:
        """Write one call's values at step ``round`` (or ``epoch``, or a running count)."""
        if self.writer is None:  # not the main process (SpeechBrain's rule)
            return
        self.global_step["meta"] += 1
        numeric = {
            k: v
            for k, v in stats_meta.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        step = next(
            (int(numeric[k]) for k in ("round", "epoch", "steps") if k in numeric),
            self.global_step["meta"],
        )
        # a line outside the rounds (the seed pretraining: {"stage": "seed pretraining"}) gets
        # its stage as a tag prefix, so its loss does not land on a round's step
        stage = stats_meta.get("stage")
        prefix = f"{stage}/" if "round" not in numeric and isinstance(stage, str) else ""
        for name, value in stats_meta.items():
            if name in numeric:
                self.writer.add_scalar(prefix + name, value, step)
            elif name != "stage" or not prefix:
                self.writer.add_text(name, str(value), step)
        for dataset, stats in (
            ("train", train_stats),
            ("valid", valid_stats),
            ("test", test_stats),
        ):
            for stat, value in (stats or {}).items():
                tag = f"{prefix}{stat}/{dataset}"
                if isinstance(value, list):  # per-batch values: SpeechBrain's own count
                    for item in value:
                        count = self.global_step[dataset].get(stat, 0) + 1
                        self.writer.add_scalar(tag, item, count)
                        self.global_step[dataset][stat] = count
                elif isinstance(value, (int, float)):
                    self.writer.add_scalar(tag, value, step)
        self.writer.flush()
