"""Hydra config tree of remnant-run (shipped as package data)."""
