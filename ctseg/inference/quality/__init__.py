"""Whether to trust a prediction: the model's uncertainty, the scan's checks, the verdict
under the run's thresholds."""
