"""Benchmarks of tierkv's tiers, each against a baseline measured in the same run."""
