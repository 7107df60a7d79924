"""Files in and out: prompt and SFT data (with file and line in every error), checkpoints,
metric loggers, evaluation samples."""
