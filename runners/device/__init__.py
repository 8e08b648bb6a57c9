"""Scripts run on a lent GPU (the device tool), and the lab kernel one of them times
(packed_sm90_ws): outside the remnant package, so not in its wheel."""
