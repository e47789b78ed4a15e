"""``edgekv serve``: resolve the deployed config, model and KV folders, then run the app under uvicorn.

uvicorn owns the signals: on SIGTERM or SIGINT it stops accepting, lets requests in flight finish (up to
``shutdown_grace_s``), then the app's lifespan stops the scheduler (what is left ends with an error event)
and closes the engine; each sequence's KV files are removed as its row is released.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("edgekv.serve")

API_KEY_ENV = "EDGEKV_API_KEY"


@dataclass
class ServeOptions:
    model: str | None = None
    config: str | None = None
    kv_paths: list[str] | None = None
    policy: str = "kvswap"
    device: str | None = None  # default: the deployed config's, else $EDGEKV_DEVICE or the GPU (runtime/devices.py)
    dtype: str | None = None  # default: the deployed config's on its device, else the device's
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None  # visible in the process list: api_key_file or $EDGEKV_API_KEY are not
    api_key_file: str | None = None
    max_queue: int = 64
    max_body_mib: float = 4.0
    context_store: bool = True
    chunk_tokens: int = 256
    store_max_mib: float = 1024.0
    served_model_name: list[str] | None = None  # the first is the id /v1/models lists (as vLLM's flag)
    shutdown_grace_s: float = 30.0
    log_level: str = "info"
    max_connections: int = 128  # open connections (and requests in flight) beyond this get 503
    keep_alive_s: int = 5  # an idle keep-alive connection is closed after this
    header_timeout_s: float = 10.0  # a request whose headers take longer: its connection is closed
    body_timeout_s: float = 60.0  # a request whose body takes longer gets 408
    allowed_hosts: list[str] | None = None  # Host names answered; default: the loopback names on a loopback --host
    openapi: bool = False  # serve /openapi.json behind the key


def deployed_config(platform: str, root: str | Path = "deploy") -> Path:
    """``deploy/<platform>/config.json`` (the caller resolves ``auto`` to the platform this machine is)."""
    path = Path(root) / platform / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no deployed config {path}: run `make deploy PLATFORM={platform}` first, or pass "
                                "--config FILE or --model M")
    return path


def short_id(model: str) -> str:
    """The id a model is served under by default: a registry name as given (``smollm2``), else the folder's or
    file's name (``/data/models/smollm2-hf`` -> ``smollm2-hf``): a server never lists its paths."""
    path = Path(model)
    if os.sep not in model and not path.exists():
        return model
    return path.name.removesuffix(".gguf") or model


def resolve(options: ServeOptions) -> tuple[str, list[str] | None, tuple[str, ...]]:
    """(model, KV folders, served names): --model, else the deployed config's model; --kv-path(s), else the
    config's kv_paths; names: --served-model-name (all of them), else the model's short id and the model as
    given.  The first name is the one /v1/models lists; a request naming another model gets 404."""
    meta = {}
    if options.config:
        try:
            meta = json.loads(Path(options.config).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--config {options.config}: cannot read it ({exc}); point to deploy/<platform>/config.json") from exc
    model = options.model or meta.get("model")
    if not model:
        raise ValueError("which model? pass --model (a name such as fixture or smollm2, a folder or a .gguf file), "
                         "or --config with a deployed config")
    kv_paths = options.kv_paths or meta.get("kv_paths") or ([meta["kv_path"]] if meta.get("kv_path") else None)
    names = options.served_model_name or [short_id(str(options.model or model)), str(options.model or model)]
    if any(not n.strip() for n in names):
        raise ValueError("--served-model-name: a name is empty; give each name the clients will send as 'model'")
    return str(model), kv_paths, tuple(dict.fromkeys(names))


def resolve_api_key(options: ServeOptions) -> str | None:
    """The key from --api-key-file (its first line), --api-key, or $EDGEKV_API_KEY, checked (serve.app
    check_api_key); None when none is given: the server then takes requests without a key."""
    if options.api_key_file and options.api_key is not None:
        raise ValueError("--api-key and --api-key-file both given: pass one (the file keeps the key out of the "
                         "process list)")
    if options.api_key_file:
        source = f"--api-key-file {options.api_key_file}"
        try:
            lines = Path(options.api_key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{source}: cannot read it ({exc}); point to a text file with the key on its first "
                             "line") from exc
        if not lines:
            raise ValueError(f"{source}: the file is empty; write the key on its first line")
        key = lines[0]
    elif options.api_key is not None:
        key, source = options.api_key, "--api-key"
    elif API_KEY_ENV in os.environ:
        key, source = os.environ[API_KEY_ENV], API_KEY_ENV
    else:
        return None
    from .app import check_api_key

    try:
        check_api_key(key)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    return key


def allowed_hosts(options: ServeOptions) -> tuple[str, ...]:
    """Host names answered: --allowed-hosts, else the loopback names when listening on loopback (a page whose DNS
    name is rebound to 127.0.0.1 is refused), else any (the API key guards a server others reach)."""
    from .limits import LOOPBACK_NAMES

    if options.allowed_hosts:
        return tuple(options.allowed_hosts)
    return LOOPBACK_NAMES if options.host in LOOPBACK_NAMES else ("*",)


def load_engine(options: ServeOptions, model: str, kv_paths: list[str]):
    from edgekv.runtime import Engine

    engine = Engine.from_pretrained(model, kv_path=kv_paths, config=options.config, policy=options.policy,
                                    device=options.device, dtype=options.dtype)
    if options.context_store:
        engine.open_context_store(Path(kv_paths[0]) / "contexts", chunk_tokens=options.chunk_tokens,
                                  max_bytes=int(options.store_max_mib * 2**20))
    return engine


STREAM_FLUSH_S = 5.0  # after the grace, what streams ended by it get to send their error event and [DONE]


def uvicorn_config(app, options: ServeOptions):
    """uvicorn's settings for the app: the header deadline (serve.limits), the connection cap, the keep-alive
    time and the shutdown grace."""
    import uvicorn

    from .limits import header_deadline_protocol

    return uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level, lifespan="on",
                          http=header_deadline_protocol(options.header_timeout_s),
                          limit_concurrency=options.max_connections, timeout_keep_alive=options.keep_alive_s,
                          timeout_graceful_shutdown=options.shutdown_grace_s + STREAM_FLUSH_S)


def _make_server(config, on_exit):
    """uvicorn's Server that tells ``on_exit`` when a signal starts the shutdown (uvicorn is imported here, not at
    module level: ``make deploy`` imports this module for the unit file only)."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, telling the scheduler when a signal starts the shutdown."""

        def __init__(self, config, on_exit):
            super().__init__(config)
            self.on_exit = on_exit

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                self.on_exit()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn raises the caught signal again once shut down (a SIGINT then ends in a KeyboardInterrupt
            traceback); after a graceful shutdown the command exits 0 instead."""
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

    return Server(config, on_exit)


def service_unit(platform: str, config: str | Path, workdir: str | Path, python: str, host: str = "127.0.0.1",
                 port: int = 8080, grace_s: float = ServeOptions.shutdown_grace_s) -> str:
    """A systemd unit that serves a deployed config (``deploy/<platform>/edgekv.service``): started at boot,
    restarted on failure, stopped with SIGTERM and the grace the server gives requests in flight.  The API key,
    if any, comes from /etc/edgekv/env (EDGEKV_API_KEY=...), never from the unit file."""
    return f"""[Unit]
Description=edgekv OpenAI-compatible server ({platform})
After=network-online.target local-fs.target
Wants=network-online.target

[Service]
Type=simple
WorkingDirectory={workdir}
ExecStart={python} -m edgekv.cli serve --config {config} --host {host} --port {port}
EnvironmentFile=-/etc/edgekv/env
Environment=PYTHONUNBUFFERED=1
KillSignal=SIGTERM
TimeoutStopSec={int(grace_s + STREAM_FLUSH_S + 15)}
Restart=on-failure
RestartSec=5

[Install]
WantedBy=multi-user.target
"""


def settings_of(options: ServeOptions, names: tuple[str, ...]):
    from .app import ServeSettings

    key = resolve_api_key(options)
    if options.host not in ("127.0.0.1", "localhost", "::1") and key is None:
        log.warning("listening on %s without an API key: anyone who reaches this port can use the model; pass "
                    "--api-key-file or set %s", options.host, API_KEY_ENV)
    elif options.api_key is not None:
        log.warning("--api-key is visible in the process list (ps): prefer --api-key-file or %s", API_KEY_ENV)
    return ServeSettings(names, key, options.max_queue, int(options.max_body_mib * 2**20), options.context_store,
                         body_timeout_s=options.body_timeout_s, allowed_hosts=allowed_hosts(options),
                         openapi=options.openapi)


def run(options: ServeOptions) -> int:
    """Serve until SIGTERM/SIGINT; 1 when the model failed to load (named in the log)."""
    from .app import ServerState, create_app

    model, kv_paths, names = resolve(options)
    settings = settings_of(options, names)
    with contextlib.ExitStack() as stack:
        if kv_paths is None:  # no KV disk named: a scratch folder, removed at exit
            kv_paths = [stack.enter_context(tempfile.TemporaryDirectory(prefix="edgekv-serve-"))]
        state = ServerState(settings, lambda: load_engine(options, model, kv_paths))
        server = _make_server(uvicorn_config(create_app(state), options),
                              lambda: state.begin_shutdown(options.shutdown_grace_s))

        def failed(exc: BaseException) -> None:
            server.should_exit = True

        state.on_load_error = failed
        log.info("edgekv serve: %s on http://%s:%d (KV under %s)", names[0], options.host, options.port,
                 ", ".join(map(str, kv_paths)))
        server.run()
    if state.error is not None:
        log.error("edgekv serve: the model did not load: %s", state.error)
        return 1
    return 0
