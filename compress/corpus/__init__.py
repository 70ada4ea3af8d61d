"""Text sources to token splits: train / calib / selection / test blocks and the held-out source."""
