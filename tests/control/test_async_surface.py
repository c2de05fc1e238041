"""`AsyncClient` has `Client`'s surface as coroutines: every public method with the same parameters
(names, kinds, defaults, annotations), so an asyncio trainer can do what a blocking one does
(`pull_idle_timeout`, `push_weights(partial=True, ...)`, `push_weights_file`, `weights_manifest`),
and the two cannot drift apart again. Through the real server, in process."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from safetensors.torch import save_file

from sigmaflight import AsyncClient, Client
from sigmaflight.weights import DEFAULT_CHUNK_BYTES, PushResult
from tests.servers import InProcessServer

MODEL = "tiny-sd3"

SYNC_ONLY = {
    "close": "aclose",  # the coroutine of the same job
    "flight": None,  # the blocking client's Flight connections, which AsyncClient's pulls run on: `.sync.flight`
    "flight_error": None,  # how a Flight error becomes a typed one, inside the blocking pulls
}
"""Client's public methods whose AsyncClient counterpart is named otherwise (or is `.sync`'s own)."""


def _public(cls: type) -> dict[str, object]:
    return {name: getattr(cls, name) for name in dir(cls)
            if not name.startswith("_") and callable(getattr(cls, name)) and not isinstance(getattr(cls, name), type)}


def test_async_client_has_every_method_of_client_with_the_same_parameters() -> None:
    sync, both = _public(Client), _public(AsyncClient)
    missing = sorted(name for name in sync if name not in SYNC_ONLY and name not in both)
    assert missing == [], f"AsyncClient lacks {missing}"
    extra = sorted(name for name in both if name not in sync and name not in SYNC_ONLY.values())
    assert extra == [], f"AsyncClient has {extra} that Client has not"
    for name in ["__init__", *sorted(n for n in sync if n not in SYNC_ONLY)]:
        ps = inspect.signature(getattr(Client, name)).parameters
        pa = inspect.signature(getattr(AsyncClient, name)).parameters
        assert [(p.name, p.kind, p.default, p.annotation) for p in pa.values()] == \
               [(p.name, p.kind, p.default, p.annotation) for p in ps.values()], name
        if name not in ("__init__", "stream"):  # stream: an async iterator, not a coroutine
            assert inspect.iscoroutinefunction(getattr(AsyncClient, name)), name
            assert inspect.signature(getattr(AsyncClient, name)).return_annotation == \
                   inspect.signature(getattr(Client, name)).return_annotation, name
    assert inspect.signature(Client.push_weights).parameters["chunk_bytes"].default == DEFAULT_CHUNK_BYTES


def test_async_client_takes_the_pull_idle_timeout() -> None:
    for value in (60.0, None):
        client = AsyncClient("http://127.0.0.1:9", pull_idle_timeout=value)
        assert client.sync.pull_idle_timeout == value and client.pull_idle_timeout == value
        asyncio.run(client.aclose())
    with pytest.raises(ValueError, match="pull_idle_timeout"):
        AsyncClient("http://127.0.0.1:9", pull_idle_timeout=0)


def test_async_client_has_the_clients_public_attributes() -> None:
    """trainers.md: AsyncClient "has `Client`'s surface"; its `transport`, `host` and `trust` were
    reachable only through `.sync`."""
    sync = Client("http://127.0.0.1:9", "t0k", timeout=7.0, transport="flight", host="h1")
    client = AsyncClient("http://127.0.0.1:9", "t0k", timeout=7.0, transport="flight", host="h1")
    public = {name for name in vars(sync) if not name.startswith("_")}
    assert public <= {name for name in vars(client) if not name.startswith("_")} | {"pushed_versions"}
    for name in public - {"trust", "pushed_versions"}:
        assert getattr(client, name) == getattr(sync, name), name
    assert client.trust is client.sync.trust
    asyncio.run(client.aclose())
    sync.close()


@pytest.mark.timeout(300)
def test_async_client_pushes_with_the_clients_options(tmp_path) -> None:
    from sigmaflight.pipeline.models import ModelRegistry

    base = ModelRegistry().get(MODEL).pipeline.transformer.state_dict()
    key = next(k for k, v in base.items() if v.is_floating_point() and v.numel() > 16)
    save_file({key: base[key] * 0.25}, tmp_path / "one.safetensors")

    async def run(url: str) -> None:
        async with AsyncClient(url) as client:
            manifest = await client.weights_manifest(MODEL)
            assert set(manifest) == set(base) and manifest == client.sync.weights_manifest(MODEL)
            pushed = await client.push_weights(MODEL, {key: base[key] * 0.5}, partial=True, only_changed=True,
                                               chunk_bytes=1024, retries=0, progress=False)
            assert isinstance(pushed, PushResult) and pushed.tensors == 1 and pushed.bytes_sent == base[key].nbytes
            assert client.pushed_versions[MODEL] == pushed.weights_version
            again = await client.push_weights(MODEL, {key: base[key] * 0.5}, partial=True)
            assert again.bytes_sent == 0 and again.weights_version == pushed.weights_version  # nothing differs
            filed = await client.push_weights_file(MODEL, str(tmp_path / "one.safetensors"), partial=True)
            assert filed.weights_version == pushed.weights_version + 1
            assert client.pushed_versions[MODEL] == filed.weights_version
            assert (await client.weights_manifest(MODEL))[key] != manifest[key]

    with InProcessServer("--weights-file-dir", str(tmp_path), "--workers", "1") as server:
        asyncio.run(run(server.rest_url))
