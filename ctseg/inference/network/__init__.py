"""The network on a backend: JAX on the devices or ONNX Runtime on the host's cores, its
plans for a box (whole, level-wise tiles, fixed windows), the class probabilities."""
