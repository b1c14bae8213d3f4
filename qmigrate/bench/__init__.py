"""What `qmigrate bench` runs (tooling, not the product): the standard comparison and its paths,
the per-step measures, and `bench serve`. Developer probes live in benchmarks/ at the top."""
