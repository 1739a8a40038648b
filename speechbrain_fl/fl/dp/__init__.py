"""The run's differential privacy on the server: cohort sampling, the mechanism, the canary
audit, and what the run reports about its guarantee."""
