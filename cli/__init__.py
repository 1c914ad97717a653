"""The `ctseg` command line: parsing, progress, tables and exit codes, no logic of its own."""
