"""raywright tune: Optuna + ASHA sweeps of the training job."""
