"""Cancellation across ranks without a per-step broadcast: `xstage-dit serve --sp 2` (gloo, CPU), a long
streamed request cancelled while it runs stops within a few steps on both ranks (the stop vote), and the
next request gets the single-process image: the ranks still agree, step for step."""

from __future__ import annotations

import json

from tests.helpers.server import assert_same_image, decode_png, multirank_server, reference_image, tiny


def test_cancel_on_two_ranks_then_serve_again():
    with multirank_server("--log-level", "warning", "--max-batch-size", "1", log_name="serve-cancel",
                          client_timeout_s=120) as (client, _, _):
        body = {"prompt": "slow", "size": "512x512", "num_inference_steps": 100, "seed": 3, "stream": True}
        events, job_id, cancelled_at = [], None, None
        with client.stream("POST", "/v1/images/generations", json=body) as stream:
            for line in stream.iter_lines():
                # per-step progress rides in comment lines (": xstage.progress {json}"), the end in data lines
                if not line.startswith(("data:", ": xstage.progress ")):
                    continue
                event = json.loads(line.split(" ", 2)[2] if line.startswith(":") else line[5:])
                events.append(event)
                job_id = job_id or event.get("job_id")
                if event.get("steps_done", 0) >= 2 and cancelled_at is None:
                    cancelled_at = event["steps_done"]
                    assert client.delete(f"/v1/jobs/{job_id}").status_code in (200, 202)
                if "error" in event or event.get("status") in ("cancelled", "failed", "completed"):
                    break
        assert events[-1].get("error", {}).get("status") == "cancelled", events[-3:]
        # The batch itself stopped (within a few steps of the cancel), on both ranks: the worker is free.
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "cancelled" and job["steps_done"] < 100, job
        # The ranks left the batch at the same step: the next request runs and gives the right image.
        r = client.post("/v1/images/generations", json={"prompt": "a red cat", "size": "64x64",
                                                         "num_inference_steps": 2, "seed": 5})
        assert r.status_code == 200, r.text
        pipe, served = tiny()
        want = reference_image(pipe, served, "a red cat", 5, 64, 64, 2)
        assert_same_image(decode_png(r.json()["data"][0]["b64_json"]), want, "after a cancelled batch")
        assert client.get("/health").status_code == 200
