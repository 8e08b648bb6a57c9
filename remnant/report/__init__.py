"""Reports over run directories: tables with confidence intervals, paired deltas, plots."""
