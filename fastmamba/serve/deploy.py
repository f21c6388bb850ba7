"""`fastmamba.deploy`: replicas of the serving engine on Ray Serve, past one GPU, with each
request routed to the replica that holds its prompt's prefix.

Two deployments:
- `EngineReplica`, `replicas` of it: each runs the serving engine exactly as `fastmamba
  serve` does (engine_process.EngineClient: the engine in a process of its own), one GPU
  each on CUDA. Its `generate` streams a request's engine outputs.
- `Frontend`, the HTTP ingress: `fastmamba serve`'s FastAPI app (server.create_app: the
  same routes, errors and metrics), whose requests go to the engine replicas through a
  Ray handle.
`batch` runs offline jobs over a Ray Dataset of prompts, one engine per actor.

`PrefixRouter` sends a request to the replica that a consistent hash of its key names
(rendezvous hashing: a replica's death moves only its own share): a chat's key is its
opening (its messages up to the first user message, which every later turn repeats), a
completion's its prompt's first 512 token ids. So a conversation's next turn finds the
state its last turn left in that replica's prefix cache. When that replica already has
`queue_bound` requests in flight, the least loaded one takes the request instead.

    fastmamba serve --replicas 2 --model DIR ...           # Ray started locally
    serve run fastmamba.deploy:app model=DIR replicas=2    # Ray's own command line
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import itertools
import time

import numpy as np
from ray import serve
from ray.serve._private.request_router.request_router import RequestRouter
from ray.serve.config import RequestRouterConfig

from fastmamba.engine.process import EngineClient, EngineDown, QueueFull
from fastmamba.core.sampling_params import SamplingParams

ROUTE_TOKENS = 512  # the prefix a request is routed by: the prefix cache's first grid point
# A replica sends each stream's tokens on in lists, one each this many ms after the first
# token (see EngineReplica.generate): tokens reach the client in bursts of up to this gap.
STREAM_INTERVAL_MS = 50


def route_key(ids: list[int]) -> int:
    """A stable 64-bit hash of a prompt's first ROUTE_TOKENS token ids (the same in every process)."""
    digest = hashlib.blake2b(np.asarray(ids[:ROUTE_TOKENS], dtype=np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _affinity(key: int, replica: str) -> bytes:
    return hashlib.blake2b(f"{key}/{replica}".encode(), digest_size=8).digest()


class PrefixRouter(RequestRouter):
    """Routes `EngineReplica.generate(key, ...)` calls by their key (see the module's doc).
    routing "round-robin" ignores the key and takes the replicas in turn (the baseline the
    multi-GPU benchmark compares against)."""

    def initialize_state(self, queue_bound: int = 64, routing: str = "prefix"):
        self.queue_bound, self.routing = queue_bound, routing
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        args = pending_request.args if pending_request is not None else None
        if self.routing == "round-robin":
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            k = next(self._turn) % len(ordered)
            return [ordered[k:] + ordered[:k]]
        if not args or not isinstance(args[0], int):
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, key=lambda r: _affinity(args[0], r.replica_id.unique_id), reverse=True)
        load = {r.replica_id: self._replica_queue_len_cache.get(r.replica_id) or 0 for r in ranked}
        if load[ranked[0].replica_id] < self.queue_bound:
            return [[ranked[0]], sorted(ranked[1:], key=lambda r: load[r.replica_id])]
        return [sorted(ranked, key=lambda r: load[r.replica_id])]  # its home is busy: the least loaded


class EngineReplica:
    """One replica: the serving engine in its own process, its outputs streamed per request."""

    def __init__(self, load_kwargs: dict, engine_kwargs: dict, max_queue: int, stream_interval_s: float):
        from fastmamba.engine.loader import load

        self.client = EngineClient(functools.partial(load, **load_kwargs), engine_kwargs, max_queue=max_queue)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.interval = stream_interval_s

    async def generate(self, key: int, ids: list[int], fields: dict, top_logprobs: int | None):
        """The engine's outputs for one request (engine.py's tuples), until its end, in lists:
        the first output alone and at once (the time to first token), then what came in each
        `stream_interval_s`. Each item of a Ray stream costs both processes a fixed few
        hundred µs of Python, so one a token held 64 streams of 2.8b on an H200 to 0.22 of
        the plain server's throughput (benchmarks/RESULTS.md, "Ray Serve")."""
        outs: asyncio.Queue = asyncio.Queue()
        try:
            rid = self.client.submit(ids, SamplingParams(**fields), top_logprobs, outs.put_nowait)
        except QueueFull as e:
            yield [(None, None, None, "error", dict(message=f"the server is busy: {e}", status=429))]
            return
        except EngineDown as e:
            yield [(None, None, None, "error", dict(message=str(e), status=503))]
            return
        try:
            sent = None  # when the last list went out
            while True:
                batch = [await outs.get()]
                if sent is not None:
                    await asyncio.sleep(sent + self.interval - time.monotonic())  # (returns at once if past)
                while not outs.empty():
                    batch.append(outs.get_nowait())
                sent = time.monotonic()
                end = batch[-1]
                if end[3] is not None:  # the end: with this replica's engine stats, for the front end's metrics
                    batch[-1] = tuple(end[:4]) + ({**end[4], "replica": self.name, "stats": self.client.stats},)
                    yield batch
                    return
                yield batch
        finally:  # the caller went away (or the request ended): nothing more for it
            self.client.abort(rid)

    def stats(self) -> dict:
        return self.client.stats

    def check_health(self) -> None:
        if not self.client.alive:
            raise RuntimeError("the engine process is not running")

    def __del__(self):
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown(timeout=5)


class RayEngine:
    """server.create_app's engine, over the engine replicas' Ray handle: each request is a
    streaming call, routed by its prompt's prefix."""

    def __init__(self, handle):
        self.handle = handle.options(stream=True)
        self._tasks: dict[int, asyncio.Task] = {}
        self._stats: dict[str, dict] = {}  # each replica's latest engine stats, from its requests' ends
        self._rids = itertools.count()
        self.on_stats = None
        self.alive = True  # Ray replaces a replica that dies; its requests end with a 503

    def submit(self, ids: list[int], params: SamplingParams, top_logprobs: int | None, emit, route=None) -> int:
        """route: the routing key (a conversation's, from the front end), else the prompt's."""
        rid = next(self._rids)
        key = route if route is not None else route_key(ids)
        fields = dataclasses.asdict(params)

        async def run():
            try:
                async for batch in self.handle.generate.remote(key, ids, fields, top_logprobs):
                    for out in batch:
                        emit((rid,) + tuple(out[1:]))
                        if out[3] is not None:
                            self._replica_stats(out[4])
                            return
                raise RuntimeError("the replica's stream ended early")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the replica died, or Ray could not reach one
                emit((rid, None, None, "error", dict(message=f"the engine replica failed: {type(e).__name__}",
                                                     status=503)))
            finally:
                self._tasks.pop(rid, None)

        self._tasks[rid] = asyncio.get_running_loop().create_task(run())
        return rid

    def _replica_stats(self, info: dict) -> None:
        """The metrics' engine figures summed over the replicas (a replica's counters count on
        in its successor: Ray gives it a new name)."""
        if "replica" not in info or self.on_stats is None:
            return
        self._stats[info["replica"]] = info["stats"]
        self.on_stats({k: sum(s[k] for s in self._stats.values()) for k in info["stats"]})

    def abort(self, rid: int) -> None:
        task = self._tasks.pop(rid, None)
        if task is not None:
            task.cancel()  # cancels the streaming call: the replica's generator ends, and aborts the request


def build(model=None, replicas: int = 2, device: str = "cpu", dtype: str = "float32", state_dtype: str = "float32",
          deterministic: bool = False, threads: int | None = None, max_batch: int | None = None,
          prefill_tokens: int = 4096, prefix_cache_mb: int = 256, max_queue: int = 256, max_model_len: int = 32768,
          max_body_mb: float = 8, api_key: str | None = None, served_model_name: str | None = None,
          queue_bound: int = 64, autoscaling: dict | None = None, routing: str = "prefix",
          stream_interval_ms: float = STREAM_INTERVAL_MS):
    """The Ray Serve application: `replicas` engine replicas (or an autoscaling config) behind
    the HTTP front end. Arguments as `fastmamba serve`'s flags; routing: "prefix" (the
    default) or "round-robin"; stream_interval_ms: how often a replica sends a stream's
    new tokens on to the front end (0: each as it comes)."""
    if routing not in ("prefix", "round-robin"):
        raise ValueError(f"routing must be 'prefix' or 'round-robin', got {routing!r}")
    if not stream_interval_ms >= 0:
        raise ValueError(f"stream_interval_ms must be at least 0, got {stream_interval_ms!r}")
    from fastmamba.engine.loader import checkpoint_folder

    folder = checkpoint_folder(model)
    load_kwargs = dict(path=str(folder), device=device, dtype=dtype, state_dtype=state_dtype,
                       deterministic=deterministic, threads=threads)
    engine_kwargs = dict(max_batch=max_batch, prefill_tokens=prefill_tokens, prefix_cache_bytes=prefix_cache_mb << 20)
    gpu = device != "cpu"
    scale = dict(autoscaling_config=autoscaling) if autoscaling else dict(num_replicas=replicas)
    engines = serve.deployment(EngineReplica).options(
        name="EngineReplica", ray_actor_options={"num_gpus": 1} if gpu else {"num_cpus": 1},
        graceful_shutdown_timeout_s=10, graceful_shutdown_wait_loop_s=0.5,
        max_ongoing_requests=max_queue + (max_batch or 256),
        request_router_config=RequestRouterConfig(request_router_class=PrefixRouter,
                                                  request_router_kwargs={"queue_bound": queue_bound,
                                                                         "routing": routing}),
        **scale,
    ).bind(load_kwargs, engine_kwargs, max_queue, stream_interval_ms / 1000)
    options = dict(model_name=served_model_name or (model or "fastmamba-default"), folder=str(folder), api_key=api_key,
                   max_model_len=max_model_len, max_body_mb=max_body_mb)
    frontend = serve.deployment(serve.ingress()(Frontend)).options(
        name="Frontend", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000,
        graceful_shutdown_timeout_s=10, graceful_shutdown_wait_loop_s=0.5)
    return frontend.bind(engines, options)


class Frontend:
    """The HTTP ingress: `fastmamba serve`'s app over the engine replicas' handle, made in
    the replica (Ray calls __serve_build_asgi_app__ after the constructor)."""

    def __init__(self, engines, options: dict):
        self.engines, self.options = engines, options

    def __serve_build_asgi_app__(self):
        from fastmamba.serve.app import folder_app

        return folder_app(RayEngine(self.engines), **self.options)


def autoscaling(spec: str, target: int = 16) -> dict:
    """Ray Serve's autoscaling config from "MIN:MAX" replicas (each aiming at `target`
    requests in flight); a ValueError naming --autoscale otherwise."""
    try:
        low, high = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--autoscale takes MIN:MAX replicas, got {spec!r}") from None
    if not 0 <= low <= high or high < 1:
        raise ValueError(f"--autoscale MIN:MAX needs 0 <= MIN <= MAX and MAX >= 1, got {spec!r}")
    return {"min_replicas": low, "max_replicas": high, "target_ongoing_requests": target}


def app(args: dict):
    """`serve run fastmamba.deploy:app model=DIR replicas=2 device=cuda dtype=bfloat16 ...`
    (autoscale=MIN:MAX in place of replicas)."""
    ints = {"replicas", "threads", "max_batch", "prefill_tokens", "prefix_cache_mb", "max_queue", "max_model_len",
            "queue_bound"}
    kwargs = {k: int(v) if k in ints else float(v) if k in ("max_body_mb", "stream_interval_ms") else
              (str(v).lower() in ("1", "true", "yes")) if k == "deterministic" else v for k, v in args.items()}
    if "autoscale" in kwargs:
        kwargs["autoscaling"] = autoscaling(kwargs.pop("autoscale"), kwargs.get("max_batch") or 16)
    return build(**kwargs)


def serve_replicas(args) -> int:
    """`fastmamba serve --replicas N`: starts Ray here, runs the application until Ctrl-C or
    SIGTERM, then shuts it down."""
    import signal
    import sys
    import threading

    import ray

    from fastmamba.serve.app import _listen

    scaling = autoscaling(args.autoscale, args.max_batch or 16) if args.autoscale else None
    _listen(args.host, args.port).close()  # a bad or busy --port: one line, before Ray starts (its proxy binds it)
    ray.init(include_dashboard=False, logging_level="ERROR")
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        application = build(model=args.model, replicas=args.replicas, device=args.device, dtype=args.dtype,
                            state_dtype=args.state_dtype, deterministic=args.deterministic, threads=args.threads,
                            max_batch=args.max_batch, prefill_tokens=args.prefill_tokens,
                            prefix_cache_mb=args.prefix_cache_mb, max_queue=args.max_queue,
                            max_model_len=args.max_model_len, max_body_mb=args.max_body_mb, api_key=args.api_key,
                            served_model_name=args.served_model_name, autoscaling=scaling,
                            stream_interval_ms=STREAM_INTERVAL_MS if args.stream_interval_ms is None
                            else args.stream_interval_ms)
        serve.run(application, name="fastmamba", route_prefix="/")
        scale = f"{args.autoscale} replicas, autoscaled" if args.autoscale else f"{args.replicas} replicas"
        print(f"fastmamba: serving on http://{args.host}:{args.port} with {scale} (Ray Serve)",
              file=sys.stderr, flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


class _Generate:
    """One actor of `batch`: a language model, and generate_batch over each block of rows."""

    def __init__(self, load_kwargs: dict, params: dict, column: str):
        from fastmamba.engine.loader import load

        self.lm = load(**load_kwargs)
        self.params, self.column = params, column

    def __call__(self, rows: dict) -> dict:
        prompts = [p if isinstance(p, str) else [int(t) for t in p] for p in rows[self.column]]
        seeds = [int(s) for s in rows["seed"]]
        outs = self.lm.generate_batch(prompts, [SamplingParams(**{**self.params, "seed": s}) for s in seeds])
        return {self.column: rows[self.column], "seed": rows["seed"],
                "text": np.array([o.text for o in outs], dtype=object),
                "token_ids": np.array([np.asarray(o.token_ids, dtype=np.int64) for o in outs] + [None], dtype=object)[:-1],
                "finish_reason": np.array([o.finish_reason for o in outs], dtype=object)}


def prompt_seed(prompt, seed: int) -> int:
    """A row's seed where the dataset has none: from the prompt and the job's seed, so that
    a row's generation is the same however the job is split among actors."""
    data = prompt.encode() if isinstance(prompt, str) else np.asarray(prompt, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=4, key=seed.to_bytes(8, "little")).digest(), "little")


def batch(dataset, model=None, *, column: str = "prompt", seed: int = 0, concurrency: int = 2, batch_size: int = 64,
          device: str = "cpu", dtype: str = "float32", state_dtype: str = "float32", deterministic: bool = False,
          **sampling):
    """Generations for every row of a Ray Dataset of prompts (`column`: text, or token ids),
    on `concurrency` actors with one engine each (one GPU each on CUDA): a Dataset with the
    prompt, its `seed`, `text`, `token_ids` and `finish_reason` per row.

    A row's seed is its `seed` column where the dataset has one, else prompt_seed(prompt,
    seed); each row gets what `generate` gives it alone with that seed, whatever the number
    of actors or rows a block (on a GPU exactly so with deterministic=True, else within the
    batch-invariant ranges). `sampling`: SamplingParams fields (max_tokens, temperature, ...)."""
    from fastmamba.engine.loader import checkpoint_folder

    params = dataclasses.asdict(SamplingParams.from_kwargs(None, sampling))
    del params["seed"]  # (each row's own)
    if "seed" not in dataset.columns():
        dataset = dataset.map(lambda row: {**row, "seed": prompt_seed(row[column], seed)})
    load_kwargs = dict(path=str(checkpoint_folder(model)), device=device, dtype=dtype, state_dtype=state_dtype,
                       deterministic=deterministic)
    resources = {"num_gpus": 1} if device != "cpu" else {"num_cpus": 1}
    from ray.data import ActorPoolStrategy

    return dataset.map_batches(_Generate, fn_constructor_args=(load_kwargs, params, column), batch_size=batch_size,
                               compute=ActorPoolStrategy(size=concurrency), batch_format="numpy", **resources)
