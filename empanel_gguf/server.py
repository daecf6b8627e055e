"""llama-cpp-python's OpenAI-compatible server (llama_cpp.server) with expert slot pools.

    from empanel_gguf.server import EmpanelSettings, create_app
    app = create_app(server_settings, [EmpanelModelSettings(model="m.gguf", moe_slots="25%")])

What changes against llama_cpp.server:
  - EmpanelModelSettings adds `moe_slots` (and the memory guard's `mem_floor`, `force`) to its
    ModelSettings; EmpanelConfigFileSettings takes them in each entry of a config file's `models`.
  - EmpanelLlamaProxy loads every model as empanel_gguf.Llama: llama_cpp.server's own loader
    runs unchanged (every other setting keeps its meaning) with its `llama_cpp.Llama` replaced
    for the duration of the load. The memory guard checks each load first.
  - GET /metrics (Prometheus text format) and GET /v1/empanel/stats (JSON): live expert hit rate,
    bytes read and read rate, slots, memory.
Requests stay serialized by llama_cpp.server's own lock (one model, one request at a time); by
default a request waits for the one before it (interrupt_requests=false), where llama_cpp.server
would end a streaming answer early.

Needs llama_cpp.server's extras: pip install "empanel-gguf[server]" (uvicorn, fastapi,
sse-starlette, starlette-context, pydantic-settings, PyYAML).
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from pathlib import Path
from typing import List, Optional

from . import llama_cpp  # our libraries first
from .planning.host_memory import available_memory, parse_floor, peak_rss
from .planning.options import OPTIONS, moe_options
from .planning.plan import BATCH_KWARGS, parse_moe_slots, plan_load, print_notices
from .engine.pools import prometheus_label, prometheus_pools
from .engine.stats import hit_rate
from .llama import Llama as EmpanelLlama
from .engine.rpc import use_servers as use_rpc_servers

try:
    import llama_cpp.server.app as _app
    import llama_cpp.server.model as _model
    from fastapi import APIRouter, HTTPException
    from fastapi.responses import PlainTextResponse
    from llama_cpp.server.settings import ModelSettings, ServerSettings
    from pydantic import Field, create_model, field_validator
except ImportError as e:  # pragma: no cover - exercised where the extras are missing
    raise ImportError(
        f"empanel-gguf serve needs llama_cpp.server's extras ({e.name} is missing).\n"
        'HINT: pip install "empanel-gguf[server]"  (or: pip install uvicorn fastapi sse-starlette '
        '"starlette-context>=0.3.6,<0.4" pydantic-settings PyYAML)') from e


# ---------------------------------------------------------------------------------------------
# settings


class _EmpanelLoadSettings(ModelSettings):
    """llama_cpp.server's ModelSettings with the memory guard and RPC servers; the moe_* settings
    come from the options' table (EmpanelModelSettings below)."""

    mem_floor: Optional[str] = Field(
        default=None,
        description="Memory to keep free (2GiB, 5%, 0 = no guard): a load whose estimate leaves "
                    "less is refused, and the server stops when less is left. Unset: max(1 GiB, 5%).")
    force: bool = Field(default=False,
                        description="Load even when the memory guard estimates that it does not fit.")
    rpc_servers: Optional[str] = Field(
        default=None,
        description="HOST:PORT,... of ggml-rpc-server processes (llama.cpp's --rpc): the offloaded layers and "
                    "their slot pools go to them (n_gpu_layers: all unless set).")

    @field_validator("moe_slots", "mem_floor", mode="before", check_fields=False)
    @classmethod
    def _text(cls, value):
        return None if value is None else str(value)  # a config file may give 32 as a number


def _moe_settings():
    """The moe_* settings of a model, from the options' table (planning/options.py): the options
    whose `server` names a type, with the commands' help as their description."""
    settings = {}
    for o in OPTIONS:
        if o.server is not None:
            unset = f" Unset: {o.show_default}." if o.show_default else ""
            settings[o.keyword] = (o.server, Field(default=o.default, description=f"{o.help[0].upper()}{o.help[1:]}."
                                                                                  f"{unset}"))
    return settings


EmpanelModelSettings = create_model(
    "EmpanelModelSettings", __base__=_EmpanelLoadSettings, __module__=__name__,
    __doc__="llama_cpp.server's ModelSettings with expert slot pools and the memory guard.", **_moe_settings())


class EmpanelServerSettings(ServerSettings):
    """llama_cpp.server's ServerSettings with llama.cpp's address, 127.0.0.1:8080, and requests
    that wait their turn instead of cutting off a streaming one (llama_cpp.server's
    interrupt_requests=True ends a stream early whenever another request arrives)."""

    host: str = Field(default="127.0.0.1", description="Listen address")
    port: int = Field(default=8080, description="Listen port")
    interrupt_requests: bool = Field(
        default=False,
        description="Whether a new request ends the streaming one early (llama_cpp.server: true); "
                    "false: requests wait their turn.")


class EmpanelSettings(EmpanelServerSettings, EmpanelModelSettings):
    pass


class EmpanelConfigFileSettings(EmpanelServerSettings):
    """The config file (--config_file, JSON or YAML): server settings and a list of models."""

    models: List[EmpanelModelSettings] = Field(default=[], description="Model configs")


def load_config_file(path):
    """EmpanelConfigFileSettings from a JSON or YAML file."""
    text = Path(path).read_bytes()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        return EmpanelConfigFileSettings.model_validate_json(json.dumps(yaml.safe_load(text)))
    return EmpanelConfigFileSettings.model_validate_json(text)


# ---------------------------------------------------------------------------------------------
# loading


class _LlamaCppWithSlots:
    """Stands in for the llama_cpp module inside llama_cpp.server.model during one load: the same
    module, except that `Llama` is empanel_gguf's with the load's moe_slots."""

    def __init__(self, llama_class):
        self.Llama = llama_class

    def __getattr__(self, name):
        return getattr(llama_cpp, name)


def _llama_with_slots(moe_load=None, rpc_servers=None, **moe):
    """Llama that loads with the settings' plan (moe_load; else their moe_* options, for a file
    that could not be planned before it was there) and RPC servers."""
    class Llama(EmpanelLlama):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("rpc_servers", rpc_servers)
            if moe_load is not None:
                kwargs.setdefault("moe_load", moe_load)
            elif moe.get("moe_slots") is not None:
                for key, value in moe.items():
                    kwargs.setdefault(key, value)
            super().__init__(*args, **kwargs)

    Llama.__name__ = Llama.__qualname__ = "Llama"
    return Llama


class EmpanelLlamaProxy(_model.LlamaProxy):
    """llama_cpp.server's LlamaProxy whose loads go through the memory guard and make
    empanel_gguf.Llama models. Also remembers, per loaded model, what the guard decided."""

    def __init__(self, models):
        self._swap = threading.RLock()  # held while the current model changes; stats take it too
        self.loaded = {}  # alias -> {"moe_slots", "plan", "index", "estimate", "floor", ...}
        self.floor = None  # the memory floor of the current model (for the watchdog)
        self.watchdog = None
        super().__init__(models)

    def __call__(self, model=None):
        with self._swap:
            return super().__call__(model)

    def free(self):
        with self._swap:
            super().free()
            self._current_model = None

    def load_llama_from_model_settings(self, settings):
        from .planning.index import load_index

        alias = settings.model_alias or settings.model
        rpc_servers = getattr(settings, "rpc_servers", None)
        if rpc_servers:  # before the estimate: it sees their devices
            given = {"n_gpu_layers": settings.n_gpu_layers if "n_gpu_layers" in settings.model_fields_set else None}
            use_rpc_servers(rpc_servers, given)
            settings.n_gpu_layers = given["n_gpu_layers"]
        moe = {o.keyword: getattr(settings, o.keyword, o.default) for o in OPTIONS
               if o.server is not None and o.name != "slots"}
        load = None
        if settings.hf_model_repo_id is None and not settings.vocab_only:
            index = load_index(settings.model)
            lora = [settings.lora_path] if getattr(settings, "lora_path", None) else []
            # n_batch, n_ubatch and flash_attn that the settings leave at llama_cpp.server's defaults
            # are the plan's to choose (moe_batch); Llama takes its choice from the plan
            given = {key: value for key, value in settings.model_dump().items()
                     if key not in BATCH_KWARGS or key in settings.model_fields_set}
            load = plan_load(index, parse_moe_slots(getattr(settings, "moe_slots", None) or "auto"),
                             given, options=moe_options(**moe), lora_paths=lora,
                             floor=parse_floor(getattr(settings, "mem_floor", None)),
                             force=getattr(settings, "force", False), what=f"loading {alias}")
            print_notices(load.report())
            moe_slots = load.moe_slots
            info = {"moe_slots": moe_slots, "plan": load.plan, "index": index, "estimate": load.estimate,
                    "floor": load.floor}
        else:  # a hub download or vocabulary only: nothing to size before the file is here
            moe_slots = parse_moe_slots(getattr(settings, "moe_slots", None))
            moe_slots = None if moe_slots == "auto" or settings.vocab_only else moe_slots
            info = {"moe_slots": moe_slots, "plan": None, "index": None, "estimate": None,
                    "floor": parse_floor(getattr(settings, "mem_floor", None))}

        saved = _model.llama_cpp
        _model.llama_cpp = _LlamaCppWithSlots(_llama_with_slots(load, rpc_servers=rpc_servers, moe_slots=moe_slots,
                                                                **moe))
        try:
            llm = _model.LlamaProxy.load_llama_from_model_settings(settings)
        finally:
            _model.llama_cpp = saved
        self.loaded[alias] = info
        self.floor = info["floor"]
        return llm

    def current(self):
        """(alias, model) of the loaded model, or (None, None)."""
        return self._current_model_alias, self._current_model

    def snapshot(self, timeout=1.0):
        """(alias, moe_stats or None, info) of the current model; None if a load holds it."""
        if not self._swap.acquire(timeout=timeout):
            return None
        try:
            alias, llm = self.current()
            if llm is None:
                return alias, None, {}
            stats = llm.moe_stats() if hasattr(llm, "moe_stats") else None
            return alias, stats, self.loaded.get(alias, {})
        finally:
            self._swap.release()


# ---------------------------------------------------------------------------------------------
# live statistics


class RateSampler:
    """Samples the current model's totals once a second; rates over the last `window` seconds."""

    def __init__(self, proxy_fn, window=10.0, interval=1.0):
        self.proxy_fn = proxy_fn
        self.window = window
        self.interval = interval
        self.samples = collections.deque(maxlen=int(window / interval) + 2)
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="empanel-stats", daemon=True)
            self._thread.start()
        return self

    def stop(self):
        self._stop.set()

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self):
        proxy = self.proxy_fn()
        snap = proxy.snapshot(timeout=0.2) if proxy is not None else None
        if snap is None:
            return
        alias, stats, _ = snap
        if stats is None:
            return
        t = stats["total"]
        point = (time.monotonic(), alias, t["hits"], t["misses"], t["bytes_read"], t["read_s"])
        if self.samples and self.samples[-1][1] != alias:
            self.samples.clear()  # another model: its counters start over
        self.samples.append(point)

    def recent(self):
        """{"window_s", "bytes_read_per_s", "hit_rate", "read_gbps"} over the sampled window."""
        if len(self.samples) < 2:
            return {"window_s": 0.0, "bytes_read_per_s": 0.0, "hit_rate": None, "read_gbps": None}
        t0, _, h0, m0, b0, r0 = self.samples[0]
        t1, _, h1, m1, b1, r1 = self.samples[-1]
        dt = max(t1 - t0, 1e-9)
        return {"window_s": round(dt, 3), "bytes_read_per_s": (b1 - b0) / dt,
                "hit_rate": hit_rate(h1 - h0, m1 - m0, none=None),
                "read_gbps": (b1 - b0) / (r1 - r0) / 1e9 if r1 > r0 else None}


def stats_json(proxy, sampler):
    snap = proxy.snapshot() if proxy is not None else None
    if snap is None:
        raise HTTPException(status_code=503, detail="a model is loading")
    alias, stats, info = snap
    out = {"model": alias, "slot_pools": stats is not None,
           "memory": {"available_bytes": available_memory(), "floor_bytes": info.get("floor"),
                      "peak_rss_bytes": peak_rss()}}
    est = info.get("estimate")
    if est is not None:
        out["memory"]["estimated_bytes"] = est.host
    if stats is not None:
        t = dict(stats["total"])
        t.setdefault("read_gbps", t["bytes_read"] / t["read_s"] / 1e9 if t["read_s"] > 0 else 0.0)
        out["total"] = t
        out["layers"] = {str(il): row for il, row in stats["layers"].items()}
        out["recent"] = sampler.recent() if sampler is not None else None
    return out


def _label(value):
    return prometheus_label(value)  # escaped by the sidecar, as every label it writes (csrc/metrics.c)


def metrics_text(proxy, sampler):
    """Prometheus text exposition format 0.0.4."""
    data = stats_json(proxy, sampler)
    model = _label(data["model"])
    lines = []

    def metric(name, kind, help_text, rows):
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in rows:
            if value is None:
                continue
            text = ",".join(f'{k}="{v}"' for k, v in labels)
            # counts as integers (bytes pass 2**53 in long runs), times and rates as floats
            shown = str(value) if isinstance(value, int) else f"{float(value):.10g}"
            lines.append(f"{name}{{{text}}} {shown}" if text else f"{name} {shown}")

    def pool_families():
        # the model's series, written by the sidecar as for llama.cpp's programs (csrc/metrics.c),
        # under the lock that keeps the model (and its pools) from changing meanwhile (a model
        # swapped since the snapshot, or the lock not had: its slot_pools line alone)
        if not proxy._swap.acquire(timeout=1.0):
            return prometheus_pools([None], [data["model"]])
        try:
            alias, llm = proxy.current()
            experts = getattr(llm, "_experts", None) if data["slot_pools"] and alias == data["model"] else None
            return prometheus_pools([experts], [data["model"]])
        finally:
            proxy._swap.release()

    families = pool_families()
    if families:
        lines.append(families.rstrip("\n"))
    if data["slot_pools"]:
        recent = data.get("recent") or {}
        metric("empanel_read_bytes_per_second", "gauge",
               "Bytes of experts read per second over the last seconds (see window).",
               [((("model", model),), recent.get("bytes_read_per_s"))])
        metric("empanel_recent_hit_rate", "gauge", "Expert hit rate over the last seconds.",
               [((("model", model),), recent.get("hit_rate"))])
    mem = data["memory"]
    metric("empanel_memory_available_bytes", "gauge", "Memory available to the process (guard's view).",
           [((), mem.get("available_bytes"))])
    metric("empanel_memory_floor_bytes", "gauge", "Memory the guard keeps free.", [((), mem.get("floor_bytes"))])
    metric("empanel_peak_rss_bytes", "gauge", "Peak resident set size of the server.",
           [((), mem.get("peak_rss_bytes"))])
    return "\n".join(lines) + "\n"


def stats_router(sampler=None):
    router = APIRouter()

    @router.get("/v1/empanel/stats", tags=["empanel"], summary="Expert slot pool statistics")
    def empanel_stats():
        return stats_json(_app._llama_proxy, sampler)

    @router.get("/metrics", tags=["empanel"], summary="Prometheus metrics",
                response_class=PlainTextResponse)
    def metrics():
        return PlainTextResponse(metrics_text(_app._llama_proxy, sampler),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return router


# ---------------------------------------------------------------------------------------------


# the request models of llama_cpp.server's POST routes, by path
_REQUEST_MODELS = {
    "/v1/completions": "CreateCompletionRequest",
    "/v1/engines/copilot-codex/completions": "CreateCompletionRequest",
    "/v1/chat/completions": "CreateChatCompletionRequest",
    "/v1/embeddings": "CreateEmbeddingRequest",
}


class BadRequestGuard:
    """ASGI middleware: a POST to an OpenAI route whose body is not JSON, or not a valid request,
    is the client's error: 400 with what is wrong (llama_cpp.server answers both with 500). The
    body is read once and handed on unchanged."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in _REQUEST_MODELS:
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, receive, send)  # a disconnect: let the app see it
            body += message.get("body", b"")
            more = message.get("more_body", False)
        problem = _request_problem(scope["path"], body)
        if problem is not None:
            payload = json.dumps({"error": {"message": problem, "type": "invalid_request_error",
                                             "param": None, "code": None}}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def _request_problem(path, body):
    """What is wrong with a POST body for `path`, or None."""
    from llama_cpp.server import types
    from pydantic import ValidationError

    try:
        data = json.loads(body or b"null")
    except ValueError as e:
        return f"the request body is not valid JSON: {e}"
    if not isinstance(data, dict):
        return "the request body must be a JSON object"
    try:
        getattr(types, _REQUEST_MODELS[path])(**data)
    except ValidationError as e:
        errors = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()[:5])
        return f"invalid request: {errors}"
    except TypeError as e:
        return f"invalid request: {e}"
    return None


def create_app(server_settings: ServerSettings, model_settings: List[ModelSettings]):
    """llama_cpp.server's app, with our proxy as its model loader and our stats routes."""
    saved_proxy, saved_config = _app.LlamaProxy, os.environ.pop("CONFIG_FILE", None)
    _app.LlamaProxy = EmpanelLlamaProxy  # set_llama_proxy() builds the proxy from this name
    try:
        app = _app.create_app(server_settings=server_settings, model_settings=model_settings)
    finally:
        _app.LlamaProxy = saved_proxy
        if saved_config is not None:
            os.environ["CONFIG_FILE"] = saved_config  # create_app would re-read it with its own settings
    app.add_middleware(BadRequestGuard)  # malformed JSON and bad parameters: 400, not 500
    sampler = RateSampler(lambda: _app._llama_proxy).start()
    app.include_router(stats_router(sampler))
    app.state.empanel_sampler = sampler
    return app


def proxy():
    """The running app's EmpanelLlamaProxy."""
    return _app._llama_proxy
