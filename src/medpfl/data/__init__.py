"""Data: sources, preprocessing, partitioning, table schemas."""
