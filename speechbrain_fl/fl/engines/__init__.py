"""How a task runs: the local backend and Ray (:func:`.run.run_simulation`), ``flwr run`` and the
Deployment Engine (:mod:`.flwr_apps`)."""
