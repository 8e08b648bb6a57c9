"""The Modal app: app.py (`modal run runners/modal/app.py::kernels`)."""
