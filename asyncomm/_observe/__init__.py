"""Observers: the trace recorder and timeline, debug-mode checks, the loop watchdog, and
the status side channel. The core reports to them through ``_core.instrument``."""
