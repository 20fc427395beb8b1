"""Pipeline stages: convert -> inject -> export -> compile, one job each."""
