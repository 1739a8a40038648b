"""speechbrain_fl.models."""
