"""The prepared store as every command reads it (its manifest, its cases) and the grids: the
cube, or the scan at a fixed spacing, and resampling there and back. Building the store
from raw scans is `ctseg.data_prep`'s."""
