"""Corpus helpers: espeak-ng synthesis, synthetic speakers, sentences, the embedded MLS corpus.

:func:`speechbrain_fl.data.mls_synth.generate_mls_corpus` writes a small 8-language corpus in
the real MLS layout, so ``recipes/MLS/mls_prepare.py`` runs on it unchanged; the modules
:mod:`~speechbrain_fl.data.espeak` and :mod:`~speechbrain_fl.data.voices` are meant for the
other recipes' corpora too (keywords, speaker voices, gendered voice classes).
"""
