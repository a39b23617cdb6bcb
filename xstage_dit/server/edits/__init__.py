"""`POST /v1/images/edits`: `router` (the route), `protocol` (the request model, its checks), `serving` (reading the
multipart or JSON body, the handler)."""
