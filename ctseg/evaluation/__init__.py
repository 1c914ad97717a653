"""`ctseg evaluate`: the LiTS metrics, scoring label maps, and evaluations that predict
with a run, an ensemble or a cross-validation."""
