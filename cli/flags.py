"""The command line's words for the options the library names in its errors.

The library names an option as its Python API or config spells it (`OptionError`:
`` `margin_mm` must not be negative``); a command line user typed a flag, and reads the
same message with the flag in its place (`cli/app.py` respells every command's
`OptionError`). One table for every command: a library name means one flag everywhere.
"""

FLAGS = {
    "margin_mm": "--margin",
}
