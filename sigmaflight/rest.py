"""The REST side that `Client` and `AsyncClient` share, without I/O: URL paths, request
bodies, answers, error mapping and the back-off of refusals worth retrying.

Each REST call is a `Call`: method, path, body and how to read the answer. `Client` sends it
with httpx.Client (`send`), `AsyncClient` with httpx.AsyncClient (`send_async`); both map the
answer the same way (`check_answer`) and retry the same refusals on the same schedule
(`retry_delay`), so the two clients cannot drift apart.

Ids are never put into a path as they are: a rollout id must look like one the server can give
(`ROLLOUT_ID`, the data plane's id pattern) and a model id must be free of dot segments and
control characters; anything else is `NotFound` before any request is made, and what passes is
percent-encoded, so no string a caller gives can change which route a request reaches.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import os
import ssl
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx

from sigmaflight.errors import ApiError, NotFound, Picklable, RolloutFailed, ServerUnreachable, Unauthorized
from sigmaflight.records import ROLLOUT_ID
from sigmaflight.wire import MAX_STATUS_WAIT_S, STATES, TERMINAL, RolloutList, RolloutStatus, Ticket

T = TypeVar("T")

MAX_TICKET = 1024
"""Longest Flight ticket the server looks up (`GET /v1/rollouts?ticket=`), in characters."""

MAX_MODEL_ID = 1024
"""Longest model id put into a path, in characters."""

RETRY_STATUSES = frozenset({429, 503})
"""Refusals that say "not now" (a full queue, too many pushes, a journal or worker briefly away)."""

NOT_RETRIED = frozenset({"weights_failed"})
"""Error types of those statuses that say "not until someone acts": a model failed closed refuses
its rollouts until a push of every tensor commits or the server restarts, which no wait brings."""


def worth_retrying(status: int | None, error_type: str) -> bool:
    """Whether a refusal says "not now" (back off and send it again) rather than "no"."""
    return status in RETRY_STATUSES and error_type not in NOT_RETRIED


RETRY_FIRST_S = 0.05
"""The first pause before retrying one of RETRY_STATUSES; it doubles up to the answer's Retry-After."""


def ref(value: object, what: str = "rollout_id") -> str:
    """The string of a Ticket or a str; TypeError naming `what` for anything else."""
    if isinstance(value, Ticket):
        return value.id
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str or a sigmaflight.wire.Ticket, not {type(value).__name__}")
    return value


def is_rollout_id(value: str) -> bool:
    return ROLLOUT_ID.fullmatch(value) is not None


def could_be_ticket(value: str) -> bool:
    """Whether `value` can be a Flight ticket the server looks up: 1..MAX_TICKET printable characters."""
    return 0 < len(value) <= MAX_TICKET and value.isprintable() and _utf8(value)


def _utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def shown(value: str) -> str:
    """`value` for a message: repr, cut short when long."""
    return repr(value) if len(value) <= 80 else f"{value[:60]!r}... ({len(value)} characters)"


def no_rollout(value: str, url: str | None = None) -> NotFound:
    """The NotFound of a string that names no rollout (404, as the server answers one)."""
    return NotFound(404, "not_found", f"no rollout or ticket {shown(value)}" + (f" on {url}" if url else ""))


def rollout_path(value: object) -> str:
    """`/v1/rollouts/{id}` for a Ticket or rollout id; NotFound (no request made) for a string
    that cannot be a rollout id."""
    rollout_id = ref(value)
    if not is_rollout_id(rollout_id):
        raise no_rollout(rollout_id)
    return "/v1/rollouts/" + quote(rollout_id, safe="")


def model_path(model_id: object, tail: str) -> str:
    """`/v1/models/{model_id}/{tail}`. Model ids may hold "/" (hub ids, `org/name@revision`); an
    empty, "." or ".." segment, a control character or whitespace is no model (NotFound, no request
    made), and everything but "/" is percent-encoded."""
    if not isinstance(model_id, str):
        raise TypeError(f"model_id must be a str, not {type(model_id).__name__}")
    if (not 0 < len(model_id) <= MAX_MODEL_ID or not model_id.isprintable() or any(c.isspace() for c in model_id)
            or any(part in ("", ".", "..") for part in model_id.split("/")) or not _utf8(model_id)):
        raise NotFound(404, "not_found", f"no model {shown(model_id)}")
    return f"/v1/models/{quote(model_id, safe='/')}/{tail}"


def check_idempotency_key(key: str | None) -> dict[str, str]:
    """The Idempotency-Key header, or ValueError naming it when it cannot be one (the server's
    rule: 1..255 printable ASCII characters without spaces)."""
    if key is None:
        return {}
    if not isinstance(key, str) or not 0 < len(key) <= 255 or not all(" " < c <= "~" for c in key):
        raise ValueError("idempotency_key: must be 1..255 printable ASCII characters without spaces")
    return {"idempotency-key": key}


class CAFileError(Picklable, ValueError):
    """A `ca_file` that cannot be trusted: unreadable, or no PEM certificate in it. `.path` and
    `.reason` (the `sigmaflight` command names its --ca-file flag with them)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"ca_file {path}: {reason}")
        self.path, self.reason = path, reason


@dataclass(frozen=True)
class Trust:
    """Whom a client trusts on TLS: `verify` for httpx (True: the system's CAs), `root_certs` (the
    PEM bytes) for Flight's `tls_root_certs` (None: gRPC's default roots)."""

    verify: ssl.SSLContext | bool = True
    root_certs: bytes | None = None


def trust(ca_file: str | os.PathLike[str] | None) -> Trust:
    """The Trust of `ca_file`: the PEM certificate(s) a self-signed or private-CA server's
    certificate is checked against, on REST (https) and Flight (grpc+tls) alike; None: the
    system's. CAFileError naming the file when it cannot be read or holds no certificate."""
    if ca_file is None:
        return Trust()
    path = os.fspath(ca_file)
    try:
        with open(path, "rb") as f:
            pem = f.read()
    except OSError as exc:
        raise CAFileError(path, f"cannot read it ({exc.strerror or exc})") from None
    try:
        if b"-----BEGIN CERTIFICATE-----" not in pem:
            raise ValueError("no -----BEGIN CERTIFICATE----- in it")
        context = ssl.create_default_context(cadata=pem.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError, ValueError) as exc:
        raise CAFileError(path, f"not a PEM certificate ({exc})") from None
    return Trust(context, pem)


# ---- calls --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call(Generic[T]):
    """One REST call: what to send and how to read a 2xx answer. `retry`: back off the
    RETRY_STATUSES refusals instead of raising them."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    options: Mapping[str, Any] = field(default_factory=dict)
    retry: bool = False


def submit(request: Mapping[str, Any], idempotency_key: str | None = None, *, retry: bool = False) -> Call[Ticket]:
    """POST /v1/rollouts with the RolloutRequest fields (`return_` spelled `return`)."""
    body = dict(request)
    if "return_" in body:
        body["return"] = body.pop("return_")
    headers = check_idempotency_key(idempotency_key)
    return Call("POST", "/v1/rollouts", lambda r: Ticket.model_validate(r.json()),
                {"json": body, "headers": headers}, retry)


def branch_body(parent: object, step: int, samples: list[int] | None, branches: int,
                sampler: Mapping[str, Any] | None, request: Mapping[str, Any]) -> dict[str, Any]:
    """The RolloutRequest fields of a branch rollout (contract, "Branch rollouts")."""
    body: dict[str, Any] = dict(request)
    body["branch_from"] = {"rollout": ref(parent, "parent"), "step": int(step),
                           "samples": None if samples is None else [int(j) for j in samples]}
    body["num_outputs_per_prompt"] = int(branches)
    if sampler is not None:
        body["sampler"] = dict(sampler)
    return body


def status(rollout_id: object, wait_s: float | None = None, timeout: float | None = None) -> Call[RolloutStatus]:
    """GET /v1/rollouts/{id}; with `wait_s`, held by the server until the rollout ends or for
    `wait_s` seconds (then `timeout`, the client's own per request, is counted past the hold)."""
    options: dict[str, Any] = {}
    if wait_s is not None:
        if not 0 < wait_s <= MAX_STATUS_WAIT_S:
            raise ValueError(f"wait_s must be a number of seconds greater than 0 and at most {MAX_STATUS_WAIT_S:g}, "
                             f"got {wait_s!r}")
        options["params"] = {"wait_s": f"{wait_s:g}"}
        if timeout is not None:
            options["timeout"] = wait_s + timeout
    return Call("GET", rollout_path(rollout_id), lambda r: RolloutStatus.model_validate(r.json()), options)


def cancel(rollout_id: object) -> Call[RolloutStatus]:
    return Call("DELETE", rollout_path(rollout_id), lambda r: RolloutStatus.model_validate(r.json()))


def rollout_page(status: str | None = None, limit: int = 100, ticket: str | None = None,
                 after: object = None) -> Call[RolloutList]:
    """GET /v1/rollouts. `status` must be one of the six states and `after` (a rollout id or a
    Ticket) one a server can give: anything else (the empty string too) is a ValueError naming the
    argument, before any request; a well-formed `after` the server does not know is its 422."""
    if status is not None:
        if not isinstance(status, str):
            raise TypeError(f"status must be a str or None, not {type(status).__name__}")
        if status not in STATES:
            raise ValueError(f"status must be one of {', '.join(STATES)}, got {shown(status)}")
    if after is not None:
        after = ref(after, "after")
        if not is_rollout_id(after):
            raise ValueError(f"after must be a rollout id (the `next` of the page before), got {shown(after)}")
    params: dict[str, Any] = {"limit": limit, **({"status": status} if status else {}),
                              **({"ticket": ticket} if ticket else {}), **({"after": after} if after else {})}
    return Call("GET", "/v1/rollouts", lambda r: RolloutList.model_validate(r.json()), {"params": params})


def models() -> Call[list[dict[str, Any]]]:
    return Call("GET", "/v1/models", lambda r: list(r.json()["models"]))


def delete_lora(model_id: object) -> Call[dict[str, Any]]:
    return Call("DELETE", model_path(model_id, "lora"), lambda r: dict(r.json()))


def _real(value: object) -> bool:
    """Whether `value` is a real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


HOLD_S = 20.0
"""How long `wait` asks the server to hold each status read."""


class Waiting:
    """The reads of `wait`, shared by both clients. Each read asks the server to hold it until the
    rollout ends (`hold_s`: HOLD_S, never past the deadline), so a wait costs the server about a
    read per HOLD_S and sees the end when it happens. After each status, `pause_after` gives the
    pause before the next read: none after a read the server held to its end, `poll_s` doubling up
    to `max_poll_s` after one it answered early (a server that holds no reads: an older one, or one
    past its --max-held-reads), or None when the rollout is finished; RolloutFailed
    (RolloutCancelled) when it ended other than succeeded unless `raise_on_failure=False`,
    TimeoutError after `timeout` seconds (None or inf: no limit). A timeout that is not a number
    is a TypeError naming it, a NaN or negative one a ValueError, as is a poll that is not a
    finite number of seconds > 0."""

    def __init__(self, timeout: float | None, poll_s: float, max_poll_s: float, raise_on_failure: bool) -> None:
        if timeout is None:
            timeout = math.inf
        if not _real(timeout):
            raise TypeError(f"timeout must be a number of seconds or None, not {type(timeout).__name__}")
        if not timeout >= 0:  # NaN too: nothing is <= NaN, so it would never time out
            raise ValueError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
        for name, value in (("poll_s", poll_s), ("max_poll_s", max_poll_s)):
            if not _real(value) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        self.timeout, self.deadline = timeout, time.monotonic() + timeout
        self.pause, self.max_pause = poll_s, max(max_poll_s, poll_s)
        self.raise_on_failure = raise_on_failure
        self.asked, self.sent = 0.0, 0.0

    def hold_s(self) -> float:
        """The hold to ask of the next read (which is sent now)."""
        self.sent = time.monotonic()
        self.asked = round(max(0.001, min(HOLD_S, self.deadline - self.sent)), 3)
        return self.asked

    def pause_after(self, st: RolloutStatus) -> float | None:
        if st.status in TERMINAL:
            if self.raise_on_failure and st.status != "succeeded":
                raise RolloutFailed.from_status(st)
            return None
        now = time.monotonic()
        left = self.deadline - now
        if left <= 0:
            raise TimeoutError(f"rollout {st.id} still {st.status} after {self.timeout} s")
        if self.asked and now - self.sent >= 0.9 * self.asked:
            return 0.0  # held until its time ran out: ask again at once
        pause, self.pause = min(self.pause, left), min(self.pause * 2, self.max_pause)
        return pause


# ---- answers ------------------------------------------------------------------------------


def error_body(r: httpx.Response) -> tuple[str, str, Any]:
    """The type, message and details of a refusal's body (the contract's error body); "http_error"
    and the start of the text when something else answered."""
    try:
        err = r.json()["error"]
        return str(err["type"]), str(err["message"]), err.get("details")
    except (ValueError, KeyError, TypeError):
        return "http_error", r.text[:500], None


def raise_for(r: httpx.Response) -> None:
    """The typed error of a refusal (the contract's error body), nothing for a 2xx/3xx."""
    if r.status_code < 400:
        return
    type_, message, details = error_body(r)
    kind = {404: NotFound, 401: Unauthorized}.get(r.status_code, ApiError)
    raise kind(r.status_code, type_, message, details)


def check_answer(r: httpx.Response, pushed: MutableMapping[str, int] | None = None) -> httpx.Response:
    """`r` when it is a 2xx, else its typed error. A 2xx answer to a weights or LoRA change
    (`PUT`/`DELETE /v1/models/...`) records the model's new weights_version in `pushed`: the
    latest version this client made (what `stream(max_staleness=)` measures staleness against)."""
    raise_for(r)
    if 300 <= r.status_code:
        raise ApiError(r.status_code, "http_error", f"unexpected redirect to {r.headers.get('location')!r}")
    if pushed is not None and r.request.method in ("PUT", "DELETE") and r.request.url.path.startswith("/v1/models/"):
        try:
            answer = r.json()
            pushed[str(answer["id"])] = int(answer["weights_version"])
        except (ValueError, KeyError, TypeError):
            pass
    return r


def parse(call: Call[T], r: httpx.Response) -> T:
    """The call's reading of a 2xx answer; ApiError "bad_answer" when the body is not what a
    sigmaflight server sends (something else answers at the URL)."""
    try:
        return call.parse(r)
    except (ValueError, KeyError, TypeError) as exc:  # JSON or pydantic errors are ValueErrors
        raise ApiError(r.status_code, "bad_answer", f"{call.method} {call.path} answered {r.status_code} with a body "
                       f"that is not a sigmaflight answer ({type(exc).__name__})") from exc


def unreachable_reason(exc: httpx.TransportError, timeout: float | None, url: str = "") -> str:
    """Why a REST call got no HTTP answer, in words that say what to check."""
    if isinstance(exc, httpx.TimeoutException) and timeout is not None:
        return f"no answer within {timeout:g} s ({type(exc).__name__})"
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return (f"{exc} (the server's certificate is not trusted: pass the CA that signed it, or a self-signed "
                "server's own cert.pem, as ca_file= / --ca-file / SIGMAFLIGHT_CA_FILE)")
    https = f"; if it serves https (--tls-cert), use https://{url[len('http://'):]}" if url.startswith("http://") else ""
    if isinstance(exc, httpx.RemoteProtocolError) and "without sending a response" in str(exc):
        return (f"{exc} (the connection was closed with no answer: did the server stop or restart? is "
                f"`sigmaflight serve` running there?{https})")
    if isinstance(exc, httpx.RemoteProtocolError):
        return (f"what answers there does not speak HTTP/1.1 ({exc}); is this the Flight port? The REST port is "
                f"`sigmaflight serve --port` (default 8000), Flight's is --flight-port (default 8815){https}")
    return f"{exc or type(exc).__name__} (is `sigmaflight serve` running there?)"


def retry_delay(r: httpx.Response, attempt: int) -> float | None:
    """The pause before retry number `attempt` (0 first) of a refusal worth retrying, or None
    when `r` is not one: RETRY_FIRST_S doubling each time, at most the answer's Retry-After
    (1 s when it gives none)."""
    if not worth_retrying(r.status_code, error_body(r)[0]):
        return None
    try:
        cap = float(r.headers.get("retry-after", "1"))
    except ValueError:
        cap = 1.0
    return backoff(attempt, cap)


def backoff(attempt: int, cap: float = 1.0) -> float:
    """The pause before retry number `attempt` (0 first): RETRY_FIRST_S doubling, at most `cap`."""
    return min(RETRY_FIRST_S * 2 ** min(attempt, 16), max(cap, RETRY_FIRST_S))


def send(http: httpx.Client, call: Call[T], *, url: str, timeout: float | None,
         pushed: MutableMapping[str, int] | None = None) -> T:
    """Send `call` with a blocking client; its parsed answer or its typed error."""
    attempt = 0
    while True:
        try:
            r = http.request(call.method, call.path, **call.options)
        except httpx.TransportError as exc:
            raise ServerUnreachable(url, unreachable_reason(exc, timeout, url)) from exc
        pause = retry_delay(r, attempt) if call.retry else None
        if pause is None:
            return parse(call, check_answer(r, pushed))
        time.sleep(pause)
        attempt += 1


async def send_async(http: httpx.AsyncClient, call: Call[T], *, url: str, timeout: float | None,
                     pushed: MutableMapping[str, int] | None = None) -> T:
    """`send` with an asyncio client: the same mapping and the same retries."""
    attempt = 0
    while True:
        try:
            r = await http.request(call.method, call.path, **call.options)
        except httpx.TransportError as exc:
            raise ServerUnreachable(url, unreachable_reason(exc, timeout, url)) from exc
        pause = retry_delay(r, attempt) if call.retry else None
        if pause is None:
            return parse(call, check_answer(r, pushed))
        await asyncio.sleep(pause)
        attempt += 1
