"""`/v1/jobs/{id}` (any job, image or video): `router` and `serving`; its answers are plain dicts (no
protocol models: the schema of these routes is left open). The queue itself is `xstage_dit.server.job_queue`."""
