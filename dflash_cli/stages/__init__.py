"""Pipeline stages: convert -> inject -> export -> compile, one job each, and the pipeline that runs them."""
