"""The network under JAX, on its devices: the backend, its plans (whole volume, level-wise
tiles, fixed windows) and its policy of boxes on accelerators."""
