"""The CPU reference backend: CPU device, gloo communicator, reference kernels."""
