"""speechbrain_fl.data."""
