"""Wire models, their one converter, settings precedence and the CLI's help."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError
from sigmaflight.control.serve import build_parser, settings_from_args
from sigmaflight.control.settings import Settings, TokenFileError, read_token_file

from sigmaflight.wire import RolloutRequest, to_spec

CONTRACT = Path(__file__).resolve().parents[2] / "docs" / "contract.md"


def test_to_spec_maps_every_field_and_fills_defaults():
    req = RolloutRequest.model_validate(
        {
            "prompts": ["a", "b"],
            "negative_prompt": "blurry",
            "num_outputs_per_prompt": 3,
            "guidance_scale": 4.5,
            "height": 32,
            "width": 48,
            "seed": 17,
            "sampler": {"type": "cps", "noise_level": 0.5, "sde_steps": [2, 0], "log_prob": "no_const"},
            "return": {"steps": [0, 3], "log_probs": False, "latent_dtype": "bfloat16"},
        }
    )
    spec = to_spec(req, model_id="tiny-sd3", default_steps=6, seed=999)
    assert spec.prompts == ("a", "b") and spec.num_samples == 6
    assert spec.num_inference_steps == 6  # the model's default
    assert spec.seed == 17 and spec.seeds is None  # the request's seed beats the server's draw
    assert spec.sampler.type == "cps" and spec.sampler.sde_steps == (2, 0) and spec.sampler.log_prob == "no_const"
    assert spec.return_steps == (0, 3) and spec.return_log_probs is False and spec.latent_dtype == "bfloat16"
    assert (spec.height, spec.width, spec.guidance_scale, spec.negative_prompt) == (32, 48, 4.5, "blurry")


def test_to_spec_uses_the_server_seed_only_without_seed_or_seeds():
    assert to_spec(RolloutRequest(prompts=["a"]), model_id="m", default_steps=2, seed=5).seed == 5
    spec = to_spec(RolloutRequest(prompts=["a", "b"], seeds=[3, 4]), model_id="m", default_steps=2, seed=5)
    assert spec.seeds == (3, 4) and spec.seed is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompts": ["a"], "seed": 1, "seeds": [1]}, ("seeds",)),
        ({"prompts": ["a", "b"], "seeds": [1, -1]}, ("seeds", 1)),
        ({"prompts": ["a"], "seeds": [2**63]}, ("seeds", 0)),
        ({"prompts": ["a"], "seed": 2**63}, ("seed",)),
        ({"prompts": ["a"], "guidance_scale": float("inf")}, ("guidance_scale",)),
        ({"prompts": ["a"], "num_outputs_per_prompt": 0}, ("num_outputs_per_prompt",)),
        ({"prompts": ["a"], "return": {"latent_dtype": "int8"}}, ("return", "latent_dtype")),
        ({"prompts": ["a"], "sampler": {"log_prob": "sum"}}, ("sampler", "log_prob")),
        ({"prompts": ["a"], "sampler": {"extra": 1}}, ("sampler", "extra")),
    ],
)
def test_request_rejects_bad_values_naming_the_field(body, field):
    with pytest.raises(ValidationError) as info:
        RolloutRequest.model_validate(body)
    assert info.value.errors()[0]["loc"] == field


def test_settings_flag_beats_env_beats_default(monkeypatch):
    monkeypatch.setenv("SIGMAFLIGHT_PORT", "9123")
    monkeypatch.setenv("SIGMAFLIGHT_WORKERS", "3")
    args = build_parser().parse_args(["--port", "9200", "--batch-invariant"])
    s = settings_from_args(args)
    assert (s.port, s.workers, s.flight_port, s.batch_invariant) == (9200, 3, 8815, True)


def test_tokens_come_from_file_and_variable(tmp_path):
    f = tmp_path / "tokens"
    f.write_text("# trainers\n\nalpha\n  beta  \n")
    s = Settings(token_file=f, token="gamma,delta")
    assert s.tokens() == ["gamma", "delta", "alpha", "beta"]
    assert "gamma" not in repr(s)  # a secret never shows in a repr (and so never in a log)


def test_a_token_file_saved_with_a_byte_order_mark_reads_as_without_it(tmp_path):
    """Notepad and PowerShell write UTF-8 with a BOM: its first line is still a token or a comment,
    so a file of comments only is still refused (fails closed) and a first-line token matches."""
    f = tmp_path / "tokens"
    f.write_bytes("alpha\r\nbeta\n".encode("utf-8-sig"))
    assert Settings(token_file=f).tokens() == ["alpha", "beta"]
    f.write_bytes("# only a comment\n".encode("utf-8-sig"))
    with pytest.raises(TokenFileError, match="holds no token"):
        read_token_file(f)


def test_serve_help_explains_every_setting(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    for name, field in Settings.model_fields.items():
        assert "--" + name.replace("_", "-") in text
        assert f"SIGMAFLIGHT_{name.upper()}" in "".join(text.split())
        assert field.description


def test_invalid_setting_is_refused_with_its_name():
    with pytest.raises(ValidationError, match="workers"):
        Settings(workers=0)


def test_wire_status_names_are_the_job_states():
    """The contract's list of states (docs/contract.md, "Status") is what every form of them says:
    the wire model's JSON schema, the OpenAPI document (its RolloutStatus and the list route's
    `status` filter) and the job layer's states; the terminal ones are all but queued and running."""
    from sigmaflight.control.http.openapi import openapi_document
    from sigmaflight.control.jobs import STATES, TERMINAL

    from sigmaflight.wire import RolloutStatus

    found = re.findall(r"^Status: `id`, `status` in \{([a-z, ]+)\}", CONTRACT.read_text(), flags=re.M)
    assert len(found) == 1, "docs/contract.md should list the states once, as 'Status: `id`, `status` in {...}'"
    contract = [s.strip() for s in found[0].split(",")]
    assert contract[:2] == ["queued", "running"], contract
    assert RolloutStatus.model_json_schema()["properties"]["status"]["enum"] == contract
    doc = openapi_document()
    assert doc["components"]["schemas"]["RolloutStatus"]["properties"]["status"]["enum"] == contract
    (status_filter,) = [p for p in doc["paths"]["/v1/rollouts"]["get"]["parameters"] if p["name"] == "status"]
    assert status_filter["schema"]["enum"] == contract
    assert list(STATES) == contract
    assert set(TERMINAL) == set(contract) - {"queued", "running"}
