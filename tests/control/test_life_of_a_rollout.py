"""docs/control.md "Life of a rollout" cannot drift from the code: one real rollout runs through the
in-process app (its lifespan, job manager, local backend, engine and store) under a tracer
(`sys.setprofile` / `threading.setprofile`), and the section's "In order." list must be a
subsequence of the calls made. Renaming, removing or reordering a call in either breaks this. One
denoising step, so each per-step call is made once and cannot match a later step's."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from sigmaflight.control.http.app import create_app
from sigmaflight.control.serve import settings_from_argv
from starlette.testclient import TestClient

ROOT = Path(__file__).resolve().parents[2]
OURS = tuple(str(ROOT / d) for d in ("control", "dataplane", "pipeline", "sigmaflight"))


def documented_order() -> list[str]:
    text = (ROOT / "docs" / "control.md").read_text()
    section = text.split("## Life of a rollout", 1)[1].split("\n## ", 1)[0]
    paragraph = section.split("**In order.**", 1)[1].split("\n\n", 1)[0]
    listed = paragraph.split(":", 1)[1]  # the names come after the sentence that introduces them
    listed = re.sub(r"\([^)]*\)", "", listed)  # a parenthesis is context, not a call in the order
    return re.findall(r"`([A-Za-z_][\w.]*)`", listed)


def traced_rollout() -> list[str]:
    """The qualified names of our functions, in the order their calls began, across all threads."""
    calls: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(OURS):
            calls.append(frame.f_code.co_qualname)

    settings = settings_from_argv(["--model", "tiny-sd3", "--port", "0", "--flight-port", "0"])
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        with TestClient(create_app(settings)) as client:
            r = client.post("/v1/rollouts", json={"model": "tiny-sd3", "prompts": ["a red cube"],
                                                  "num_inference_steps": 1, "seed": 1})
            assert r.status_code == 202, r.text
            for _ in range(600):
                status = client.get(f"/v1/rollouts/{r.json()['id']}").json()["status"]
                if status not in ("queued", "running"):
                    break
                threading.Event().wait(0.05)
            assert status == "succeeded"
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return calls


def test_the_life_of_a_rollout_lists_the_calls_one_rollout_makes_in_their_order():
    order = documented_order()
    assert len(order) > 30, order
    calls = traced_rollout()
    at = 0
    for name in order:
        try:
            at = calls.index(name, at) + 1
        except ValueError:
            before = name in calls
            raise AssertionError(
                f"docs/control.md 'In order.' lists {name!r} " + ("before a call it follows" if before else
                                                               "but one rollout never calls it")
                + f"; the calls after {order[order.index(name) - 1]!r}: {sorted(set(calls[at:]))[:80]}") from None
