"""Load tests and benchmarks for serve_app (run with `make bench`)."""
