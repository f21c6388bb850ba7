"""`fastmamba serve`: the engine in its own process (or Ray Serve replicas), the HTTP app in
this one under uvicorn (its connections bounded: connections.py), and a drained shutdown:
SIGTERM or Ctrl-C stop new requests, let running ones finish for --shutdown-timeout
seconds (a second signal cuts that short), end the rest with a 503, and end the command
with exit code 0."""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import sys
import threading
import time
from pathlib import Path

from fastmamba.engine.client import EngineClient
from fastmamba.io.folders import checkpoint_folder, default_model_dir
from fastmamba.serve.options import ServeOptions

LAST_ANSWERS_S = 2  # after a second signal ended the open requests, the time their answers have to go out


def serve(options: ServeOptions) -> int:
    """The command's `serve`: a ValueError naming the culprit (a flag, the model folder)
    before anything slow starts, else serves until stopped."""
    if any(importlib.util.find_spec(m) is None for m in ("fastapi", "uvicorn", "zmq")):
        raise ValueError("serve needs the server packages: pip install 'fastmamba[serve]'")
    if options.ray:
        return serve_replicas(options)
    import uvicorn

    from fastmamba.engine.process import ProcessClient
    from fastmamba.serve.app import folder_app
    from fastmamba.serve.connections import MAX_HEADER_BYTES, connection_limit, guarded, http_protocol, open_file_limit

    sock = listen(options.host, options.port)
    folder = model_folder(options)
    check_chat_template(options, folder)
    graphs = ", capturing CUDA graphs" if options.engine.device != "cpu" else ""
    print(f"fastmamba: starting the engine (loading {folder}{graphs}) ...", file=sys.stderr, flush=True)
    engine = ProcessClient(options.engine, folder, max_queue=options.max_queue, silence_s=options.engine_timeout)
    try:
        app = folder_app(engine, folder, options)
        connections = connection_limit(open_file_limit())
        config = uvicorn.Config(
            app, log_level="warning", timeout_graceful_shutdown=options.shutdown_timeout + 5,
            http=guarded(http_protocol(), connections, options.client_timeout), timeout_keep_alive=5,
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
            # (uvicorn's own check, at a request's headers, counts its running requests too:
            # one above, it acts only on requests that outlive their connections)
            limit_concurrency=connections + 1)
        info = engine.info
        print(f"fastmamba: serving {options.model_name} on http://{options.host}:{options.port} ({info.device}, "
              f"{info.dtype}, {info.max_batch} slots)", file=sys.stderr, flush=True)
        if info.context is not None and info.context < options.max_model_len:
            print(f"fastmamba: the KV cache holds {info.context} tokens a request, fewer than --max-model-len "
                  f"{options.max_model_len}: prompts and max_tokens are held to {info.context} (--kv-cache-mb for "
                  "more)", file=sys.stderr, flush=True)
        _drained_server(config, engine, options.shutdown_timeout).run(sockets=[sock])
    finally:
        engine.shutdown()
    return 0


def serve_replicas(options: ServeOptions) -> int:
    """`fastmamba serve --replicas N`: starts Ray here, runs the application until Ctrl-C or
    SIGTERM, then shuts it down."""
    import signal

    needs_ray = "--replicas and --autoscale need Ray Serve: pip install 'fastmamba[ray]'"
    if importlib.util.find_spec("ray") is None:  # (find_spec("ray.serve") would import Ray: start_ray must first)
        raise ValueError(needs_ray)
    listen(options.host, options.port).close()  # a bad or busy --port: one line, before Ray starts (its proxy binds it)
    check_chat_template(options, model_folder(options))
    start_ray(options.host)
    import ray

    serve = None
    try:
        try:
            from ray import serve

            from fastmamba.serve.deploy import build
        except ImportError:
            raise ValueError(needs_ray) from None
        serve.start(http_options={"host": options.host, "port": options.port})
        serve.run(build(options), name="fastmamba", route_prefix="/")
        scale = f"{options.autoscale} replicas, autoscaled" if options.autoscale else f"{options.replicas} replicas"
        print(f"fastmamba: serving on http://{options.host}:{options.port} with {scale} (Ray Serve)",
              file=sys.stderr, flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        if serve is not None:
            serve.shutdown()
        ray.shutdown()
    return 0


def start_ray(host: str, **init) -> None:
    """Starts Ray on this machine for `--replicas`, its services (the GCS, the raylet, the
    agents, the workers) on loopback unless `host` (--host) is another address: on Linux Ray
    takes this machine's network address for its node, and several of its services then
    listen on every interface. Ray binds them to the node's address, and takes loopback for
    it only where multi-machine clusters are off (its RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
    read when Ray is first imported: serve imports it here, after setting it; a process
    that imported Ray before keeps Ray's choice). A --host of one address puts them on that
    address; 0.0.0.0 or :: leaves Ray's own choice. `init`: more ray.init arguments."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    local = host == "localhost" or (address is not None and address.is_loopback)
    # (where Ray is imported already, its node address is settled: its services' processes
    # must see the switch as it did, or they look for a node that does not exist)
    if local and "ray" not in sys.modules:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    if local:
        init.update(_node_ip_address="127.0.0.1", dashboard_host="127.0.0.1")
    elif address is not None and not address.is_unspecified:
        init.update(_node_ip_address=host, dashboard_host=host)
    ray.init(**{"include_dashboard": False, "logging_level": "ERROR", **init})


def model_folder(options: ServeOptions) -> Path:
    """The checkpoint folder --model names, or a ValueError saying what is wrong with it in
    one line: a folder that does not exist, a file, a folder without tokenizer.json."""
    model = options.engine.model
    folder = checkpoint_folder(model)
    if model is None and not (folder / "config.json").exists():
        raise ValueError(f"no bundled model in this install ({default_model_dir()}): pass --model DIR")
    if not folder.exists():
        raise ValueError(f"--model {model}: the folder {folder} does not exist (give a checkpoint folder or a hub id "
                         "org/name)")
    if not folder.is_dir():
        raise ValueError(f"--model {model}: {folder} is a file, not a checkpoint folder")
    if not (folder / "tokenizer.json").exists():
        raise ValueError(f"the model in {folder} has no tokenizer.json: give --model a folder with one")
    return folder


def check_chat_template(options: ServeOptions, folder: Path) -> None:
    """The chat template the app will use (chat.ChatTemplate, which the app makes again the
    same way), found and compiled before the engine loads: a ValueError naming where a bad
    one came from; a warning where the model has none and chats get the plain one."""
    from fastmamba.serve.chat import ChatTemplate

    if ChatTemplate(folder, options.chat_template, options.chat_template_name).builtin:
        print(f"fastmamba: warning: the model in {folder} has no chat template (no chat_template.jinja, no "
              "chat_template in tokenizer_config.json): chats get the plain one, a 'role: content' line a message "
              "(--chat-template FILE gives one)", file=sys.stderr, flush=True)


def listen(host: str, port: int):
    """The server's socket, bound before the model loads, so that a port in use or a host
    this machine does not have is one line naming the flag, at once."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host}: cannot be resolved ({e})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _drained_server(config, engine: EngineClient, drain_s: float):
    """uvicorn's server with a drain: the first SIGTERM or Ctrl-C stops new connections
    (uvicorn), lets running requests finish for `drain_s` seconds, then ends those still
    running with a 503 (engine.shutdown), so every connection closes and the command exits
    with 0. A second signal ends them so at once; a third exits at once, as uvicorn's
    forced exit does. (uvicorn's own timeout, a little later, is the backstop: it cancels
    the tasks.)"""
    import uvicorn

    class Server(uvicorn.Server):
        draining = None
        signals = 0

        def handle_exit(self, sig, frame) -> None:
            self.signals += 1
            if self.signals == 1:
                super().handle_exit(sig, frame)
                self.draining = threading.Timer(drain_s, engine.shutdown)
                self.draining.daemon = True
                self.draining.start()
            elif self.signals == 2:
                # uvicorn's forced exit would cancel the open requests' tasks: a plain-text
                # 500, a stream cut without its error event and [DONE]. They end as the
                # drain's end ends them instead, and the exit is forced only after
                self.draining.cancel()
                threading.Thread(target=self._end_open_requests, name="fastmamba-shutdown", daemon=True).start()
            else:
                self.force_exit = True
            # uvicorn raises the caught signal again once it has shut down, which would end
            # the process by that signal: a drained shutdown ends with 0 instead
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

        def _end_open_requests(self) -> None:
            engine.shutdown()
            time.sleep(LAST_ANSWERS_S)
            self.force_exit = True

    return Server(config)
