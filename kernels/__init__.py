"""ultraep.kernels (see the issue that builds it)."""
