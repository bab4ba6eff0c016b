"""The Preprocessor: chat template, tokenization and validation before any engine time, and its
Serve deployment (the aggregation window)."""
