"""The filesystem side (write, read, stage, import); imports the format layer and the base modules, never SQL."""
