"""From raw scans to the prepared store: raw data-set layouts, the grids (cube or spacing),
building the store in worker processes, reading it, and its splits and folds."""
