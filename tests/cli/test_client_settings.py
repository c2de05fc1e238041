"""What a `Client` (and `AsyncClient`, and the CLI that makes one) is built with is checked when it
is built, each refusal naming the setting: a URL httpx cannot parse, a token no HTTP header can
carry, a timeout that is not a number of seconds. They failed at the first request instead, as a
traceback (`httpx.InvalidURL`), as a `ServerUnreachable` saying the server was not running (a token
read from a file with its newline), or as an error of the socket layer naming nothing. Real
server in process, real `sigmaflight` command line."""

from __future__ import annotations

import math

import pytest

from sigmaflight import AsyncClient, Client
from tests.cli.conftest import cli
from tests.servers import InProcessServer


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens.txt"
    tokens.write_text("s3cret\n")
    with InProcessServer("--token-file", str(tokens)) as s:
        yield s


@pytest.mark.parametrize("make", [Client, AsyncClient])
@pytest.mark.parametrize("url", ["http://127.0.0.1:abc", "http://[::1", "http://127.0.0.1:70000", "http://h:0"])
def test_a_url_httpx_cannot_parse_is_a_value_error_naming_url(make, url):
    with pytest.raises(ValueError, match=r"^url .*: "):
        make(url)


@pytest.mark.parametrize("make", [Client, AsyncClient])
@pytest.mark.parametrize("token", ["sécret", "two words", "tab\there", ""])
def test_a_token_no_header_can_carry_is_a_value_error_naming_token(make, token):
    with pytest.raises(ValueError, match="^token: "):
        make("http://127.0.0.1:9", token=token)


def test_a_token_read_from_a_file_with_its_newline_is_the_token(guarded):
    with Client(guarded.rest_url, token="s3cret\n") as c:  # as open(path).read() gives it
        assert c.models()  # was: ServerUnreachable "... (is `sigmaflight serve` running there?)"


@pytest.mark.parametrize("make", [Client, AsyncClient])
@pytest.mark.parametrize("timeout", [math.nan, -1.0, 0, "5", True])
def test_a_timeout_that_is_not_a_number_of_seconds_is_refused_naming_timeout(make, timeout):
    with pytest.raises((ValueError, TypeError), match="^timeout: "):
        make("http://127.0.0.1:9", timeout=timeout)


def test_no_limit_is_none_or_inf(guarded):
    for timeout in (None, math.inf):
        with Client(guarded.rest_url, token="s3cret", timeout=timeout) as c:
            assert c.timeout is None and c.models()


@pytest.mark.parametrize(("flags", "named"), [
    (("--url", "http://127.0.0.1:abc"), "--url http://127.0.0.1:abc: "),
    (("--url", "http://[::1"), "--url http://[::1: "),
    (("--url", "http://127.0.0.1:70000"), "--url http://127.0.0.1:70000: port 70000 is not a TCP port"),
    (("--url", "http://127.0.0.1:9", "--token", "sé"), "--token: "),
])
def test_the_cli_says_so_in_one_line_naming_the_flag_with_exit_2(capsys, flags, named):
    rc, out, err = cli(capsys, "list", *flags)
    assert rc == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"sigmaflight list: {named}"), err


@pytest.mark.parametrize("command", ["status", "cancel", "pull", "inspect"])
def test_an_id_longer_than_a_file_name_is_asked_of_the_server(server, capsys, command):
    """A rollout argument is first tried as a ticket file; an id over 255 bytes made that an OS
    error ("[Errno 36] File name too long") before anything was asked."""
    rc, _, err = cli(capsys, command, "x" * 300, "--url", server.rest_url)
    assert rc == 1 and "File name too long" not in err and "not_found" in err, err
