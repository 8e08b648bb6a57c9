"""Remnant: packed C4 attention records for DeepSeek-V4, and a serving benchmark framework."""

__version__ = "0.1.0"
