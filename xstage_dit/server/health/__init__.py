"""`GET /health` and `GET /metrics`: `router` (nothing to model: the answers are built in place)."""
