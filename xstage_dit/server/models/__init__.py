"""`GET /v1/models`, `GET /v1/models/{id}` and `GET /v1/calibration`: `router`, `protocol` (the model card),
`serving`."""
