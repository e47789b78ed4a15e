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
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_queue: int = 64
    max_body_mib: float = 4.0
    context_store: bool = True
    chunk_tokens: int = 256
    store_max_mib: float = 1024.0
    served_model_name: str | None = None
    shutdown_grace_s: float = 30.0
    log_level: str = "info"


def deployed_config(platform: str, root: str | Path = "deploy") -> Path:
    """``deploy/<platform>/config.json`` (``auto``: the platform this machine is detected as)."""
    if platform in ("", "auto"):
        from edgekv.platforms.detect import detect_platform

        platform = detect_platform()
    path = Path(root) / platform / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no deployed config {path}: run `make deploy PLATFORM={platform}` first, or pass "
                                "--config FILE or --model M")
    return path


def resolve(options: ServeOptions) -> tuple[str, list[str] | None, tuple[str, ...]]:
    """(model, KV folders, served names): --model, else the deployed config's model; --kv-path(s), else the
    config's kv_paths; names: --served-model-name, the model as given, its folder name."""
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
    names = [options.served_model_name, options.model or Path(str(model)).name, Path(str(model)).name, str(model)]
    return str(model), kv_paths, tuple(dict.fromkeys(n for n in names if n))


def load_engine(options: ServeOptions, model: str, kv_paths: list[str]):
    from edgekv.runtime import Engine

    engine = Engine.from_pretrained(model, kv_offload_path=kv_paths, config=options.config, policy=options.policy)
    if options.context_store:
        engine.open_context_store(Path(kv_paths[0]) / "contexts", chunk_tokens=options.chunk_tokens,
                                  max_bytes=int(options.store_max_mib * 2**20))
    return engine


STREAM_FLUSH_S = 5.0  # after the grace, what streams ended by it get to send their error event and [DONE]


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


def run(options: ServeOptions) -> int:
    """Serve until SIGTERM/SIGINT; 1 when the model failed to load (named in the log)."""
    import uvicorn

    from .app import ServerState, ServeSettings, create_app

    model, kv_paths, names = resolve(options)
    api_key = options.api_key or os.environ.get(API_KEY_ENV) or None
    if options.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("listening on %s without an API key: anyone who reaches this port can use the model; pass "
                    "--api-key or set %s", options.host, API_KEY_ENV)
    settings = ServeSettings(names, api_key, options.max_queue, int(options.max_body_mib * 2**20), options.context_store)
    with contextlib.ExitStack() as stack:
        if kv_paths is None:  # no KV disk named: a scratch folder, removed at exit
            kv_paths = [stack.enter_context(tempfile.TemporaryDirectory(prefix="edgekv-serve-"))]
        state = ServerState(settings, lambda: load_engine(options, model, kv_paths))
        config = uvicorn.Config(create_app(state), host=options.host, port=options.port, log_level=options.log_level,
                                timeout_graceful_shutdown=options.shutdown_grace_s + STREAM_FLUSH_S, lifespan="on")
        server = _make_server(config, lambda: state.begin_shutdown(options.shutdown_grace_s))

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
