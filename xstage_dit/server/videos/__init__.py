"""`/v1/videos`: `router` (the routes), `protocol` (request, video object, list and delete models, the request's
checks), `serving` (the handlers), `content` (the thumbnail and spritesheet of a completed video)."""
