"""Replicas of the serving engine on Ray Serve, past one GPU, with each request routed to the
replica that holds its prompt's prefix.

Two deployments:
- `EngineReplica`, `replicas` of it: each runs the serving engine exactly as `fastmamba
  serve` does (engine/process.ProcessClient: the engine in a process of its own), one GPU
  each on CUDA. Its `generate` streams a request's engine outputs (protocol.py's messages,
  in ReplicaOutputs).
- `Frontend`, the HTTP ingress: `fastmamba serve`'s FastAPI app (app.create_app: the same
  routes, errors and metrics), whose requests go to the engine replicas through a Ray
  handle (RayClient, an engine client like the others).
`batch` runs offline jobs over a Ray Dataset of prompts, one engine per actor.

`PrefixRouter` sends a request to the replica that a consistent hash of its key names
(rendezvous hashing: a replica's death moves only its own share): a chat's key is its
opening (its messages up to the first user message, which every later turn repeats), a
completion's its prompt's first 512 token ids. So a conversation's next turn finds the
state its last turn left in that replica's prefix cache. When that replica already has
`queue_bound` requests in flight, the least loaded one takes the request instead.

    fastmamba serve --replicas 2 --model DIR ...                 # Ray started locally
    serve run fastmamba.serve.deploy:app model=DIR replicas=2    # Ray's own command line
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import math
import os
import time

import msgspec
import numpy as np
import ray
from ray import serve
from ray.serve import context as serve_context
from ray.serve._private.request_router.request_router import RequestRouter
from ray.serve.config import RequestRouterConfig

from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine import protocol
from fastmamba.engine.client import EngineClient, EngineRefused
from fastmamba.engine.options import EngineOptions
from fastmamba.engine.protocol import EngineError, Failed, Output, Stats
from fastmamba.io.folders import checkpoint_folder
from fastmamba.serve.options import ServeOptions

ROUTE_TOKENS = 512  # the prefix a request is routed by: the prefix cache's first grid point
DEFAULT_REPLICAS = 2  # Ray's command line without replicas= or autoscale=


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


class ReplicaOutputs(msgspec.Struct, array_like=True, frozen=True):
    """What a replica's stream sends at once: a request's outputs (rids of the replica's
    engine), and with the last of them the replica's name and its engine's stats, which the
    front end's metrics sum over the replicas."""

    outputs: list[Output]
    replica: str | None = None
    stats: Stats | None = None


class EngineReplica:
    """One replica: the serving engine in its own process, its outputs streamed per request.
    A replica sends each stream's tokens on in lists, one each `stream_interval_s` after the
    first token (ServeOptions.stream_interval_ms): tokens reach the client in bursts of up
    to that gap."""

    def __init__(self, options: EngineOptions, folder: str, max_queue: int, stream_interval_s: float,
                 engine_timeout: float = 30):
        from fastmamba.engine.process import ProcessClient

        self.client = ProcessClient(options, folder, max_queue=max_queue, silence_s=engine_timeout)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.interval = stream_interval_s
        self._encode = protocol.encoder().encode

    async def generate(self, key: int, ids: list[int], params: SamplingParams, top_logprobs: int | None):
        """The engine's outputs for one request until its end, as encoded ReplicaOutputs: the
        first output alone and at once (the time to first token), then what came in each
        `stream_interval_s`. Each item of a Ray stream costs both processes a fixed few
        hundred µs of Python, so one a token held 64 streams of 2.8b on an H200 to 0.22 of
        the plain server's throughput (benchmarks/RESULTS.md, "Ray Serve"). `key` is for the
        router. `params` come checked from the front end (unpickling does not check again)."""
        outs: asyncio.Queue = asyncio.Queue()
        try:
            rid = self.client.submit(ids, params, top_logprobs, outs.put_nowait)
        except EngineRefused as e:
            yield self._encode(ReplicaOutputs([Failed(-1, e.error)]))
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
                if protocol.is_end(batch[-1]):
                    yield self._encode(ReplicaOutputs(batch, self.name, self.client.stats))
                    return
                yield self._encode(ReplicaOutputs(batch))
        finally:  # the caller went away (or the request ended): nothing more for it
            self.client.abort(rid)

    def stats(self) -> Stats:
        return self.client.stats

    def check_health(self) -> None:
        """Ray Serve's probe: a replica whose engine died or is wedged is replaced."""
        if not self.client.alive:
            raise RuntimeError("the engine process is not running, or not answering")

    def __del__(self):
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown(timeout=5)


def _own_request_context(rid: int) -> None:
    """Gives this task's calls of the replicas an id of their own. A handle's call takes the
    ids of the HTTP request it runs in, and Ray's router keeps the calls it has yet to assign
    under that id: two choices of one request (n > 1, a list of prompts) routed to different
    replicas at once left one call never assigned, the request hanging. (The task's context
    is its own copy: the request's is unchanged.)"""
    ctx = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(dataclasses.replace(
        ctx, request_id=f"{ctx.request_id}.{rid}", _internal_request_id=f"{ctx._internal_request_id}.{rid}"))


class RayClient(EngineClient):
    """An engine client over the engine replicas' Ray handle (app.create_app's engine under
    Ray Serve): each request is a streaming call, routed by its key."""

    def __init__(self, handle):
        self.handle = handle.options(stream=True)
        self.max_batch = 0  # (the replicas' own)
        self.stats = Stats()
        self._tasks: dict[int, asyncio.Task] = {}
        self._replica_stats: dict[str, Stats] = {}  # each replica's latest, from its requests' ends
        self._rids = itertools.count()
        self._decode = protocol.decoder(ReplicaOutputs).decode

    @property
    def alive(self) -> bool:
        return True  # Ray replaces a replica that dies; its requests end with a 503

    def submit(self, ids, params, top_logprobs, emit, route=None) -> int:
        """route: the routing key (a conversation's, from the front end), else the prompt's."""
        rid = next(self._rids)
        key = route if route is not None else route_key(ids)

        async def run():
            _own_request_context(rid)
            try:
                async for item in self.handle.generate.remote(key, ids, params, top_logprobs):
                    batch = self._decode(item)
                    for out in batch.outputs:
                        emit(msgspec.structs.replace(out, rid=rid))
                    if batch.replica is not None:
                        self._sum_stats(batch.replica, batch.stats)
                    if batch.outputs and protocol.is_end(batch.outputs[-1]):
                        return
                raise RuntimeError("the replica's stream ended early")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the replica died, or Ray could not reach one
                emit(Failed(rid, EngineError(protocol.ENGINE_DOWN, f"the engine replica failed: {type(e).__name__}")))
            finally:
                self._tasks.pop(rid, None)

        self._tasks[rid] = asyncio.get_running_loop().create_task(run())
        return rid

    def _sum_stats(self, replica: str, stats: Stats) -> None:
        """The metrics' engine figures summed over the replicas (a replica's counters count on
        in its successor: Ray gives it a new name)."""
        self._replica_stats[replica] = stats
        self.stats = sum(self._replica_stats.values(), Stats())
        if self.on_stats is not None:
            self.on_stats(self.stats)

    def abort(self, rid: int) -> None:
        task = self._tasks.pop(rid, None)
        if task is not None:
            task.cancel()  # cancels the streaming call: the replica's generator ends, and aborts the request


def build(options: ServeOptions, queue_bound: int = 64, routing: str = "prefix"):
    """The Ray Serve application: the options' replicas (or autoscaling range) of the engine
    behind the HTTP front end. routing: "prefix" (the default) or "round-robin" (the
    baseline the multi-GPU benchmark compares against); queue_bound: requests in flight on
    a replica past which its requests go to the least loaded one."""
    if routing not in ("prefix", "round-robin"):
        raise ValueError(f"routing must be 'prefix' or 'round-robin', got {routing!r}")
    folder = str(checkpoint_folder(options.engine.model))
    engine = options.engine
    scaling = options.autoscaling()
    scale = dict(autoscaling_config=scaling) if scaling else dict(num_replicas=options.replicas or DEFAULT_REPLICAS)
    engines = serve.deployment(EngineReplica).options(
        name="EngineReplica", ray_actor_options={"num_gpus": 1} if engine.device != "cpu" else {"num_cpus": 1},
        graceful_shutdown_timeout_s=10, graceful_shutdown_wait_loop_s=0.5,
        max_ongoing_requests=options.max_queue + (engine.max_batch or 256),
        request_router_config=RequestRouterConfig(request_router_class=PrefixRouter,
                                                  request_router_kwargs={"queue_bound": queue_bound,
                                                                         "routing": routing}),
        **scale,
    ).bind(engine, folder, options.max_queue, options.stream_interval_ms / 1000, options.engine_timeout)
    frontend = serve.deployment(serve.ingress()(Frontend)).options(
        name="Frontend", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000,
        graceful_shutdown_timeout_s=10, graceful_shutdown_wait_loop_s=0.5)
    return frontend.bind(engines, folder, options)


class Frontend:
    """The HTTP ingress: `fastmamba serve`'s app over the engine replicas' handle, made in
    the replica (Ray calls __serve_build_asgi_app__ after the constructor)."""

    def __init__(self, engines, folder: str, options: ServeOptions):
        self.engines, self.folder, self.options = engines, folder, options

    def __serve_build_asgi_app__(self):
        from fastmamba.serve.app import folder_app

        return folder_app(RayClient(self.engines), self.folder, self.options)


def app(args: dict):
    """`serve run fastmamba.serve.deploy:app model=DIR replicas=2 device=cuda dtype=bfloat16 ...`
    (autoscale=MIN:MAX in place of replicas): the options by their field names, and build's
    queue_bound and routing; another key is a ValueError naming it."""
    args = dict(args)
    router = {}
    if "queue_bound" in args:
        try:
            router["queue_bound"] = int(args.pop("queue_bound"))
        except ValueError:
            raise ValueError("queue_bound takes an integer") from None
    if "routing" in args:
        router["routing"] = args.pop("routing")
    return build(ServeOptions.from_dict(args), **router)


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


def _row_seed(row: dict, column: str, seed: int) -> int:
    """A row's own seed where it has one (a seed column with gaps: None, or NaN where the
    column was read as floats), else prompt_seed's."""
    own = row.get("seed")
    if own is None or (isinstance(own, float) and math.isnan(own)):
        return prompt_seed(row[column], seed)
    return int(own)


def batch(dataset, model=None, *, column: str = "prompt", seed: int = 0, concurrency: int | None = None,
          batch_size: int = 64, device: str = "cpu", dtype: str = "float32", state_dtype: str = "float32",
          deterministic: bool = False, **sampling):
    """Generations for every row of a Ray Dataset of prompts (`column`: text, or token ids),
    on `concurrency` actors with one engine each (one GPU each on CUDA): a Dataset with the
    prompt, its `seed`, `text`, `token_ids` and `finish_reason` per row. concurrency None: 2,
    fewer on the CPU where Ray has fewer than 3 CPUs (its read tasks need one beside the
    actors, or the job waits forever).

    A row's seed is its `seed` column where the dataset has one, else prompt_seed(prompt,
    seed); each row gets what `generate` gives it alone with that seed, whatever the number
    of actors or rows a block (on a GPU exactly so with deterministic=True, else within the
    batch-invariant ranges). `sampling`: SamplingParams fields (max_tokens, temperature, ...)."""
    params = dataclasses.asdict(SamplingParams.from_kwargs(None, sampling))
    del params["seed"]  # (each row's own)
    dataset = dataset.map(lambda row: {**row, "seed": _row_seed(row, column, seed)})
    if concurrency is None:
        cpus = int(ray.cluster_resources().get("CPU", 1)) if ray.is_initialized() else (os.cpu_count() or 1)
        concurrency = 2 if device != "cpu" else max(1, min(2, cpus - 1))
    engine = EngineOptions(model=model, device=device, dtype=dtype, state_dtype=state_dtype, deterministic=deterministic)
    load_kwargs = {**engine.load_kwargs(), "path": str(checkpoint_folder(model))}
    resources = {"num_gpus": 1} if device != "cpu" else {"num_cpus": 1}
    from ray.data import ActorPoolStrategy

    return dataset.map_batches(_Generate, fn_constructor_args=(load_kwargs, params, column), batch_size=batch_size,
                               compute=ActorPoolStrategy(size=concurrency), batch_format="numpy", **resources)
