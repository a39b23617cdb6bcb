"""`GET /v1/models` and `GET /v1/calibration`: `router`, `protocol` (the model card), `serving`."""
