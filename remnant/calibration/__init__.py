"""Calibration: which NoPE coordinates each CSA layer keeps, and how well they do.

- captures: calibration captures (decode queries and C4 latents per CSA layer), their
  file; capture_recorder: what a serving process records them with.
- retention: retention maps (per layer the kept coordinates, with their provenance) and
  retention profiles; policies: the training-free policies that build a map; learned:
  the offline learned scorer.
- fidelity, fidelity_compare, fidelity_metrics: packed attention against native on
  captures, per layer, R and policy.

It builds on remnant.kv (formats, codec, packing, reference attention), which imports
nothing of it. Its commands: remnant.cli.captures, build_map, learned and fidelity.
"""
