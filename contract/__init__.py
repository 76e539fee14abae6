"""Definitions every room shares; this package imports nothing of the project."""
