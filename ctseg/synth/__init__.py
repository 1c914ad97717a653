"""`ctseg synth`: synthetic LiTS-like CT phantoms at physical scale (the demo's and the
tests' data)."""
