"""Metrics with speaker-level bootstrap confidence intervals (WER, classification)."""
