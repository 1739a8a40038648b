"""Server side: the ServerApp's main (:mod:`.main`), its round loop, the DP strategy, and the
checks of every client reply (:mod:`.replies`)."""
