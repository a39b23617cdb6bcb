"""`POST /v1/images/generations`: `router` (the route), `protocol` (request and response models, the
request's checks), `serving` (the handler)."""
