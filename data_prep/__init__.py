"""Where raw data comes from: public data-set folder layouts and a synthetic LiTS-like phantom."""
