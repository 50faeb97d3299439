"""Overlap of compute and communication: ``compute`` off the loop, ``GradSync``."""
