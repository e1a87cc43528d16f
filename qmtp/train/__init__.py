"""Training the MTP head (or a whole demo model) and exporting the result as a checkpoint."""
