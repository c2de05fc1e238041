"""A server started with --tls-cert/--tls-key (a self-signed certificate, as docs/operations.md
sets one up) is used from sigmaflight's own clients by trusting its certificate: `Client(...,
ca_file=)`, `AsyncClient(..., ca_file=)` and the command line's `--ca-file` (or
SIGMAFLIGHT_CA_FILE), for REST over https and Flight over grpc+tls (pulls and weights pushes)
alike. A CA file that cannot be used is named, before any request."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
from typing import Any

import httpx
import pytest
import torch

from sigmaflight import AsyncClient, Client, ServerUnreachable
from sigmaflight.rest import CAFileError
from tests.cli.conftest import cli
from tests.servers import InProcessServer

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")

REQUEST: dict[str, Any] = {"prompts": ["a red cube"], "num_outputs_per_prompt": 2, "num_inference_steps": 2, "seed": 3}


@pytest.fixture(scope="module")
def server(certificate):
    cert, key = certificate
    with InProcessServer("--tls-cert", str(cert), "--tls-key", str(key), "--workers", "1") as s:
        assert s.rest_url.startswith("https://") and s.flight_url.startswith("grpc+tls://")
        yield s


def test_client_with_the_servers_certificate_submits_waits_pulls_and_pushes_over_tls(server, certificate):
    from sigmaflight.pipeline.models import ModelRegistry

    cert, _ = certificate
    with Client(server.rest_url, ca_file=str(cert)) as client:
        ticket = client.submit(**REQUEST)
        assert ticket.flight.locations[0].startswith("grpc+tls://")
        assert client.wait(ticket, timeout=120).status == "succeeded"
        traj = client.pull(ticket)  # Flight over grpc+tls, trusting the same file
        assert traj.rollout_id == ticket.id and traj.num_samples == 2 and list(traj.header.steps) == [0, 1, 2]
        base = ModelRegistry().get("tiny-sd3").pipeline.transformer.state_dict()
        key = next(k for k, v in base.items() if v.is_floating_point() and v.numel() > 16)
        before = next(m for m in client.models() if m["id"] == "tiny-sd3")["weights_version"]
        pushed = client.push_weights("tiny-sd3", {key: base[key] * torch.tensor(0.5, dtype=base[key].dtype)},
                                     partial=True, progress=False, retries=0)
        assert pushed.weights_version == before + 1 and pushed.bytes_sent == base[key].nbytes


def test_async_client_takes_the_ca_file_too(server, certificate):
    cert, _ = certificate

    async def run() -> None:
        async with AsyncClient(server.rest_url, ca_file=cert) as client:  # a Path will do
            ticket = await client.submit(**REQUEST)
            assert (await client.wait(ticket, timeout=120)).status == "succeeded"
            assert (await client.pull(ticket)).num_samples == 2

    asyncio.run(run())


def test_without_the_certificate_the_refusal_says_how_to_trust_the_server(server):
    with Client(server.rest_url) as client, pytest.raises(ServerUnreachable) as refused:
        client.models()
    assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value)
    assert "pass the CA that signed it, or a self-signed server's own cert.pem, as ca_file= / --ca-file" in \
        str(refused.value)


def test_a_ca_file_that_cannot_be_used_is_named_before_any_request(certificate, tmp_path):
    _, key = certificate
    missing = tmp_path / "nope.pem"
    with pytest.raises(CAFileError, match=rf"^ca_file {missing}: cannot read it \(No such file or directory\)$"):
        Client("https://127.0.0.1:9", ca_file=missing)
    with pytest.raises(ValueError, match=rf"^ca_file {key}: not a PEM certificate "):  # the key, not the cert
        AsyncClient("https://127.0.0.1:9", ca_file=key)
    with pytest.raises(CAFileError, match=rf"^ca_file {tmp_path}: cannot read it \(Is a directory\)$"):
        Client("https://127.0.0.1:9", ca_file=tmp_path)


def test_the_command_line_trusts_the_server_with_ca_file(server, certificate, tmp_path, capsys, monkeypatch):
    cert, key = certificate
    url = server.rest_url
    rc, out, err = cli(capsys, "submit", "--url", url, "--ca-file", str(cert), "-p", "a red cube", "--steps", "2",
                       "--wait")  # was: CERTIFICATE_VERIFY_FAILED, and no flag to fix it
    assert rc == 0, err
    rollout = json.loads(out)["id"]
    rc, _, err = cli(capsys, "pull", rollout, "--url", url, "--ca-file", str(cert), "-o", str(tmp_path / "t.arrow"))
    assert rc == 0 and err.splitlines()[-1].startswith(f"wrote {tmp_path / 't.arrow'}: rollout {rollout}, 3 steps"), err
    monkeypatch.setenv("SIGMAFLIGHT_CA_FILE", str(cert))
    rc, out, err = cli(capsys, "status", rollout, "--url", url)
    assert rc == 0 and json.loads(out)["status"] == "succeeded", err
    trusting = ssl.create_default_context(cafile=str(cert))
    with httpx.Client(base_url=url, verify=trusting) as http:
        listed = len(http.get("/v1/rollouts").json()["rollouts"])
    # A CA file that cannot be used: one line naming where it came from, exit 2, nothing sent.
    monkeypatch.setenv("SIGMAFLIGHT_CA_FILE", str(tmp_path / "gone.pem"))
    rc, _, err = cli(capsys, "submit", "--url", url, "-p", "a", "--steps", "2")
    assert rc == 2 and err == (f"sigmaflight submit: SIGMAFLIGHT_CA_FILE {tmp_path / 'gone.pem'}: cannot read it "
                               "(No such file or directory)\n")
    rc, _, err = cli(capsys, "submit", "--url", url, "--ca-file", str(key), "-p", "a", "--steps", "2")
    assert rc == 2 and err.startswith(f"sigmaflight submit: --ca-file {key}: not a PEM certificate ")
    assert len(err.splitlines()) == 1
    with httpx.Client(base_url=url, verify=trusting) as http:
        assert len(http.get("/v1/rollouts").json()["rollouts"]) == listed


def test_the_ready_lines_command_works_against_a_tls_server_as_given(server, capsys):
    """The ready line's `try` command, run as given, on a server with a self-signed certificate:
    it failed certificate verification (it named no --ca-file)."""
    import shlex

    ready = next(json.loads(line) for line in server.logs if '"sigmaflight ready"' in line)
    argv = shlex.split(ready["try"])
    assert argv[0] == "sigmaflight"
    rc, out, err = cli(capsys, *argv[1:])
    assert rc == 0, err
    assert json.loads(out)["status"] == "succeeded"


def test_plain_http_to_the_tls_port_says_to_use_https(server, capsys):
    """It said only "is this the Flight port?", though the port was the REST one, serving https."""
    plain = server.rest_url.replace("https://", "http://", 1)
    with pytest.raises(ServerUnreachable) as info, Client(plain) as client:
        client.models()
    assert f"if it serves https (--tls-cert), use {server.rest_url}" in str(info.value), str(info.value)
    rc, _, err = cli(capsys, "list", "--url", plain)
    assert rc == 1 and f"use {server.rest_url}" in err, err
