"""The network in ONNX Runtime on the host's CPU cores: the backend and the exported graph."""
