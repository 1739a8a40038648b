"""Client side: one client round in :mod:`.train` (the ClientApp's train handler on SpeechBrain's
``Brain``), and the batches its DataLoader collates (:mod:`.collation`)."""
