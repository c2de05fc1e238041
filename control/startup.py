"""What `sigmaflight serve` checks before it loads anything: each mistake is one line naming the flag.

`preflight(settings)` raises `StartupError` (serve.py prints "sigmaflight serve: <message>" and exits
2) for, in this order, the cheap checks first:

- a --token-file that is missing, unreadable or holds no token, or a --token (SIGMAFLIGHT_TOKEN) that
  holds none, only commas and spaces (auth would silently be off);
- --tls-cert without --tls-key or the reverse (plain http would be served), a file of the two
  that does not exist or cannot be read, or a pair that is not a PEM certificate and its key;
- a --host that is not an address of this machine (bound here with port 0 too), or that cannot be
  put in a Flight location (an IPv6 address);
- --port / --flight-port already in use on --host (another `sigmaflight serve`, say), or the same
  port for both planes: both binds are tried here, before the model loads (the real binds come
  later: REST after the model loads, Flight while it loads);
- a --shm-dir that is a dangling symbolic link, not a directory, not writable, in use by another
  live server (its lock is held), or missing with a missing parent (only the last component is
  created, by `prepare_shm_dir`, mode 0700; never parents);
- a --data-dir that is a dangling symbolic link, not a directory, not writable, or missing with a
  missing parent (only the last component is created; never parents), or one another live server
  uses (its lock is held: control/datadir_lock.py);
- a --weights-file-dir that does not exist or is not a directory;
- a --device torch cannot parse, or (--backend local) one this machine does not have: CUDA (or
  MPS, XPU, ...) that torch cannot use here, or a device index past the last. Torch is imported
  for that only when --device is not cpu;
- --backend ray where Ray cannot be imported (the `ray` extra), or with a hub --model (Ray workers
  load the built-ins and --model-dir only), or with no cluster to join: --ray-address auto where
  Ray finds none on this machine, or an address where nothing listens;
- a --model-dir that does not exist or holds no pipeline, or a pipeline there whose scheduler is not
  flow-match;
- a hub --model (org/name[@revision]) whose id huggingface_hub refuses or whose revision is no ref
  name (it would name a path), whose cache entry is broken, that is neither complete in the Hugging
  Face cache nor on the hub (asked once, no retries; HF_HUB_OFFLINE=1: the cache only), is not a
  diffusers pipeline, or is not flow-match;
- an unknown --model (the line lists the known ones).

Last, once everything else passed, --data-dir's last component is made if missing and its lock is
taken, held until the server's job journal closes (or the process ends): nothing in the directory
is read or changed before it, and a refused start creates nothing.
"""

from __future__ import annotations

import errno
import fcntl
import importlib
import logging
import os
import socket
from pathlib import Path

from sigmaflight.control.settings import Settings, TokenError, unreadable

log = logging.getLogger("sigmaflight")

__all__ = ["StartupError", "preflight", "prepare_shm_dir"]


class StartupError(Exception):
    """A setting the server cannot start with; its message is the one line the user sees."""


def preflight(settings: Settings) -> None:
    """Refuse settings the server cannot start with, naming the flag and the reason (StartupError)."""
    try:
        settings.tokens()  # a --token-file that is missing, unreadable or empty, a --token of none: fail closed
    except TokenError as exc:
        raise StartupError(str(exc)) from None
    check_tls(settings.tls_cert, settings.tls_key)
    check_ports(settings.host, settings.port, settings.flight_port)
    if settings.shm_dir is not None:
        check_shm_dir(settings.shm_dir)
    if settings.data_dir is not None:
        check_data_dir(settings.data_dir)
    if settings.weights_file_dir is not None:
        check_weights_file_dir(settings.weights_file_dir)
    check_device(settings.device, here=settings.backend == "local")  # Ray workers' devices are their nodes'
    if settings.backend == "ray":
        from sigmaflight.pipeline.sources import parse_hub_id

        if parse_hub_id(settings.model) is not None:
            raise StartupError(f"--model {settings.model}: a hub model is served by --backend local only "
                               "(Ray workers load the built-ins and --model-dir)")
        check_ray(settings.ray_address)
    check_models(settings)
    if settings.data_dir is not None:
        lock_data_dir(settings.data_dir)
        check_data_dir_contents(settings.data_dir)


# ---------------------------------------------------------------------------------------- ports

def _bind_error(host: str, port: int) -> OSError | None:
    """Why `host:port` cannot be bound now (None when it can). SO_REUSEADDR as uvicorn binds, so a
    port left in TIME_WAIT is not "in use"; a listening socket is. A host that is no address or
    name at all (a space, a label over 63 characters, a NUL) is a `socket.gaierror` too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc
        except (UnicodeError, ValueError, TypeError) as exc:  # cannot even be encoded (idna), or holds a NUL
            return socket.gaierror(socket.EAI_NONAME, str(exc))
    return None


def check_flight_host(host: str) -> None:
    """--host can be written in a Flight location, grpc+tcp://HOST:PORT (an IPv6 address cannot)."""
    import pyarrow as pa
    import pyarrow.flight as flight

    if not host:
        raise StartupError("--host '': empty (0.0.0.0 binds every IPv4 address of this machine)")
    try:
        flight.Location(f"grpc+tcp://{host}:0")
    except (pa.ArrowException, ValueError):
        raise StartupError(f"--host {host}: cannot be put in a Flight location (grpc+tcp://{host}:PORT does not "
                           "parse; IPv6 addresses are not supported: use an IPv4 address or a host name)") from None


def check_ports(host: str, port: int, flight_port: int) -> None:
    """--host is an address of this machine and both planes' ports can be bound on it. A port of 0
    (any free one) is bound too: it checks the host."""
    if port and port == flight_port:
        raise StartupError(f"--port and --flight-port are both {port}: the REST and Flight planes need a port each")
    problems = []
    for flag, p in (("--port", port), ("--flight-port", flight_port)):
        exc = _bind_error(host, p)
        if exc is None:
            continue
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            raise StartupError(f"--host {host}: not an address of this machine ({exc.strerror or exc})")
        if exc.errno == errno.EADDRINUSE:
            problems.append(f"{flag} {p}: {host}:{p} is already in use")
        elif exc.errno == errno.EACCES:
            problems.append(f"{flag} {p}: binding {host}:{p} is not permitted (ports below 1024 need privileges)")
        else:
            problems.append(f"{flag} {p}: cannot bind {host}:{p} ({exc.strerror or exc})")
    if problems:
        raise StartupError("; ".join(problems) + " (is another sigmaflight serve running? choose other ports, "
                           "or 0 for free ones)")
    check_flight_host(host)


# ---------------------------------------------------------------------------------------- TLS

class _Encrypted(Exception):
    pass


def _no_passphrase() -> bytes:
    """The passphrase callback of a key that asks for one: refused, never read from the terminal."""
    raise _Encrypted


def check_tls(cert: Path | None, key: Path | None) -> None:
    """Both or neither of --tls-cert and --tls-key, each a readable file, together a PEM certificate
    and its private key (loaded as uvicorn will load them)."""
    import ssl

    if cert is None and key is None:
        return
    if cert is None or key is None:
        given, path, missing = ("--tls-cert", cert, "--tls-key") if key is None else ("--tls-key", key, "--tls-cert")
        raise StartupError(f"{given} {path}: needs {missing} too (without both the server would serve plain "
                           "http and grpc+tcp)")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise StartupError(unreadable(flag, path, exc)) from None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=_no_passphrase)
    except _Encrypted:  # else OpenSSL asks on the terminal (uvicorn again, and Flight cannot load it)
        raise StartupError(f"--tls-key {key}: the key is encrypted (it asks for a passphrase); give the unencrypted "
                           f"PEM key (openssl pkey -in {key} -out key.pem), readable by this user only") from None
    except (ssl.SSLError, OSError) as exc:
        raise StartupError(f"--tls-cert {cert} --tls-key {key}: not a PEM certificate and its private key "
                           f"({exc.reason if isinstance(exc, ssl.SSLError) and exc.reason else exc})") from None


# ---------------------------------------------------------------------------------------- --shm-dir

def _lock_held(lock: Path) -> bool:
    """Whether a live process holds the flock of a shm dir's lock file (dataplane/shm.py takes it)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def check_dir(flag: str, path: Path, example: str) -> bool:
    """A usable directory for `flag` (--shm-dir, --data-dir): an existing one this user can write,
    or a missing last component whose parent is a writable directory (the caller makes it; never
    parents: a typo must not make directories on an ordinary disk). True when it exists."""
    if path.is_symlink() and not path.exists():
        raise StartupError(f"{flag} {path}: a symbolic link to {os.readlink(path)}, which does not exist")
    if not path.exists():
        if not path.parent.is_dir():
            what = "is not a directory" if path.parent.exists() else "does not exist"
            raise StartupError(f"{flag} {path}: its parent {path.parent} {what} (only the last "
                               f"component is created, e.g. {flag} {example})")
        if not os.access(path.parent, os.W_OK | os.X_OK):
            raise StartupError(f"{flag} {path}: cannot be created: {path.parent} is not writable by this user")
        return False
    if not path.is_dir():
        raise StartupError(f"{flag} {path}: not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise StartupError(f"{flag} {path}: not writable by this user")
    return True


def check_shm_dir(path: Path) -> None:
    """A usable --shm-dir (`check_dir`; a missing one is made by `prepare_shm_dir`) no live server uses."""
    from sigmaflight.dataplane.shm import LOCK_NAME, private_dir_name

    if not check_dir("--shm-dir", path, "/dev/shm/sigmaflight"):
        return
    lock = path / private_dir_name() / LOCK_NAME  # the store locks its private subdirectory
    if _lock_held(lock):
        raise StartupError(f"--shm-dir {path}: in use by another live server (it holds {lock})")


def prepare_shm_dir(path: Path | None) -> None:
    """Create a missing --shm-dir (its last component only, mode 0700: the parent was checked) and log it."""
    if path is None or path.exists():
        return
    path.mkdir(mode=0o700)
    log.info("created --shm-dir", extra={"shm_dir": str(path), "mode": "0700"})


# ---------------------------------------------------------------------------------------- --data-dir

def check_data_dir(path: Path) -> None:
    """A usable --data-dir (`check_dir`); whether another live server uses it is `lock_data_dir`'s."""
    check_dir("--data-dir", path, "/var/lib/sigmaflight")


def lock_data_dir(path: Path) -> None:
    """Make a missing --data-dir (its last component: the parent was checked) and take its lock for
    this server's life (control/datadir_lock.py): refused when another live server holds it."""
    from sigmaflight.control.datadir_lock import LOCK_NAME, DataDirInUse, take

    try:
        path.mkdir(exist_ok=True)
    except OSError as exc:
        raise StartupError(f"--data-dir {path}: cannot be created ({exc.strerror or exc})") from None
    try:
        take(path)
    except DataDirInUse as exc:
        raise StartupError(f"--data-dir {path}: {exc}; one data dir serves one server at a time") from None
    except OSError as exc:
        raise StartupError(f"--data-dir {path}: cannot open its lock file {path / LOCK_NAME} "
                           f"({exc.strerror or exc})") from None


def check_data_dir_contents(path: Path) -> None:
    """What a previous server left in --data-dir is what this one can read: its subdirectories are
    directories, and every row of its journal reads (else the restart scan would end start-up in a
    traceback, and no trajectory would be served)."""
    from sigmaflight.control.jobs.journal import JOURNAL_NAME, JournalUnreadable, check_journal

    for name in ("trajectories", "streams"):
        sub = path / name
        if sub.exists() and not sub.is_dir():
            raise StartupError(f"--data-dir {path}: {sub} is not a directory (the server keeps its {name} there); "
                               "move it away")
        for file in sorted(sub.glob("*.arrow")) if sub.is_dir() else ():
            try:  # one the scan cannot open would be taken for corrupt and set aside for good
                os.close(os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC))
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    continue  # a symbolic link: the scan's own checks refuse it
                raise StartupError(f"--data-dir {path}: cannot read {file} ({exc.strerror}); let this server's "
                                   "user read it, or move it away") from None
    try:
        check_journal(path / JOURNAL_NAME)
    except JournalUnreadable as exc:
        raise StartupError(f"--data-dir {path}: its job journal cannot be read: {exc}. Repair it, or move "
                           f"{JOURNAL_NAME} aside to start without its records (the trajectories it named are then "
                           "set aside as <id>.arrow.orphan, never deleted)") from None


def check_weights_file_dir(path: Path) -> None:
    """--weights-file-dir names a directory this user can read (pushes by path are opened in it)."""
    if not path.is_dir():
        raise StartupError(f"--weights-file-dir {path}: {'not a directory' if path.exists() else 'no such directory'}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise StartupError(f"--weights-file-dir {path}: not readable by this user")


# ---------------------------------------------------------------------------------------- --device

def check_device(device: str, *, here: bool) -> None:
    """--device is one torch parses and, where the models run in this process (`here`), one this
    machine has. cpu imports nothing; any other device imports torch (a second or two)."""
    if device == "cpu":
        return
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StartupError(f"--device {device}: not a torch device ({reason}); e.g. cpu, cuda, cuda:1") from None
    if d.type == "meta":
        raise StartupError(f"--device {device}: holds no data (tensors on it have a shape only); e.g. cpu, cuda, cuda:1")
    if not here or d.type == "cpu":
        return
    kind = d.type.upper()
    backend = torch.backends.mps if d.type == "mps" else getattr(torch, d.type, None)
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and not is_available():
        why = "not available"
        if d.type == "cuda":
            built = torch.version.cuda is not None or torch.version.hip is not None
            why = "no CUDA device is visible" if built else f"torch {torch.__version__} is built without CUDA"
        raise StartupError(f"--device {device}: torch has no {kind} here ({why}); use --device cpu, or a torch "
                           "built for this machine's accelerator")
    device_count = getattr(backend, "device_count", None)
    if d.index is not None and callable(device_count) and d.index >= (n := int(device_count())):
        raise StartupError(f"--device {device}: this machine has {n} {kind} device{'s' if n != 1 else ''} "
                           f"({d.type}:0 to {d.type}:{n - 1})")


# ---------------------------------------------------------------------------------------- --backend ray

_START_A_CLUSTER = ("start one with `ray start --head`, name one with --ray-address HOST:PORT (or RAY_ADDRESS), "
                    "or start one in this process with --ray-address local")


def check_ray(address: str) -> None:
    """Ray can be imported and, unless --ray-address local starts a cluster here, there is one to
    join: for auto, the one Ray itself finds (RAY_ADDRESS, the last `ray start`, a running GCS), as
    ray.init would; and something listens at the address (one TCP connect, 5 s at most)."""
    try:
        importlib.import_module("ray")
    except ImportError as exc:
        raise StartupError(f"--backend ray: Ray cannot be imported here ({exc}); install the ray extra: "
                           "pip install 'sigmaflight[ray]'") from None
    if address == "local":
        return
    target = address
    if address == "auto":
        try:
            from ray._private.services import get_ray_address_from_environment
        except ImportError:  # another Ray's layout: ray.init will say
            return
        try:
            target = str(get_ray_address_from_environment("auto", None))
        except ConnectionError:
            raise StartupError(f"--backend ray --ray-address auto: no running Ray cluster found on this machine; "
                               f"{_START_A_CLUSTER}") from None
        if target == "local":
            return
    host, _, port = target.removeprefix("ray://").rpartition(":")
    if not target.startswith("ray://") and ("://" in target or not host or not port.isdigit()):
        raise StartupError(f"--backend ray --ray-address {address}: not an address Ray joins; give auto, local, "
                           "host:port of a cluster's head (`ray start --head` prints it) or ray://host:port")
    if not host or not port.isdigit():  # ray://host without a port: ray.init will say
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as exc:
        named = address if target == address else f"{address} ({target})"
        raise StartupError(f"--backend ray --ray-address {named}: no Ray cluster answers at {host}:{port} "
                           f"({exc.strerror or exc}); {_START_A_CLUSTER}") from None


# ---------------------------------------------------------------------------------------- models

def check_models(settings: Settings) -> None:
    """--model-dir holds loadable flow-match pipelines, and --model is one the server can serve.
    Imports no torch (pipeline/sources.py and the built-ins' table): a mistake is refused in a
    fraction of a second; only check_flow_match imports diffusers, for a scheduler's class."""
    from sigmaflight.pipeline.builtins import BUILTINS
    from sigmaflight.pipeline.sources import (
        ModelLoadError,
        check_flow_match,
        check_hub_model,
        local_model_dirs,
        parse_hub_id,
    )

    local: list[str] = []
    if settings.model_dir is not None:
        root = settings.model_dir
        if not root.is_dir():
            raise StartupError(f"--model-dir {root}: {'not a directory' if root.exists() else 'no such directory'}")
        dirs = local_model_dirs(root)
        if not dirs:
            raise StartupError(f"--model-dir {root}: no pipeline in it (no subdirectory holds a model_index.json)")
        for sub in dirs:
            if not (sub / "scheduler" / "scheduler_config.json").is_file():
                raise StartupError(
                    f"--model-dir {root}: {sub.name}/scheduler/scheduler_config.json is missing "
                    "(save the whole pipeline with save_pretrained)"
                )
            try:
                check_flow_match(str(sub))  # reads model_index.json only: a DDIM/PNDM/... pipeline cannot run
            except ModelLoadError as exc:
                raise StartupError(f"--model-dir {root}: {exc}") from None
        local = [sub.name for sub in dirs]
    if parse_hub_id(settings.model) is not None:
        try:
            check_hub_model(settings.model)  # model_index.json: in the cache, complete (or on the hub), flow-match
        except ModelLoadError as exc:
            raise StartupError(f"--model {exc}") from None
        return
    known = sorted(set(BUILTINS) | set(local))
    if settings.model not in known:
        raise StartupError(f"--model {settings.model!r}: unknown model; known: {', '.join(known)} "
                           "(or a Hugging Face hub id, org/name[@revision])")
