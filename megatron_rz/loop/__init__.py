"""The one training loop (sync is max_lag = 0), the rollout producer and process, resume, metrics."""
