"""Backends built into core (registered through core's own ``tactix.backends`` entry point)."""
