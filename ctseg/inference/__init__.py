"""`ctseg predict` and the Python API: engines (JAX devices or ONNX Runtime, whole or
exactly tiled), a run's model on its grid, ensembles, the way back to the scan, post-
processing, scan checks and the files written."""
