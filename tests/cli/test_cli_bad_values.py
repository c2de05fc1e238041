"""A bad value on the command line is bad usage (exit 2, one line naming the flag and why), said
before anything is sent: a negative or NaN `--timeout` submits no rollout, a number outside a
RolloutRequest field's bounds never reaches the server, and `pull -o` refuses a directory or a
folder that does not exist before it pulls a byte. Through the real `sigmaflight` command line
(`sigmaflight.cli.main`) on a real server in process."""

from __future__ import annotations

import httpx
import pytest

from tests.cli.conftest import cli
from tests.servers import metric


def rollouts(server) -> list[str]:
    with httpx.Client(base_url=server.rest_url) as http:
        return [r["id"] for r in http.get("/v1/rollouts", params={"limit": 1000}).json()["rollouts"]]


def served_bytes(server) -> float:
    with httpx.Client(base_url=server.rest_url) as http:
        return metric(http.get("/metrics").text, "sigmaflight_flight_bytes_served_total")


TIMEOUTS = [
    (("submit", "-p", "a red cube", "--steps", "2", "--wait"), "-1"),
    (("submit", "-p", "a red cube", "--steps", "2", "--wait"), "nan"),
    (("status", "some-id", "--wait"), "-5"),
    (("status", "some-id", "--wait"), "NaN"),
]


@pytest.mark.parametrize(("argv", "value"), TIMEOUTS)
def test_a_negative_or_nan_timeout_is_bad_usage_naming_the_flag_before_anything_is_sent(server, capsys, argv, value):
    before = rollouts(server)
    rc, out, err = cli(capsys, *argv, "--timeout", value, "--url", server.rest_url)
    assert rc == 2 and out == ""
    assert err.splitlines()[-1] == (f"sigmaflight {argv[0]}: error: argument --timeout: must be a number of seconds "
                                    f">= 0 (inf: no limit), got '{value}'")
    assert rollouts(server) == before  # was: the rollout submitted, then the refusal (exit 1)


def test_zero_and_inf_are_timeouts_a_wait_takes(server, finished, capsys):
    for value in ("0", "inf"):
        rc, out, err = cli(capsys, "status", finished, "--wait", "--timeout", value, "--url", server.rest_url)
        assert rc == 0 and '"succeeded"' in out, err


NUMBERS = [
    (("submit", "-p", "a", "--steps", "-1"), "--steps/--num-inference-steps", "must be an integer >= 1, got -1"),
    (("submit", "-p", "a", "--noise-level", "nan"), "--noise-level", "expected a finite number, got 'nan'"),
    (("submit", "-p", "a", "--noise-level", "-0.5"), "--noise-level", "must be a finite number >= 0.0, got -0.5"),
    (("submit", "-p", "a", "--guidance-scale", "inf"), "--guidance-scale", "expected a finite number, got 'inf'"),
    (("submit", "-p", "a", "--seed", "-5"), "--seed", "must be an integer >= 0 and <= 9223372036854775807, got -5"),
    (("submit", "-p", "a", "--seeds", "1,-2"), "--seeds", "must be an integer >= 0 and <= 9223372036854775807, "
     "got -2"),
    (("list", "--limit", "0"), "--limit", "must be an integer in 1..1000, got 0"),
    (("list", "--limit", "5000"), "--limit", "must be an integer in 1..1000, got 5000"),
]


@pytest.mark.parametrize(("argv", "flag", "why"), NUMBERS)
def test_a_number_outside_its_fields_bounds_is_bad_usage_naming_the_flag(server, capsys, argv, flag, why):
    before = rollouts(server)
    rc, out, err = cli(capsys, *argv, "--url", server.rest_url)
    assert rc == 2 and out == ""
    assert err.splitlines()[-1] == f"sigmaflight {argv[0]}: error: argument {flag}: {why}"  # was: exit 1, unnamed
    assert rollouts(server) == before


def test_pull_into_a_directory_is_refused_before_pulling(server, finished, tmp_path, capsys):
    before = served_bytes(server)
    rc, out, err = cli(capsys, "pull", finished, "-o", str(tmp_path), "--url", server.rest_url)
    assert rc == 2 and out == ""
    assert err == (f"sigmaflight pull: -o {tmp_path}: is a directory; give the file to write "
                   f"(e.g. -o {tmp_path / 'out.arrow'})\n")  # was: "incomplete or corrupt", a pull, IsADirectoryError
    assert served_bytes(server) == before and list(tmp_path.iterdir()) == []


def test_pull_into_a_folder_that_does_not_exist_makes_no_directories(server, finished, tmp_path, capsys):
    out_path = tmp_path / "typo" / "sub" / "x.arrow"
    before = served_bytes(server)
    rc, out, err = cli(capsys, "pull", finished, "-o", str(out_path), "--url", server.rest_url)
    assert rc == 2 and out == ""
    assert err == (f"sigmaflight pull: -o {out_path}: the folder {out_path.parent} does not exist; create it first "
                   "(pull makes no directories)\n")
    assert not (tmp_path / "typo").exists() and served_bytes(server) == before  # was: made typo/sub/, exit 0
    (tmp_path / "typo").mkdir(parents=True)
    (tmp_path / "typo" / "sub").write_text("a file, not a folder")
    rc, _, err = cli(capsys, "pull", finished, "-o", str(out_path), "--url", server.rest_url)
    assert rc == 2 and err.endswith(f"the folder {out_path.parent} is not a directory; create it first "
                                    "(pull makes no directories)\n")
    rc, _, err = cli(capsys, "pull", finished, "-o", str(tmp_path / "typo" / "x.arrow"), "--url", server.rest_url)
    assert rc == 0 and (tmp_path / "typo" / "x.arrow").is_file(), err


def test_a_json_request_file_holding_nan_is_bad_usage_naming_the_file_and_the_field(server, capsys, tmp_path):
    """Python's json reads NaN and Infinity, which JSON has not: the request then failed to encode,
    "Out of range float values are not JSON compliant", exit 1, naming neither file nor field."""
    path = tmp_path / "req.json"
    path.write_text('{"prompts": ["a"], "sampler": {"type": "sde", "noise_level": NaN}}')
    before = rollouts(server)
    rc, out, err = cli(capsys, "submit", "--json", str(path), "--url", server.rest_url)
    assert rc == 2 and out == ""
    assert err.splitlines()[-1] == f"sigmaflight submit: --json {path}: sampler.noise_level is NaN, not a JSON number"
    assert rollouts(server) == before


def test_cancel_help_says_what_a_release_does_to_each_status(capsys):
    rc, out, _ = cli(capsys, "cancel", "--help")
    text = " ".join(out.split())
    assert rc == 0 and "a succeeded one becomes expired, a failed or cancelled one keeps its status" in text, text
