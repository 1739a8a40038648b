"""Client side: the ClientApp's train handler (:mod:`.train`) and the parts of a client round
(data, optimiser, local training, the update and its reply)."""
