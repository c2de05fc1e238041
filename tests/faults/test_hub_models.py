"""`--model org/name[@revision]`: a Hugging Face hub id served from the HF cache, offline.

Nothing can be downloaded here, so the cache is made by hand, as huggingface_hub lays it out:
`$HF_HUB_CACHE/models--org--name/snapshots/<commit>/...` (the built-in tiny-sd3 saved with
`save_pretrained`) and `refs/main` holding the commit. The server runs with HF_HUB_OFFLINE=1.
The reference for the trajectory is the stock diffusers pipeline loaded from that snapshot
directory with `StableDiffusion3Pipeline.from_pretrained`, called with the rollout's x_0.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pyarrow.flight as flight
import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from sigmaflight.dataplane.client import Trajectory
from sigmaflight.pipeline.models import ModelRegistry

from tests.faults.conftest import serve_refused
from tests.servers import ServerProcess, wait_for_status

pytestmark = pytest.mark.e2e

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An offline Hugging Face cache holding org/tiny-sd3 (flow-match) and org/pndm (a PNDM scheduler)."""
    home = tmp_path_factory.mktemp("hf")
    cache = home / "hub"
    pipe = ModelRegistry().get("tiny-sd3").pipeline
    for name in ("tiny-sd3", "pndm"):
        repo = cache / f"models--org--{name}"
        pipe.save_pretrained(repo / "snapshots" / COMMIT)
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(COMMIT)
    index = cache / "models--org--pndm" / "snapshots" / COMMIT / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "scheduler": ["diffusers", "PNDMScheduler"]}))
    return {"HF_HOME": str(home), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def _snapshot(hub: dict[str, str], name: str) -> Path:
    return Path(hub["HF_HUB_CACHE"]) / f"models--org--{name}" / "snapshots" / COMMIT


def test_a_hub_id_in_the_cache_is_served_and_its_trajectory_is_the_stock_pipelines(hub):
    request = {"prompts": ["a red cube"], "num_inference_steps": 3, "guidance_scale": 4.5, "height": 32,
               "width": 32, "seed": 5, "sampler": {"type": "ode"}}
    with ServerProcess("--model", "org/tiny-sd3", env=hub) as server, server.client() as c:
        models = {m["id"]: m for m in c.get("/v1/models").json()["models"]}
        served = models["org/tiny-sd3"]
        assert served["default"] and served["family"] == "sd3" and served["dtype"] == "float32"
        assert served["digest"] == models["tiny-sd3"]["digest"]  # the same weights as the built-in it was saved from
        ticket = c.post("/v1/rollouts", json=request).json()
        assert wait_for_status(c, ticket["id"], {"succeeded", "failed"})["status"] == "succeeded"
        # The weights and LoRA routes take the id with its "/": the model is found (it has no adapter).
        gone = c.delete("/v1/models/org/tiny-sd3/lora")
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "lora_not_loaded", gone.text
        with flight.FlightClient(ticket["flight"]["locations"][0]) as fc:
            traj = Trajectory.from_reader(fc.do_get(flight.Ticket(ticket["flight"]["ticket"].encode())))
    assert '"model loaded"' in server.log_text and '"source": "hub"' in server.log_text
    assert "reach the Hub" not in server.log_text and "connect to the Hub" not in server.log_text  # offline: quiet

    stock = StableDiffusion3Pipeline.from_pretrained(_snapshot(hub, "tiny-sd3"))
    stock.set_progress_bar_config(disable=True)
    seen: list[torch.Tensor] = []

    def on_step_end(pipe, i, t, kwargs):
        seen.append(kwargs["latents"].clone())
        return kwargs

    x = traj.latents[:, 0]  # x_0 as the rollout drew it, [B, C, h, w]
    with torch.inference_mode():
        out = stock(prompt=["a red cube"], num_inference_steps=3, guidance_scale=4.5, height=32, width=32,
                    latents=x, output_type="latent", max_sequence_length=16, callback_on_step_end=on_step_end)
    assert len(seen) == 3
    for i, stock_latent in enumerate(seen, start=1):
        assert torch.equal(traj.latents[:, i], stock_latent), i
    assert torch.equal(traj.latents[:, 3], out.images)


def test_a_hub_id_with_a_revision_takes_that_snapshot_and_the_dtype(hub):
    model = f"org/tiny-sd3@{COMMIT}"
    with ServerProcess("--model", model, "--dtype", "bfloat16", env=hub) as server, server.client() as c:
        (served,) = [m for m in c.get("/v1/models").json()["models"] if m["id"] == model]
        assert served["dtype"] == "bfloat16" and served["default"]
        ticket = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2, "seed": 1}).json()
        assert wait_for_status(c, ticket["id"], {"succeeded", "failed"})["status"] == "succeeded"


def test_a_hub_model_that_is_not_flow_match_is_refused_at_start(hub):
    line = serve_refused("--port", "0", "--flight-port", "0", "--model", "org/pndm", env=hub)
    assert line.startswith("sigmaflight serve: --model org/pndm: scheduler 'PNDMScheduler' is not a flow-match")


def test_a_hub_model_that_is_not_in_the_cache_is_refused_at_start(hub):
    line = serve_refused("--port", "0", "--flight-port", "0", "--model", "org/absent", env=hub)
    assert "--model org/absent: no model_index.json of it in the Hugging Face cache" in line
    assert "HF_HUB_OFFLINE is set" in line


def test_a_hub_model_with_the_ray_backend_is_refused_at_start(hub):
    line = serve_refused("--port", "0", "--flight-port", "0", "--model", "org/tiny-sd3", "--backend", "ray",
                         env=hub)
    assert "--model org/tiny-sd3: a hub model is served by --backend local only" in line


# ---------------------------------------------------------------------------------------- ids, revisions, caches

@pytest.mark.parametrize("model", ["org/a..b", "org--x/name", "org/" + "n" * 5000, "org/name.git"],
                         ids=["dot-dot", "dash-dash", "5000-characters", "dot-git"])
def test_a_hub_id_huggingface_hub_rejects_is_refused_at_start(hub, model):
    line = serve_refused("--port", "0", "--flight-port", "0", "--model", model, env=hub)
    assert line.startswith(f"sigmaflight serve: --model {model[:100]}"), line[:300]
    assert "not a valid Hugging Face hub id" in line and len(line) < 1000, line[:300]


@pytest.mark.parametrize("revision", ["/{outside}", "../../../{outside_rel}", "main/../../x", "refs//main", ".hidden"])
def test_a_revision_that_is_no_git_ref_name_is_refused_and_nothing_outside_the_cache_is_read(
        hub, tmp_path, revision):
    """The revision becomes a path under the cache's refs/ (huggingface_hub joins them): one that
    is absolute or climbs out would read a file anywhere. It must be a git ref name or a commit."""
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-CONTENT-0123456789")
    cache_repo = Path(hub["HF_HUB_CACHE"]) / "models--org--tiny-sd3" / "refs"
    revision = revision.format(outside=secret, outside_rel=os.path.relpath(secret, cache_repo))
    before = secret.stat().st_atime_ns
    line = serve_refused("--port", "0", "--flight-port", "0", "--model", f"org/tiny-sd3@{revision}", env=hub)
    assert line.startswith(f"sigmaflight serve: --model org/tiny-sd3@{revision}: revision {revision!r} is not "
                           "a branch, tag or commit name"), line
    assert "SECRET" not in line and secret.stat().st_atime_ns == before


def test_a_cache_entry_whose_ref_points_outside_the_cache_is_refused_without_a_traceback(hub, tmp_path):
    outside = tmp_path / "outside"
    ModelRegistry().get("tiny-sd3").pipeline.save_pretrained(outside)
    repo = Path(hub["HF_HUB_CACHE"]) / "models--org--escape"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots").mkdir()
    (repo / "refs" / "main").write_text(str(outside))
    line = serve_refused("--port", "0", "--flight-port", "0", "--model", "org/escape", env=hub)
    assert line.startswith("sigmaflight serve: --model org/escape: the Hugging Face cache entry "
                           f"{repo} is broken: refs/main names {str(outside)!r}, not a snapshot in it"), line


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _index_only(hub: dict[str, str], name: str, *, of: str) -> Path:
    """A cache entry org/NAME holding only model `of`'s model_index.json (its snapshot returned)."""
    repo = Path(hub["HF_HUB_CACHE"]) / f"models--org--{name}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    (snapshot / "model_index.json").write_bytes((_snapshot(hub, of) / "model_index.json").read_bytes())
    return snapshot


@pytest.mark.parametrize("online", [False, True], ids=["offline", "hub-unreachable"])
def test_a_cached_model_index_without_the_pipelines_files_is_refused_at_start(hub, online):
    snapshot = _index_only(hub, "index-only", of="tiny-sd3")
    (snapshot / "scheduler").mkdir(exist_ok=True)
    (snapshot / "scheduler" / "scheduler_config.json").write_bytes(
        (_snapshot(hub, "tiny-sd3") / "scheduler" / "scheduler_config.json").read_bytes())
    env = {**hub, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"} if online else hub
    line = serve_refused("--port", "0", "--flight-port", "0", "--model", "org/index-only", env=env)
    assert line.startswith("sigmaflight serve: --model org/index-only: the Hugging Face cache holds its "
                           "model_index.json but not all of its pipeline's files (text_encoder/: missing)"), line
    assert ("and the hub cannot be reached (" if online else "and HF_HUB_OFFLINE is set") in line


def test_a_cached_index_of_a_scheduler_not_flow_match_is_refused_for_that_not_for_missing_files(hub):
    """A cached model_index.json naming PNDMScheduler, its component folders absent: the refusal
    was "not all of its pipeline's files", sending the user to download a model refused anyway."""
    _index_only(hub, "pndm-index-only", of="pndm")
    line = serve_refused("--port", "0", "--flight-port", "0", "--model", "org/pndm-index-only", env=hub)
    assert line.startswith("sigmaflight serve: --model org/pndm-index-only: scheduler 'PNDMScheduler' is not a "
                           "flow-match"), line


def test_a_hub_model_with_the_hub_unreachable_is_refused_at_once_without_retries(hub):
    """Online mode, but the hub's address refuses connections: one attempt, one line. huggingface_hub
    alone retries 5 times with backoff (about 20 s) and puts 11 warning lines on stderr, which
    `serve_refused` (exactly one line) would see; the time is not asserted on this busy box."""
    env = {**hub, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    line = serve_refused("--port", "0", "--flight-port", "0", "--model", "org/absent", env=env)
    assert line.startswith("sigmaflight serve: --model org/absent: no model_index.json of it in the Hugging Face "
                           f"cache ({hub['HF_HUB_CACHE']}) and the hub cannot be reached ("), line

