"""speechbrain_fl.metrics."""
