"""Pure tests: decisions, folds and codecs, no database and no network."""
