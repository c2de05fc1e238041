"""Server settings: one field per knob, each also an environment variable SIGMAFLIGHT_<NAME>.

Precedence: command-line flag > environment variable > default. `sigmaflight serve --help`
is generated from the field descriptions below, so they are the documentation.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

GiB = 1 << 30
MiB = 1 << 20


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIGMAFLIGHT_", extra="forbid", validate_default=True)

    # Network
    host: str = Field("127.0.0.1", description="Address both planes bind to.")
    port: int = Field(8000, ge=0, le=65535, description="REST port (0 = pick a free one).")
    flight_port: int = Field(8815, ge=0, le=65535, description="Arrow Flight port (0 = pick a free one).")
    advertise_host: str | None = Field(
        None,
        description="Host name put in Flight locations when bound to 0.0.0.0 (default: the machine's host name).",
    )

    # Models
    model: str = Field("tiny-sd3", description="Default model id, loaded at start-up.")
    model_dir: Path | None = Field(
        None,
        description="Directory of local diffusers pipelines: each subdirectory is served under its name.",
    )
    device: str = Field("cpu", description="Torch device for the models (cpu, cuda, cuda:1, ...).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Model dtype.")
    batch_invariant: bool = Field(
        False,
        description="Run the model row by row so a sample's trajectory is bit-identical whatever its batch (slower).",
    )

    # Jobs
    workers: int = Field(
        1, ge=1, le=64, description="Rollout worker threads (local backend) or Ray worker actors (--backend ray)."
    )
    torch_threads: int | None = Field(
        None, ge=1, le=1024, description="torch intra-op threads of the process that runs the rollouts (each Ray "
        "worker: its own; default: torch's, one per core). Where clients or other work share the cores, fewer "
        "can run more: docs/control.md, \"Co-batching\".",
    )
    backend: Literal["local", "ray"] = Field(
        "local", description="Where rollouts run: this process (local) or Ray actors, one device each (ray)."
    )
    ray_address: str = Field(
        "auto", description="Ray cluster to join with --backend ray: auto (the running one), ray://..., or local."
    )
    ray_num_cpus: float = Field(1.0, gt=0, description="CPUs each Ray worker actor reserves (plus 1 GPU on cuda).")
    ray_call_timeout_s: float = Field(
        30.0, gt=0, description="Seconds a Ray worker has to answer a call (placement, progress, release); one "
        "that does not is killed, its rollouts fail as WorkerDied, and it is replaced.",
    )
    ray_start_timeout_s: float = Field(
        600.0, gt=0, description="Seconds a Ray worker has to start (load its model) or to load pushed weights.",
    )
    queue_size: int = Field(64, ge=1, description="Rollouts that may wait; beyond it POST answers 429.")
    max_batch_samples: int = Field(
        64, ge=1, description="Samples of one co-batched model call (the queued rollouts that can share it run as "
        "one batch; CFG doubles the rows inside the model); 1 turns co-batching off. A request with more samples "
        "runs alone, as one call.",
    )
    batch_wait_ms: float = Field(
        0.0, ge=0, le=10_000, description="Milliseconds a worker waits for compatible rollouts before starting a batch "
        "smaller than --max-batch-samples; each that joins keeps it open half as long past its arrival, "
        "at most 8x in all (0: a lone rollout starts at once).",
    )
    ttl_s: float = Field(
        3600.0, gt=0, description="Seconds a finished result is kept; then a succeeded rollout expires, a failed or "
        "cancelled one keeps its status and error.",
    )
    max_records: int = Field(
        10_000, ge=1, description="Records of ended rollouts kept (their status, error, idempotency key); past it "
        "the oldest are dropped and what they hold is released, before their --ttl-s if need be.",
    )

    # Store
    data_dir: Path | None = Field(
        None,
        description="Directory for durable trajectories and job records; survives restarts. None = memory only.",
    )
    shm_dir: Path | None = Field(
        None,
        description="Directory in shared memory (e.g. /dev/shm) for finished trajectories as Arrow IPC files, kept in "
        "the private DIR/sigmaflight-<uid>/: served memory-mapped, read directly by trainers on this host (with "
        "--backend ray, each worker uses DIR/worker-N/sigmaflight-<uid>/ on its own node). None = off.",
    )
    store_budget_bytes: int = Field(
        4 * GiB, ge=0, description="Bytes of trajectories held in memory; beyond it they spill to --data-dir."
    )

    # Security
    token_file: Path | None = Field(
        None, description="File of bearer tokens, one a line (# comments, blank lines ignored)."
    )
    token: SecretStr | None = Field(
        None, description="A bearer token (comma-separated for several); prefer --token-file. Never logged."
    )
    tls_cert: Path | None = Field(None, description="PEM certificate: serve REST over https and Flight over grpc+tls.")
    tls_key: Path | None = Field(None, description="PEM private key for --tls-cert.")

    # Limits
    max_body_bytes: int = Field(1 * MiB, ge=1024, description="Largest accepted request body (413 beyond).")
    max_weights_bytes: int = Field(
        512 * MiB, ge=1024, description="Largest accepted PUT /v1/models/{id}/weights or /lora body (safetensors; 413 beyond)."
    )
    max_prompts: int = Field(64, ge=1, description="Prompts per request.")
    max_prompt_chars: int = Field(
        4096, ge=1, description="Characters of one prompt or negative_prompt (the text encoders keep their first 77 "
        "to 512 tokens; a longer text only costs tokenizer time and log lines)."
    )
    max_samples: int = Field(256, ge=1, description="Samples (prompts x outputs) per request.")
    max_steps: int = Field(200, ge=1, description="num_inference_steps per request.")
    max_rollout_bytes: int = Field(
        2 * GiB, ge=1, description="Estimated captured latent bytes per rollout, and the latents its loop holds "
        "(one x_i of every sample), refused up front beyond it."
    )
    max_flight_streams: int = Field(64, ge=1, description="Concurrent Flight do_get streams.")
    max_held_reads: int = Field(
        1024, ge=0, description="Status reads held at once until their rollout ends (GET /v1/rollouts/{id}?wait_s=); "
        "past it a read answers at once (0: none is held).",
    )
    max_weights_pushes: int = Field(
        2, ge=1, description="PUT .../weights and .../lora bodies taken at once (each up to --max-weights-bytes); "
        "429 beyond, before the body is read."
    )
    weights_file_dir: Path | None = Field(
        None, description="A directory whose safetensors files a same-host trainer may push by path "
        "(POST /v1/models/{id}/weights/file); files under --shm-dir may be pushed too."
    )
    weights_swap: Literal["staged", "in-place"] = Field(
        "staged", description="How a streamed weights push lands. staged: into a copy of each pushed tensor, "
        "swapped in whole at the end (rollouts keep running; up to one extra copy of the transformer). in-place: "
        "straight into the served tensors (no copy) while rollouts of that model are held; a push that fails "
        "or is cut and expires fails the model closed (its rollouts refused, type weights_failed) until a full "
        "push commits or the server restarts."
    )
    weights_push_timeout_s: float = Field(
        300.0, gt=0, description="Seconds a streamed weights push (Flight do_put) that no stream feeds (cut, "
        "client gone) keeps its staging for a resume; then it is dropped and its memory freed."
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="Seconds a connection may take to send a request's line and headers (from its "
        "first byte, or from connecting); the connection is closed beyond (with a 408)."
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="Seconds a request body may take to arrive in full (from the request's headers); "
        "408 beyond. A 512 MiB weights push needs about 72 Mbit/s within the default."
    )

    # Logging
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_format: Literal["json", "text"] = Field("json", description="Log line format.")

    @field_validator("model_dir", "data_dir", "shm_dir", "weights_file_dir", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("token_file", "tls_cert", "tls_key", mode="before")
    @classmethod
    def _empty_names_no_file(cls, value: object) -> object:
        # `--token-file "$TOKENS"` with TOKENS unset asked for auth (or TLS): refused, never read as
        # "not set", which would serve without auth (or over plain http)
        if isinstance(value, str) and not value.strip():
            raise ValueError("is empty: it names no file (to serve without it, leave it unset)")
        return value

    def tls_certificates(self) -> tuple[tuple[bytes, bytes], ...]:
        """The (certificate, key) PEM pair read from --tls-cert/--tls-key, or () without TLS.

        The one place the PEM files are read: the local node's Flight server and every Ray
        worker's get these bytes."""
        if self.tls_cert is None or self.tls_key is None:
            return ()
        return ((Path(self.tls_cert).read_bytes(), Path(self.tls_key).read_bytes()),)

    def tokens(self) -> list[str]:
        """All configured bearer tokens (file and variable); empty = no auth (neither is set).

        A --token-file that is missing, unreadable or holds no token raises TokenFileError, and a
        --token / SIGMAFLIGHT_TOKEN that holds no token (empty, or only commas and spaces) raises
        TokenError: naming a token asks for auth, so it never silently turns auth off."""
        found: list[str] = []
        if self.token is not None:
            given = [t.strip() for t in self.token.get_secret_value().split(",") if t.strip()]
            if not given:
                raise TokenError("--token (SIGMAFLIGHT_TOKEN): holds no token (it is empty, or only commas and "
                                 "spaces); refusing to start without auth. Give a token, or unset it to serve "
                                 "without auth")
            found += given
        if self.token_file is not None:
            found += read_token_file(self.token_file)
        return found


class TokenError(ValueError):
    """A token setting the server cannot use; the message names the setting and why (never a token)."""


class TokenFileError(TokenError):
    """A --token-file the server cannot use; the message names the file and why (never a token)."""


def unreadable(flag: str, path: str | Path, exc: OSError) -> str:
    """The one line for a file that `flag` names and that cannot be opened."""
    if isinstance(exc, FileNotFoundError):
        return f"{flag} {path}: no such file"
    if isinstance(exc, IsADirectoryError):
        return f"{flag} {path}: is a directory, not a file"
    return f"{flag} {path}: cannot be read ({exc.strerror or exc})"


def read_token_file(path: Path) -> list[str]:
    """The tokens of `path`, one a line (# comments and blank lines ignored).

    Raises TokenFileError when the file is missing, unreadable, not text, or holds no token."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a byte-order mark (Notepad, PowerShell) is no token
    except UnicodeDecodeError:
        raise TokenFileError(f"--token-file {path}: not UTF-8 text") from None
    except OSError as exc:
        raise TokenFileError(unreadable("--token-file", path, exc)) from None
    found = [line.strip() for line in text.splitlines()]
    found = [line for line in found if line and not line.startswith("#")]
    if not found:
        raise TokenFileError(
            f"--token-file {path}: holds no token (only blank or # comment lines); "
            "refusing to start without auth. Put one token a line, or drop --token-file to serve without auth"
        )
    return found


def token_file_exposed(path: Path) -> bool:
    """Whether anyone but the owner has any permission on `path` (mode & 0o077: group or others)."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return False
    return bool(stat.S_IMODE(mode) & 0o077)
