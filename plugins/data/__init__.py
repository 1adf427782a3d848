"""Data sources: files and datasets read into ftcore's row schema, with the formats they convert from and the shared filters (quality, dedup, splits)."""
