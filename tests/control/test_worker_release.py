"""A Ray worker's Flight `release` in the moment between a rollout's end on the worker (its stream
has ended: a trainer's pull has returned) and the worker handing that end to the control plane.
It was refused "cancel it first" and the result stayed until --ttl-s. `RolloutWorker` imports no
Ray: it runs here in process, with its own Flight server, and the release is sent to that server
from the rollout's own end (its settle hook), which is that moment."""

from __future__ import annotations

import json
import uuid

import pyarrow.flight as flight
from sigmaflight.control.backends.worker import RolloutWorker, WorkerConfig
from sigmaflight.pipeline.spec import RolloutSpec


def test_a_release_at_the_worker_once_the_stream_has_ended_is_taken_before_the_end_is_handed_over():
    worker = RolloutWorker(WorkerConfig(index=0))
    try:
        job = uuid.uuid4().hex
        worker.reserve(job)
        answers: list[dict] = []
        settle = worker._set_outcome

        def release_then_settle(ctx, outcome):  # the rollout ended: stream done, run_batch not returned
            with flight.FlightClient(worker.flight.locations[0]) as fc:
                (answer,) = fc.do_action(flight.Action("release", ctx.job_id.encode()))
            answers.append(json.loads(answer.body.to_pybytes()))
            settle(ctx, outcome)

        worker._set_outcome = release_then_settle  # type: ignore[method-assign]
        spec = RolloutSpec(model="tiny-sd3", prompts=("a red cube",), num_inference_steps=2, seed=1)
        out = worker.run_batch([job], [spec.to_json()], [None])
        assert out["outcomes"][job]["state"] == "succeeded"
        assert answers == [{"id": job, "released": True}]
        assert worker.stored_ids() == []  # freed on the worker
        assert worker.take_events()["released"] == [job]  # and reported, so the control plane follows
    finally:
        worker.stop()
