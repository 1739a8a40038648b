"""The MLS recipe's Brain (transcript cross-entropy + optional CTC, WER decoding) and its data.

Its optimizer (``opt_class``), learning-rate schedule over the rounds (``lr_schedule``) and WER
computer (``error_stats``) are the hparams file's objects.

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import speechbrain as sb

from speechbrain_fl.data.audio_check import guarded_read


def make_dataset(csv_path, data_folder, *, skip_unreadable=False):
    """A DynamicItemDataset yielding ``sig`` (16 kHz waveform), ``wrd`` and ``language``.

    ``skip_unreadable``: a file that fails to decode yields an ``Unreadable`` marker (one log
    line) that the client's collate function drops (a client's training set), instead of
    raising (evaluation, where every utterance counts).
    """
    dataset = sb.dataio.dataset.DynamicItemDataset.from_csv(
        csv_path=csv_path, replacements={"data_root": data_folder}
    )

    @sb.utils.data_pipeline.takes("wav")
    @sb.utils.data_pipeline.provides("sig")
    def audio_pipeline(wav):
        if skip_unreadable:
            return guarded_read(sb.dataio.dataio.read_audio, wav, wav)
        return sb.dataio.dataio.read_audio(wav)

    sb.dataio.dataset.add_dynamic_item([dataset], audio_pipeline)
    sb.dataio.dataset.set_output_keys([dataset], ["id", "sig", "wrd", "language"])
    return dataset.filtered_sorted(sort_key="duration")


class SpeechLLMBrain(sb.Brain):
    """Trains the speech-LLM on transcript cross-entropy (+ optional CTC) and decodes for WER.

    The federated engine calls ``fit`` for a client's local epochs; the learning rate follows
    ``lr_schedule`` over the federated rounds (``fl_round`` / ``fl_num_rounds`` are set by the
    engine from the round's config before each local training).
    """

    def compute_forward(self, batch, stage):
        """Loss terms on the batch; greedy transcripts too outside training."""
        batch = batch.to(self.device)
        wavs, wav_lens = batch.sig
        model = self.modules.model
        languages = list(batch.language)
        out = model(wavs, wav_lens, list(batch.wrd), languages)
        hyps = None
        if stage != sb.Stage.TRAIN:
            hyps = model.transcribe(
                wavs,
                wav_lens,
                max_new_tokens=self.hparams.max_new_tokens,
                num_beams=self.hparams.num_beams,
                languages=languages,
            )
        return out, hyps

    def compute_objectives(self, predictions, batch, stage):
        """Transcript CE (+ ctc_weight * CTC); WER bookkeeping outside training."""
        out, hyps = predictions
        if hyps is not None:
            self.wer_metric.append(
                ids=batch.id,
                predict=[h.split() for h in hyps],
                target=[w.split() for w in batch.wrd],
            )
        return out.loss

    def init_optimizers(self):
        """``opt_class`` over the model's parameter groups at this round's lr.

        The encoder's group runs at ``lr * encoder_lr_multiplier`` (the paper's Appendix A).
        """
        lr = self.round_lr()
        groups = self.modules.model.param_groups(lr, self.hparams.encoder_lr_multiplier)
        self.optimizer = self.hparams.opt_class(groups, lr=lr)
        self.optimizers_dict = {"optimizer": self.optimizer}
        if self.checkpointer is not None:
            self.checkpointer.add_recoverable("optimizer", self.optimizer)

    def round_lr(self):
        """This round's learning rate: ``lr_schedule(fl_round, fl_num_rounds)``."""
        return self.hparams.lr_schedule(
            getattr(self, "fl_round", 1), getattr(self, "fl_num_rounds", 1)
        )

    def on_stage_start(self, stage, epoch=None):
        """A fresh WER accumulator (``error_stats``) for each evaluation stage."""
        if stage != sb.Stage.TRAIN:
            self.wer_metric = self.hparams.error_stats()

    def on_stage_end(self, stage, stage_loss, epoch=None):
        """Store the stage statistics (read by the engine and by ``evaluate_test``)."""
        stats = {"loss": stage_loss}
        if stage != sb.Stage.TRAIN:
            stats["WER"] = self.wer_metric.summarize("error_rate") / 100.0
        self.last_stats = stats
