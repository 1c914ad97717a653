"""The command line: one module per command (parse options, start JAX, call the library,
print, set the exit code); nothing below imports it."""

import time

# When the command started, as near as Python lets a package tell (this is imported before
# any command's module): `--verbose` says how long the imports took before the work began.
STARTED = time.perf_counter()
