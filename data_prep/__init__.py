"""Raw data sets into the prepared store: `ctseg preprocess` and `ctseg folds`
(installed as `ctseg.data_prep`)."""
