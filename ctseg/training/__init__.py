"""`ctseg train`: the training loop, its input pipeline, validation between steps and a
clean stop on Ctrl-C or SIGTERM."""
