"""The kernels stage."""
