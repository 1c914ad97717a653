"""The run directory: its files (config, metrics, layouts, fold, fingerprint), checkpoints,
the trained model loaded for inference, and evaluation folders."""
