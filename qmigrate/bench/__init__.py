"""Benchmarks and fake fleets (tooling, not the product): `qmigrate bench` and its paths."""
