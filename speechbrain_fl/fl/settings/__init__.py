"""A federated run's settings (:class:`.config.FLConfig`) and every check of them, privacy
settings and the keys a resumed run must keep included."""
