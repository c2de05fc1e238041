"""`sigmaflight submit` has a flag for every RolloutRequest field.

The fields are enumerated from the wire model's JSON schema (what the REST API documents), not
from the CLI's own walk; each flag is found by what it does: parsing it sets that one field.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from typing import Any

import pytest

from sigmaflight.cli import build_parser
from sigmaflight.commands.submit import request_from_args
from sigmaflight.wire import RolloutRequest


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """The object a property stands for: through $ref, and through anyOf [X, null]."""
    if "$ref" in node:
        return _resolve(schema, schema["$defs"][node["$ref"].rsplit("/", 1)[1]])
    if "anyOf" in node:
        (inner,) = [n for n in node["anyOf"] if n.get("type") != "null"]
        return _resolve(schema, inner)
    return node


def wire_leaves() -> dict[tuple[str, ...], dict[str, Any]]:
    schema = RolloutRequest.model_json_schema(by_alias=True)
    out: dict[tuple[str, ...], dict[str, Any]] = {}

    def walk(node: dict[str, Any], prefix: tuple[str, ...]) -> None:
        for name, prop in node["properties"].items():
            target = _resolve(schema, prop)
            if "properties" in target:
                walk(target, (*prefix, name))
            else:
                out[(*prefix, name)] = target

    walk(schema, ())
    return out


def example(leaf: dict[str, Any]) -> tuple[list[str], Any]:
    """(command-line words after the flag, the value the request should then hold)."""
    if "enum" in leaf:
        return [str(leaf["enum"][-1])], leaf["enum"][-1]
    kind = leaf.get("type")
    if kind == "boolean":
        return [], True
    if kind == "integer":
        return ["3"], 3
    if kind == "number":
        return ["1.5"], 1.5
    if kind == "string":
        return ["abc"], "abc"
    if kind == "array" and leaf["items"].get("type") == "integer":
        return ["1,2"], [1, 2]
    if kind == "array" and leaf["items"].get("type") == "string":
        return ["abc"], ["abc"]
    raise AssertionError(f"no example for {leaf}")


def nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {path[-1]: value}
    for key in reversed(path[:-1]):
        out = {key: out}
    return out


def submit_options() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [o for a in sub.choices["submit"]._actions for o in a.option_strings if o.startswith("-")]


def body_for(argv: list[str]) -> dict[str, Any] | None:
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            args = build_parser().parse_args(["submit", *argv])
        except SystemExit:
            return None
    if args.json and argv[0] == "--json" and len(argv) == 2:
        return None  # --json takes a file; its own test is below
    return request_from_args(args)


def test_the_schema_walk_sees_nested_fields():
    leaves = wire_leaves()
    assert ("prompts",) in leaves and ("sampler", "noise_level") in leaves and ("return", "outputs") in leaves
    assert ("branch_from", "step") in leaves and len(leaves) >= 25


@pytest.mark.parametrize("path", sorted(wire_leaves()), ids=".".join)
def test_every_wire_field_has_a_flag(path):
    leaf = wire_leaves()[path]
    words, value = example(leaf)
    found = [o for o in submit_options() if body_for([o, *words]) == nested(path, value)]
    assert found, f"no submit flag sets {'.'.join(path)}"


def test_flags_override_the_json_base(tmp_path):
    base = tmp_path / "r.json"
    base.write_text('{"prompts": ["a"], "sampler": {"type": "ode", "noise_level": 0.3}, "return": {"steps": [0]}}')
    body = body_for(["--json", str(base), "--noise-level", "0.9", "--return-outputs", "-p", "b", "-p", "c"])
    assert body == {"prompts": ["b", "c"], "sampler": {"type": "ode", "noise_level": 0.9},
                    "return": {"steps": [0], "outputs": True}}


def test_submit_help_gives_the_defaults_a_server_applies_to_a_request_that_leaves_them_out():
    """`submit --help` states "; default X" for the fields the server fills in; a request with
    none of them set runs with exactly those (read back from the trajectory the server wrote)."""
    import re

    from sigmaflight import Client
    from tests.servers import InProcessServer

    text = " ".join(_help("submit").split())
    said = dict(re.findall(r"\[([a-z_.]+); default ([^\]]+)\]", text))
    assert set(said) == {"num_outputs_per_prompt", "sampler.type", "sampler.noise_level", "sampler.log_prob",
                         "return.log_probs", "return.latent_dtype", "return.outputs", "return.velocities",
                         "return.conditioning"}, said
    with InProcessServer() as server, Client(server.rest_url) as client:
        ticket = client.submit(prompts=["a red cube"], num_inference_steps=2)
        traj = client.pull(ticket)
        table = client.pull_stream(ticket, "trajectory")
    meta = traj.metadata
    ran = {
        "num_outputs_per_prompt": str(meta["num_outputs_per_prompt"]),
        "sampler.type": meta["sampler"]["type"],
        "sampler.noise_level": str(meta["sampler"]["noise_level"]),
        "sampler.log_prob": meta["sampler"]["log_prob"],
        "return.log_probs": "on" if "log_prob" in table.column_names else "off",
        "return.latent_dtype": "native" if meta["latent_dtype"] == meta["native_dtype"] else meta["latent_dtype"],
        "return.outputs": "on" if "outputs" in meta["streams"] else "off",
        "return.velocities": "on" if "velocity" in table.column_names else "off",
        "return.conditioning": "on" if "conditioning" in meta["streams"] else "off",
    }
    assert ran == said


def _help(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return out.getvalue()
