"""A tool-use environment: every episode hides a key-value store the model can only query."""
