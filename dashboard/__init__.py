"""ultraep.dashboard (see the issue that builds it)."""
