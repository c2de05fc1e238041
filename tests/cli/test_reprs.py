"""What a user sees printing the client's objects in a notebook or a log: the clients and a stream
say where they talk to and how far they are (`<... object at 0x...>` before), a token never shows,
and a streamed rollout summarises its decoded outputs by shape and dtype (its repr held the whole
image array, some 2,000 characters for one 32x32 image). Real server in process."""

from __future__ import annotations

from sigmaflight import AsyncClient, Client


def test_the_clients_say_where_they_talk_to_and_never_show_the_token():
    for make in (Client, AsyncClient):
        client = make("http://127.0.0.1:9/", token="s3cret-token", timeout=12.5)
        text = repr(client)
        assert text == f"<{make.__name__} http://127.0.0.1:9 token=*** timeout=12.5>", text
        assert "s3cret" not in text
    assert repr(Client("http://127.0.0.1:9", timeout=None)) == "<Client http://127.0.0.1:9 token=None timeout=None>"


def test_a_stream_and_its_rollouts_are_summarised(server):
    with Client(server.rest_url) as c:
        with c.stream([{"prompts": ["a red cube"], "num_inference_steps": 2, "seed": 1, "return": {"outputs": True}}],
                      outputs=True,
                      progress=False) as stream:
            (item,) = list(stream)
            assert repr(stream) == "<Stream submitted=1 resubmitted=0 closed>", repr(stream)
    assert item.error is None and item.outputs is not None
    text = repr(item)
    assert len(text) < 600, text
    assert f"outputs=<uint8 array {tuple(item.outputs.shape)}>" in text, text
    assert item.ticket is not None and repr(item.trajectory) in text and item.ticket.id in text
