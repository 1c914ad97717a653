"""The command line: one module per command (parse options, start JAX, call the library,
print, set the exit code); nothing below imports it."""
