"""JSON Schemas of run, collection and benchmark records (shipped as package data)."""
