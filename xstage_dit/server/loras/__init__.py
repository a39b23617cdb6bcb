"""`GET /v1/loras`: `router` (the route), `protocol` (the list), `serving` (the handler)."""
