"""`/v1/videos`: `router` (the routes), `protocol` (request and job models, the request's checks), `serving`
(the handlers)."""
