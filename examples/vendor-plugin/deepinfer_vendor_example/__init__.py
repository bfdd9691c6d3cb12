"""An example vendor backend: a device, a kernel set with its own ops, and the bundle naming them."""
