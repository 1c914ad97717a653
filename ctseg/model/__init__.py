"""The network and its programs: the 3D U-Net, the loss, the jit-able steps, and what a
layout costs (compile-only plans, step timing)."""
