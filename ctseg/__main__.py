"""`python -m ctseg`: the command line, as the `ctseg` console script runs it (for a Python
whose ctseg was installed without its scripts, e.g. `pip install --target`)."""

from ctseg.cli.main import main

# The guard matters: `ctseg preprocess --workers` starts processes that import this again.
if __name__ == "__main__":
    main()
