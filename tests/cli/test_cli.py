"""The CLI end to end on a real server: submit, status, pull, inspect, plot."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from PIL import Image

from sigmaflight import Client
from sigmaflight.plot import PLOT_HEIGHT, PLOT_WIDTH
from tests.cli.conftest import cli


def read_table(path) -> pa.Table:
    """Read into memory (not a memory map: the test truncates the file afterwards)."""
    with open(path, "rb") as f:
        return pa.ipc.open_file(pa.BufferReader(f.read())).read_all()


def test_submit_status_pull_inspect_plot(server, tmp_path, capsys):
    url = server.rest_url
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"prompts": ["a red cube", "a dog"], "sampler": {"type": "sde", "sde_steps": [1, 2]},
                               "seed": 1, "num_inference_steps": 6}))
    # submit: the JSON file is the base, flags override it (steps 6 -> 4, seed 1 -> 9).
    rc, out, _ = cli(capsys, "submit", "--url", url, "--json", str(req), "-n", "2", "--steps", "4", "--seed", "9")
    assert rc == 0
    ticket = json.loads(out)
    assert ticket["status"] == "queued" and ticket["flight"]["descriptor_path"] == ["rollouts", ticket["id"]]
    rc, out, _ = cli(capsys, "status", ticket["id"], "--url", url, "--wait", "--timeout", "60")
    status = json.loads(out)
    assert rc == 0 and status["status"] == "succeeded" and status["progress"] == {"steps_done": 4, "steps_total": 4}

    # pull: an .arrow file equal to what Flight serves, with a progress line of steps and bytes.
    out_file = tmp_path / "t.arrow"
    rc, _, err = cli(capsys, "pull", ticket["flight"]["ticket"], "--url", url, "-o", str(out_file))
    assert rc == 0, err
    assert f"pull {ticket['id']}: 100%" in err and "5/5" in err and "KiB" in err  # the tqdm bar
    # The summary's byte count is the file's own size (it used to be the batches' in-memory bytes).
    assert f"5 steps, {os.path.getsize(out_file)} bytes" in err.splitlines()[-1]
    table = read_table(out_file)
    with flight.FlightClient(ticket["flight"]["locations"][0]) as fc:
        served = fc.do_get(flight.Ticket(ticket["flight"]["ticket"].encode())).read_all()
    assert table.equals(served) and table.schema.metadata == served.schema.metadata
    rollout = json.loads(table.schema.metadata[b"sigmaflight.rollout"])
    assert rollout["request"]["num_inference_steps"] == 4 and rollout["request"]["seed"] == 9
    assert rollout["request"]["num_outputs_per_prompt"] == 2 and rollout["sampler"]["sde_steps"] == [1, 2]

    # Re-running keeps a complete file untouched; a truncated one and a stale .partial are replaced.
    mtime = os.stat(out_file).st_mtime_ns
    rc, _, err = cli(capsys, "pull", ticket["id"], "--url", url, "-o", str(out_file))
    assert rc == 0 and "kept" in err and os.stat(out_file).st_mtime_ns == mtime
    whole = out_file.read_bytes()
    out_file.write_bytes(whole[: len(whole) // 2])
    (tmp_path / "t.arrow.partial").write_bytes(b"junk from an interrupted pull")
    rc, _, err = cli(capsys, "pull", ticket["id"], "--url", url, "-o", str(out_file))
    assert rc == 0 and "pulling again" in err
    assert out_file.read_bytes() == whole and not (tmp_path / "t.arrow.partial").exists()

    # inspect: schedule by absolute index, latent statistics, log-prob summaries, no flags.
    rc, out, _ = cli(capsys, "inspect", str(out_file), "--json")
    rep = json.loads(out)
    sigmas = json.loads(table.schema.metadata[b"sigmaflight.sigmas"])
    assert rc == 0 and rep["flags"] == []
    assert [r["i"] for r in rep["schedule"]] == [0, 1, 2, 3, 4]
    assert [r["sigma"] for r in rep["schedule"]] == [float(np.float32(s)) for s in sigmas]
    assert [r["sde"] for r in rep["schedule"]] == [False, True, True, False, None]
    lat = np.stack(table.filter(pa.compute.equal(table["step"], 2))["latent"].combine_chunks()
                   .to_numpy_ndarray()).astype(np.float64)
    step2 = next(r for r in rep["latents"] if r["step"] == 2)
    assert step2["mean"] == pytest.approx(lat.mean(), rel=1e-9) and step2["max"] == lat.max()
    assert step2["std"] == pytest.approx(lat.std(), rel=1e-6)
    assert [r["step"] for r in rep["log_probs"]] == [1, 2] and all(r["count"] == 4 for r in rep["log_probs"])
    lp1 = table.filter(pa.compute.equal(table["step"], 1))["log_prob"].to_numpy()
    assert rep["log_probs"][0]["min"] == float(lp1.min())
    rc, text, _ = cli(capsys, "inspect", str(out_file))
    assert "schedule (absolute index i)" in text and "flags (0)" in text
    # The same report straight from the server, by rollout id.
    rc, out, _ = cli(capsys, "inspect", ticket["id"], "--url", url, "--json")
    remote = json.loads(out)
    assert rc == 0 and remote["schedule"] == rep["schedule"] and remote["latents"] == rep["latents"]

    # plot: a PNG of the documented size, with the decoded images in the lower half (tests/cli/test_plot.py: the rest).
    png = tmp_path / "t.png"
    rc, _, err = cli(capsys, "plot", str(out_file), "-o", str(png))
    assert rc == 0 and f"{PLOT_WIDTH}x{PLOT_HEIGHT}" in err
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size == (1400, 900) == (PLOT_WIDTH, PLOT_HEIGHT)
        pixels = np.asarray(im.convert("RGB"), dtype=np.int32)
    assert pixels[480:800].std() > 5  # decoded images, not a blank panel
    rc, _, _ = cli(capsys, "plot", str(out_file), "-o", str(tmp_path / "n.png"), "--no-decode")
    with Image.open(tmp_path / "n.png") as im:
        blank = np.asarray(im.convert("RGB"), dtype=np.int32)[520:800]
    assert im.size == (1400, 900) and (blank == 255).mean() > 0.95


def _rewrite(path, out, **meta_json) -> None:
    table = read_table(path)
    meta = dict(table.schema.metadata)
    for key, value in meta_json.items():
        meta[f"sigmaflight.{key}".encode()] = json.dumps(value).encode()
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_file(sink, table.schema.with_metadata(meta)) as w:
        w.write_table(table)


def test_inspect_flags_inconsistencies(server, tmp_path, capsys):
    rc, out, _ = cli(capsys, "submit", "--url", server.rest_url, "-p", "x", "--steps", "3", "--seed", "2", "--wait")
    good = tmp_path / "good.arrow"
    assert cli(capsys, "pull", json.loads(out)["id"], "--url", server.rest_url, "-o", str(good))[0] == 0
    meta = read_table(good).schema.metadata
    sigmas = json.loads(meta[b"sigmaflight.sigmas"])
    timesteps = json.loads(meta[b"sigmaflight.timesteps"])
    bad = tmp_path / "bad.arrow"
    # sigma[2] raised above sigma[1], a non-zero terminal sigma, steps listed out of order.
    _rewrite(good, bad, sigmas=[sigmas[0], sigmas[1], 0.99, 0.25], steps=[0, 2, 1, 3])
    rc, out, _ = cli(capsys, "inspect", str(bad), "--json", "--strict")
    report = json.loads(out)
    flags = report["flags"]
    assert rc == 1
    assert any(f.startswith("i=2: sigma 0.99") and "does not decrease" in f for f in flags)
    assert any(f.startswith("terminal sigma sigmas[3] = 0.25") for f in flags)
    assert any("sigmaflight.steps is not ascending" in f for f in flags)
    # t/1000 is no longer the sigma: a hint (a valid schedule can drift so), never a flag
    assert any(h.startswith("i=2: float32(timesteps[2] / 1000)") for h in report["hints"])
    assert not any("timesteps[2] / 1000" in f for f in flags)
    assert any(f.startswith("sigma column at step 2") for f in flags)
    # The good file has none of these, and timesteps / 1000 equals every sigma there.
    rc, out, _ = cli(capsys, "inspect", str(good), "--json", "--strict")
    assert rc == 0 and json.loads(out)["flags"] == []
    assert all(np.float32(t) / np.float32(1000) == np.float32(s) for t, s in zip(timesteps, sigmas, strict=False))


def test_inspect_flags_a_missing_log_prob_on_a_stochastic_step_whose_next_latent_was_not_streamed(server, tmp_path,
                                                                                                     capsys):
    """The server records step i's log-prob on its row whether or not x_{i+1} is streamed; the check
    looked only where x_{i+1} was, so a file with that log-prob nulled passed --strict."""
    with Client(server.rest_url) as c:
        ticket = c.submit(prompts=["x"], num_inference_steps=3, seed=4, sampler={"type": "sde"}, return_={"steps": [1]})
        table = c.pull_stream(ticket, "trajectory")
    assert table["step"].to_pylist() == [1] and table["log_prob"].null_count == 0  # recorded without x_2
    good, bad = tmp_path / "good.arrow", tmp_path / "bad.arrow"
    for path, t in ((good, table), (bad, table.set_column(table.schema.get_field_index("log_prob"), "log_prob",
                                                         pa.nulls(len(table), pa.float32())))):
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(t.cast(table.schema))
    assert cli(capsys, "inspect", str(good), "--json", "--strict")[0] == 0
    rc, out, _ = cli(capsys, "inspect", str(bad), "--json", "--strict")
    assert rc == 1 and "step 1: log_prob missing on a stochastic transition" in json.loads(out)["flags"]


def test_inspect_reports_a_broken_file_instead_of_refusing_it(server, tmp_path, capsys):
    """A metadata value that is not JSON, a missing column, a null step or a latent column whose
    dtype label lies: each ended `inspect` with one opaque line (a float conversion, "Field does not
    exist", "zero_copy_only", the data plane's own check) and no report. A row twice, a seed other
    than the metadata's or a null seed passed `--strict` as consistent, though a client refuses the
    file. Each is a flag now, with the rest of the report."""
    with Client(server.rest_url) as c:
        table = c.pull_stream(c.submit(prompts=["x"], num_inference_steps=2, seed=6), "trajectory")
    meta = dict(table.schema.metadata)
    latent = table.schema.field("latent")
    step_at, seed_at = table.schema.get_field_index("step"), table.schema.get_field_index("seed")
    seeds = table["seed"].to_pylist()
    broken = {
        "sigmaflight.sigmas is not a JSON list of numbers": table.replace_schema_metadata(
            {**meta, b"sigmaflight.sigmas": b"[1.0, 0.5,"}),
        "columns missing: sigma ": table.drop_columns(["sigma"]),
        "step column: 1 null values": table.set_column(step_at, pa.field("step", pa.int32()), pa.array(
            [None, *table["step"].to_pylist()[1:]], pa.int32())),
        "latent values unreadable": table.cast(table.schema.set(table.schema.get_field_index("latent"), latent.with_metadata(
            {**(latent.metadata or {}), b"sigmaflight.dtype": b"float16"}))),
        # what a data-plane client refuses (Trajectory.from_file): reported too, not passed as consistent
        "rows for a (step, sample) already seen: step 0, sample 0": pa.concat_tables([table, table.slice(0, 1)]),
        "seed column disagrees with sigmaflight.rollout.seeds: step 0, sample 0": table.set_column(
            seed_at, table.schema.field("seed"), pa.array([seeds[0] + 1, *seeds[1:]], table.schema.field("seed").type)),
        "seed column: 1 nulls": table.set_column(
            seed_at, table.schema.field("seed"), pa.array([None, *seeds[1:]], table.schema.field("seed").type)),
    }
    for flag, t in broken.items():
        path = tmp_path / "broken.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, t.schema) as w:
            w.write_table(t)
        rc, out, err = cli(capsys, "inspect", str(path), "--json", "--strict")
        assert rc == 1 and err == "", (flag, err)
        report = json.loads(out)
        assert any(f.startswith(flag) for f in report["flags"]), (flag, report["flags"])
        assert [c["name"] for c in report["columns"]] == t.schema.names  # the rest of the report is there


def test_inspect_json_of_a_nan_sigma_is_json_every_parser_reads(server, tmp_path, capsys):
    """Python's json wrote the NaN bare (`"sigma": NaN`), which jq, JavaScript and DuckDB refuse."""
    with Client(server.rest_url) as c:
        table = c.pull_stream(c.submit(prompts=["x"], num_inference_steps=2, seed=7), "trajectory")
    sigmas = json.loads(table.schema.metadata[b"sigmaflight.sigmas"])
    nan = table.replace_schema_metadata({**table.schema.metadata,
                                         b"sigmaflight.sigmas": json.dumps([sigmas[0], float("nan"), 0.0]).encode()})
    path = tmp_path / "nan.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, nan.schema) as w:
        w.write_table(nan)
    rc, out, _ = cli(capsys, "inspect", str(path), "--json")

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    report = json.loads(out, parse_constant=refuse)
    assert rc == 0 and report["schedule"][1]["sigma"] is None and report["flags"]


def test_errors_are_one_line_and_exit_1(server, tmp_path, capsys):
    rc, _, err = cli(capsys, "status", "no-such-id", "--url", server.rest_url)
    assert rc == 1 and "404 not_found" in err and "no-such-id" in err
    rc, _, err = cli(capsys, "submit", "--url", server.rest_url, "-p", "x", "--sde-steps", "7", "--steps", "2")
    assert rc == 1 and "422 validation_error" in err and "sde_steps" in err
    rc, _, err = cli(capsys, "submit", "--url", server.rest_url)
    assert rc == 2 and "--prompt" in err


def test_inspect_flags_a_batch_whose_bytes_changed_after_the_pull_wrote_them(server, tmp_path, capsys):
    """`pull` writes each batch's CRC-32C beside it, and a client refuses a file whose bytes
    changed; `inspect --strict` passed such a file (one bit of one latent value flipped, every
    value still finite and every column still consistent)."""
    rc, out, _ = cli(capsys, "submit", "--url", server.rest_url, "-p", "x", "--steps", "2", "--seed", "8", "--wait")
    path = tmp_path / "t.arrow"
    assert cli(capsys, "pull", json.loads(out)["id"], "--url", server.rest_url, "-o", str(path))[0] == 0
    assert cli(capsys, "inspect", str(path), "--json", "--strict")[0] == 0
    def latents() -> np.ndarray:
        return read_table(path)["latent"].combine_chunks().storage.flatten().to_numpy(zero_copy_only=False)

    before = latents()
    raw = bytearray(path.read_bytes())
    raw[raw.index(before[:4].tobytes())] ^= 0x01  # the lowest mantissa bit of the first value (little-endian)
    path.write_bytes(bytes(raw))
    after = latents()
    assert (after != before).sum() == 1 and np.isfinite(after).all()
    rc, out, _ = cli(capsys, "inspect", str(path), "--json", "--strict")
    flags = json.loads(out)["flags"]
    assert rc == 1 and any(f.startswith("batch 0: checksum mismatch (crc32c ") for f in flags), flags
    assert any(f.endswith("the file changed after it was written") for f in flags), flags


def test_status_and_cancel_take_the_flight_ticket_as_pull_does(server, capsys):
    """`status`, `status --wait` and `cancel` said "no rollout 'sft1_...'" for a Flight ticket,
    though their help (and trainers.md) says they take one, as `pull` and `inspect` do."""
    url = server.rest_url
    with Client(url) as c:
        done = c.submit(prompts=["a red cube"], num_inference_steps=2, seed=4)
        c.wait(done, timeout=60)
    flight_ticket = done.flight.ticket
    for args in (["status", flight_ticket], ["status", flight_ticket, "--wait", "--timeout", "60"]):
        rc, out, err = cli(capsys, *args, "--url", url)
        assert rc == 0, err
        assert json.loads(out)["id"] == done.id and json.loads(out)["status"] == "succeeded"
    rc, out, err = cli(capsys, "cancel", flight_ticket, "--release", "--url", url)
    assert rc == 0, err
    assert json.loads(out)["id"] == done.id and json.loads(out)["status"] == "expired"
    rc, _, err = cli(capsys, "status", "sft1_" + "A" * 24, "--url", url)
    assert rc == 1 and "no rollout or ticket" in err, err
