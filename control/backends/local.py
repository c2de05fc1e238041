"""The local backend: runs rollouts in this process and keeps results in the result store.

This is where the planes meet: the pipeline's records (ScheduleSnapshot, StepCapture)
become the data plane's (TrajectoryHeader, StepBatch), batch by batch, as the loop runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from sigmaflight.control.jobs.manager import Job
from sigmaflight.control.policy import check_started_with
from sigmaflight.control.streams import outputs_table, stream_names
from sigmaflight.dataplane.record import StepBatch, TrajectoryHeader
from sigmaflight.dataplane.store import ResultStore
from sigmaflight.dataplane.streams import CONDITIONING, stream_table
from sigmaflight.pipeline.models import ModelRegistry
from sigmaflight.pipeline.rollout import parent_metadata, rollout_metadata, run_rollout
from sigmaflight.pipeline.spec import RolloutCancelled, ScheduleSnapshot, StepCapture


def header_for(
    job_id: str, snapshot: ScheduleSnapshot, rollout: dict[str, Any], log_probs: bool,
    *, velocities: bool = False, parent: dict[str, Any] | None = None,
) -> TrajectoryHeader:
    return TrajectoryHeader(
        rollout_id=job_id,
        sigmas=snapshot.sigmas,
        timesteps=snapshot.timesteps,
        steps=snapshot.steps,
        sde_steps=snapshot.sde_steps,
        seeds=snapshot.seeds,
        num_outputs_per_prompt=snapshot.num_outputs_per_prompt,
        latent_shape=snapshot.latent_shape,
        latent_dtype=snapshot.latent_dtype,
        log_probs=log_probs,
        rollout=rollout,
        prompt_index=tuple(snapshot.prompt_index),
        parent_sample=None if snapshot.parent_sample is None else tuple(snapshot.parent_sample),
        parent=parent,
        velocities=velocities,
    )


class LocalBackend:
    """Runs rollouts on this process's worker threads; results live in `store`, served by `flight`."""

    def __init__(
        self,
        registry: ModelRegistry,
        store: ResultStore,
        *,
        locations: Callable[[], list[str]],
        batch_invariant: bool = False,
    ) -> None:
        self.registry = registry
        self.store = store
        self.locations = locations
        self.batch_invariant = batch_invariant

    def run(
        self, job: Job, *, on_progress: Callable[[int, int], None], should_stop: Callable[[], bool]
    ) -> dict[str, Any]:
        spec = job.spec
        assert spec is not None
        model = self.registry.get(spec.model)
        writer = None
        header: TrajectoryHeader | None = None

        def on_schedule(snapshot: ScheduleSnapshot) -> None:
            nonlocal writer, header
            check_started_with(spec.expected_digest, snapshot.model_digest)
            rollout = {"id": job.id, **rollout_metadata(model, spec, snapshot)}
            rollout["streams"] = stream_names(spec)
            header = header_for(job.id, snapshot, rollout, spec.return_log_probs,
                                velocities=spec.return_velocities, parent=parent_metadata(spec))
            writer = self.store.create(header)

        def on_step(capture: StepCapture) -> None:
            assert writer is not None
            writer.append(StepBatch(step=capture.step, latent=capture.latent, log_prob=capture.log_prob,
                                    velocity=capture.velocity))

        try:
            result = run_rollout(
                model,
                spec,
                on_schedule=on_schedule,
                on_step=on_step,
                on_progress=on_progress,
                should_stop=should_stop,
                keep=False,
                per_sample_model_calls=self.batch_invariant,
            )
            if spec.return_outputs:  # after the last step, on the rollout's device; nothing otherwise
                assert writer is not None and header is not None
                writer.publish("outputs", outputs_table(model, spec, header, result.final_latents,
                                                        max_batch_bytes=self.store.max_batch_bytes))
            if spec.return_conditioning:
                assert writer is not None and header is not None
                if not result.conditioning:
                    raise RuntimeError("return.conditioning: the rollout captured no conditioning tensors")
                writer.publish(CONDITIONING, stream_table(CONDITIONING, header, result.conditioning,
                                                          max_batch_bytes=self.store.max_batch_bytes))
        except BaseException as exc:
            kind: Literal["failed", "cancelled"] = "cancelled" if isinstance(exc, RolloutCancelled) else "failed"
            message = "cancelled by client" if kind == "cancelled" else f"{type(exc).__name__}: {exc}"
            if job.stop_reason is not None:
                kind, message = "failed", job.stop_reason
            if writer is not None:
                writer.fail(kind, message)
            else:
                self.abandon(job.id, kind, message)
            raise
        assert writer is not None
        writer.finish()
        info = self.store.info(job.id)
        return {"num_rows": info.num_rows, "num_bytes": info.num_bytes, "steps": list(info.steps)}

    def reserve(self, job_id: str) -> str:
        return self.store.reserve(job_id)

    def abandon(self, job_id: str, kind: str, message: str) -> None:
        self.store.abandon(job_id, kind, message)

    def release(self, job_id: str) -> None:
        self.store.release(job_id)

    def has_result(self, job_id: str) -> bool:
        try:
            return self.store.info(job_id).state == "succeeded"
        except KeyError:
            return False

    def result_info(self, job_id: str) -> dict[str, Any] | None:
        try:
            info = self.store.info(job_id)
        except KeyError:
            return None
        if info.state != "succeeded":
            return None
        return {"num_rows": info.num_rows, "num_bytes": info.num_bytes, "steps": list(info.steps)}

    def locations_for(self, job_id: str) -> list[str]:
        return self.locations()
