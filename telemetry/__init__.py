"""ultraep.telemetry (see the issue that builds it)."""
