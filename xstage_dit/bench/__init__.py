"""The end-to-end latency harness behind `xstage-dit bench` (`e2e`)."""
