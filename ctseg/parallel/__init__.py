"""Spreading work over devices: which devices a command uses, meshes and halo exchange,
layouts fitted to the devices present, and the compilation cache."""
