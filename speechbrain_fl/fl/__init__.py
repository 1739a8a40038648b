"""speechbrain_fl.fl."""
