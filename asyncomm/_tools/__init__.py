"""Tools: the command line, the launcher, the benchmarks and the soak test."""
