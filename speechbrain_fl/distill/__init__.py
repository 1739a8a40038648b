"""speechbrain_fl.distill."""
