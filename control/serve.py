"""What `sigmaflight serve` runs: flags from Settings, the start-up checks, then uvicorn.

Imported only by the `serve` command (sigmaflight/cli.py), so the users' side never loads
the server. Flags come from pydantic-settings' CLI source over `Settings`. A start-up mistake
(an invalid value, or one control/startup.py's preflight refuses: docs/operations.md, "Start-up",
lists each with its line) ends in one line on stderr naming the flag and exit status 2, before any
model loads. SIGHUP re-reads --token-file (both planes, every Ray worker); a file that is now
missing, unreadable or empty changes nothing (an error line; the old tokens stay). A SIGHUP while
the server starts is held until it is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import shlex
import signal
import ssl
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from pydantic_settings import CliSettingsSource, SettingsError
from sigmaflight.control.settings import Settings, TokenFileError, token_file_exposed
from sigmaflight.control.startup import StartupError, preflight, prepare_shm_dir

from sigmaflight.fields import bounds

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("sigmaflight")
ready_log = logging.getLogger("sigmaflight.ready")
ready_log.setLevel(logging.INFO)  # its one line passes any --log-level


SERVE_DESCRIPTION = (
    "Start both planes in one process: REST (uvicorn) on --port and Arrow Flight on --flight-port. "
    "Every flag is also an environment variable SIGMAFLIGHT_<NAME>; flags win. "
    "SIGHUP re-reads --token-file (a missing or empty file changes nothing)."
)


def _add_setting_argument(parser: argparse.ArgumentParser, *names: str, **kwargs: Any) -> argparse.Action:
    """pydantic-settings' `add_argument_method`: its flag for a Settings field, with our help line
    ("<description> [env SIGMAFLIGHT_<NAME>; default <value>; <its bounds>]") and an upper-case metavar."""
    field = Settings.model_fields.get(kwargs.get("dest", ""))
    if field is not None:
        name = kwargs["dest"]
        default = field.default
        shown = "none" if default is None else ("<secret>" if name == "token" else default)
        rules = [f"{op} {bound:g}" if isinstance(bound, float) else f"{op} {bound}"
                 for op, _, bound in bounds(field.metadata)]
        limits = "; " + " and ".join(rules) if rules else ""
        kwargs["help"] = f"{field.description} [env SIGMAFLIGHT_{name.upper()}; default {shown}{limits}]".replace("%", "%%")
        if "metavar" in kwargs and not str(kwargs["metavar"]).startswith("{"):  # {a,b}: a Literal's choices
            kwargs["metavar"] = name.upper()
    return parser.add_argument(*names, **kwargs)


def _cli_source(prog: str = "sigmaflight serve") -> CliSettingsSource[argparse.ArgumentParser]:
    """pydantic-settings' CLI source for Settings: one --kebab-case flag per field, bools as
    --flag/--no-flag, flags above SIGMAFLIGHT_<NAME> above the default."""
    parser = argparse.ArgumentParser(prog=prog, description=SERVE_DESCRIPTION, allow_abbrev=False)
    return CliSettingsSource(
        Settings,
        root_parser=parser,
        cli_prog_name=prog,
        cli_kebab_case=True,  # --flight-port
        cli_implicit_flags=True,  # --batch-invariant / --no-batch-invariant
        cli_hide_none_type=True,  # Optional fields show their NAME, not {str,null}
        add_argument_method=_add_setting_argument,
    )


def build_parser(prog: str = "sigmaflight serve") -> argparse.ArgumentParser:
    """The `sigmaflight serve` parser (pydantic-settings' CLI source's root parser)."""
    return _cli_source(prog).root_parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed flags (build_parser().parse_args), the environment and the defaults."""
    return Settings(_cli_settings_source=_cli_source()(parsed_args=args))


def settings_from_argv(argv: Sequence[str]) -> Settings:
    """Settings from command-line flags, the environment and the defaults (--help prints and exits 0;
    an unknown flag exits 2 with the usage)."""
    return Settings(_cli_settings_source=_cli_source()(args=list(argv)))


_EARLY_SIGHUPS: list[int] = []
"""SIGHUPs that arrived before the reload handler was installed (handled once the server is ready)."""


def _defer_sighup() -> None:
    """From the first moment of `serve` until the server is ready, a SIGHUP is noted instead of
    ending the process (its default action): an operator's `kill -HUP` during start-up, or a
    closing terminal, must not kill a server that is loading its models. A handler, not SIG_IGN:
    processes started from here (Ray) get the default disposition back at exec."""
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda signum, frame: _EARLY_SIGHUPS.append(signum))
        for name in ("sigmaflight.cli", "__main__"):  # the command's handler noted those before this one
            noted = getattr(sys.modules.get(name), "EARLY_SIGHUPS", None)  # (`python -m`: its __main__)
            if isinstance(noted, list):
                _EARLY_SIGHUPS.extend(noted)
                noted.clear()


def serve(settings: Settings) -> int:
    from sigmaflight.control import logs

    logs.configure(settings.log_level, settings.log_format)
    server = build_server(settings)
    try:
        server.run()
    except KeyboardInterrupt:
        # uvicorn raises the SIGINT it got again once the server has shut down, which asyncio.run
        # turns into KeyboardInterrupt: end by SIGINT all the same (130), without its traceback
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.raise_signal(signal.SIGINT)
    return 0 if server.started else 1


def _torch_threads() -> int:
    """torch's own count of intra-op threads (torch is loaded by now)."""
    import torch

    return torch.get_num_threads()


def build_server(settings: Settings) -> uvicorn.Server:
    """The uvicorn server of `sigmaflight serve` (the app, its Service built by the lifespan, the
    "sigmaflight ready" line), not yet running; the tests' in-process server runs it on a thread."""
    # transformers announces optional backends it lacks (torchvision) on import; not our users' concern.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import uvicorn
    from sigmaflight.control.http.app import create_app
    from sigmaflight.control.http.timeouts import header_timeout_protocol

    prepare_shm_dir(settings.shm_dir)
    if settings.token_file is not None and token_file_exposed(settings.token_file):
        log.warning(
            f"--token-file {settings.token_file} is readable by group or others; "
            f"run: chmod 600 {settings.token_file}",
            extra={"token_file": str(settings.token_file)},
        )
    app = create_app(settings)
    tls = {}
    if settings.tls_cert is not None and settings.tls_key is not None:
        tls = {"ssl_certfile": str(settings.tls_cert), "ssl_keyfile": str(settings.tls_key)}
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        lifespan="on",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=8,  # + the jobs' 15 s + Flight's 5 s: within the contract's 30 s
        # uvicorn has no header read timeout; what the protocol answers itself is counted as the app's answers are
        http=header_timeout_protocol(settings.header_timeout_s, app.state.metrics.http_responses),
        loop="auto",  # uvloop (the server extra installs it): a bare request costs half the CPU it does on asyncio's
        **tls,  # type: ignore[arg-type]
    )

    def reload_tokens() -> None:
        """SIGHUP: re-read --token-file on both planes (in a thread: it may wait on Ray workers)."""
        service = getattr(app.state, "service", None)
        if service is None:
            return
        try:
            n = service.reload_tokens(app.state.tokens)
        except (TokenFileError, ValueError) as exc:
            log.error("token reload failed; the tokens loaded before are still the ones accepted",
                      extra={"reason": str(exc)})
            return
        except Exception:
            log.exception("token reload failed; the tokens loaded before may still be accepted by some workers")
            return
        log.info("tokens reloaded", extra={"token_file": str(settings.token_file), "tokens": n})
        if settings.token_file is not None and token_file_exposed(settings.token_file):
            log.warning(f"--token-file {settings.token_file} is readable by group or others; "
                        f"run: chmod 600 {settings.token_file}", extra={"token_file": str(settings.token_file)})

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # SIGTERM/SIGINT: refuse from this moment, not once uvicorn has waited out the requests
            # it has (a POST finished meanwhile was accepted, then failed by the shutdown)
            service = getattr(app.state, "service", None)
            if service is not None:
                service.draining()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            # uvicorn waits for open requests (up to timeout_graceful_shutdown) before the lifespan
            # stops the service. The rollouts are ended first, so that a status read held until its
            # rollout ends (Client.wait) answers with the failure, not `running` and then a closed
            # port; a read still held after that (a step past the stop's wait) answers now.
            service = getattr(app.state, "service", None)
            if service is not None:
                await asyncio.to_thread(service.end_rollouts)
            app.state.held_reads.close()
            await super().shutdown(sockets)
            if self.force_exit and service is not None:
                # a second signal (Ctrl-C after SIGTERM) makes uvicorn skip the lifespan's shutdown:
                # stop the service here, or Flight, the journal and the backend (a Ray instance this
                # server started) are left as they are
                await asyncio.to_thread(service.stop)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.should_exit:
                return
            # On the main thread the process is this server's own; on another (the tests' in-process
            # server) it is not: neither its heap nor its signals are the server's to take.
            own_process = threading.current_thread() is threading.main_thread()
            if own_process:
                # The models and libraries loaded by now are some 400k objects that live as long as
                # the process: out of the collector's sight, a full collection costs microseconds,
                # not the 100-200 ms pause it otherwise takes every so often in the middle of a batch.
                gc.collect()
                gc.freeze()
            if hasattr(signal, "SIGHUP") and own_process:  # signals reach only the main thread's loop
                def on_sighup() -> None:
                    threading.Thread(target=reload_tokens, name="sigmaflight-sighup").start()

                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_sighup)
                if _EARLY_SIGHUPS:  # received while starting: re-read the tokens now, once
                    log.info("SIGHUP received while starting; re-reading --token-file now",
                             extra={"signals": len(_EARLY_SIGHUPS)})
                    _EARLY_SIGHUPS.clear()
                    on_sighup()
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else settings.port
            scheme = "https" if tls else "http"
            service = app.state.service if hasattr(app.state, "service") else None
            flight = getattr(service, "flight", None)
            rest_url = f"{scheme}://{settings.host}:{port}"
            token = ' --token "$SIGMAFLIGHT_TOKEN"' if settings.tokens() else ""
            if tls and settings.tls_cert is not None and _self_signed(settings.tls_cert):
                token += f" --ca-file {shlex.quote(str(settings.tls_cert))}"  # nothing else vouches for it
            # Always shown, whatever --log-level, and at info (an alert on error lines must not fire
            # on a healthy start): tools wait for this line. It says where the API page is and gives
            # one command to try.
            ready_log.info(
                "sigmaflight ready",
                extra={
                    "rest_url": rest_url,
                    "flight_url": flight.locations[0] if flight else None,
                    "model": settings.model,
                    "auth": bool(settings.tokens()),
                    "data_dir": str(settings.data_dir) if settings.data_dir else None,
                    "torch_threads": settings.torch_threads or _torch_threads(),
                    "docs": f"{rest_url}/docs",
                    "try": f"sigmaflight submit --url {rest_url}{token} -p 'a red cube' --steps 4 --wait",
                },
            )

    return Server(config)


def _self_signed(cert: Path) -> bool:
    """Whether the PEM certificate names itself as its issuer (a client trusts it only as its own CA).
    Read with the ssl module's certificate decoder (CPython's, private; False where it is missing)."""
    try:
        decoded = ssl._ssl._test_decode_cert(str(cert))  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError, ssl.SSLError):
        return False
    return bool(decoded.get("subject")) and decoded.get("subject") == decoded.get("issuer")


def invalid_setting_lines(exc: ValidationError) -> list[str]:
    """One line per bad setting: "--flag (SIGMAFLIGHT_FLAG) VALUE: why"."""
    lines = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else ""
        flag = f"--{name.replace('_', '-')} (SIGMAFLIGHT_{name.upper()})" if name else "settings"
        value = "" if name == "token" or "input" not in err else f" {err['input']!r}"
        why = err["msg"].removeprefix("Value error, ")  # a validator's own reason, without pydantic's prefix
        lines.append(f"{flag}{value}: {why}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """`sigmaflight serve [flags]`: 2 on a startup mistake, 1 if the server did not start. Stopped by
    SIGTERM or SIGINT, the process ends by that signal once shut down (uvicorn raises it again: 143 or
    130 in a shell), which supervisors read as a clean stop."""
    _defer_sighup()
    try:
        settings = settings_from_argv(sys.argv[1:] if argv is None else argv)
    except ValidationError as exc:  # name the flag and the reason, one line each
        for line in invalid_setting_lines(exc):
            print(f"sigmaflight serve: {line}", file=sys.stderr)
        return 2
    except SettingsError as exc:  # a value the CLI source cannot parse
        print(f"sigmaflight serve: {exc}", file=sys.stderr)
        return 2
    try:
        preflight(settings)
    except StartupError as exc:
        print(f"sigmaflight serve: {exc}", file=sys.stderr)
        return 2
    return serve(settings)
