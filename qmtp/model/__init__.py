"""The model: config, parameters and their loading pipeline, layers, the target and the MTP head."""
