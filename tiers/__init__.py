"""Secondary tiers: fs, obj (S3), p2p and an in-memory example."""
