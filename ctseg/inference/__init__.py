"""`ctseg predict` and the Python API: the predictor and its one scan pipeline, over the
network on a backend (`network/`), the scan's way to a grid and back (`scan/`) and the
quality of each prediction (`quality/`)."""
