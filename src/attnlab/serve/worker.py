"""The engine's thread: one background thread runs `Engine.step` (src/attnlab/decode/engine.py)
while there is work and sleeps when there is none; HTTP handlers on the event loop submit
requests and read their tokens from an asyncio queue each.

    handler ──submit──► Engine inbox ──step()──► on_event ──call_soon_threadsafe──► its queue
    handler ──cancel──► (client gone, stop string hit) blocks freed at the next step

A failing step (a bug, memory) must not take the server down: every request in flight gets the
error as its last event and is cancelled; the thread keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections.abc import Callable
from typing import Literal

from ..decode.engine import Engine, Event, Request
from ..graphs import compiled_graphs

StepKind = Literal["decode", "decode+prefill", "prefill"]

log = logging.getLogger("attnlab.serve")


class EngineWorker:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        engine.on_event = self._dispatch
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        # every engine step that computed something, timed: (what it computed, seconds)
        self.on_step: Callable[[StepKind, float], None] | None = None
        self._thread = threading.Thread(target=self._loop, name="attnlab-engine", daemon=True)
        self._thread.start()

    def submit(self, req: Request, *, context: int | None = None) -> tuple[int, asyncio.Queue]:
        """Queue `req` (RequestError if it can never be served within `context` tokens, the
        engine's rules); its id and event queue. Call from the event loop."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:  # registered before the engine thread can emit its first token
            rid = self.engine.submit(req, context=context)
            self._queues[rid] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        return rid, queue

    def cancel(self, rid: int) -> None:
        with self._lock:
            if self._queues.pop(rid, None) is None:
                return  # already finished
        self.engine.cancel(rid)
        self._wake.set()

    def waiting(self) -> int:
        """Requests submitted and not yet running (the engine's inbox and queue)."""
        return self.engine.queued

    def stats(self) -> dict:
        c = self.engine.cache
        return {
            "running": len(self.engine.running),
            "waiting": self.waiting(),  # submitted, not running (the inbox included)
            "blocks_total": c.num_blocks,
            "blocks_free": c.available,  # free, or cached with no request holding them
            "blocks_cached": len(c.prefix.entries) if c.prefix is not None else 0,
            "prefix_hit_blocks": c.prefix.hits if c.prefix is not None else 0,
            "prefix_lookup_blocks": c.prefix.lookups if c.prefix is not None else 0,
            "block_size": c.block_size,
            "preemptions": self.engine.preemptions,
            "cancelled": self.engine.cancelled,  # requests dropped before their end
            "graph_compiles": compiled_graphs(),  # torch.compile graphs built in this process
            "graph_compiles_serving": self.engine.compiles_since_start,  # ... after warm-up
        }

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _dispatch(self, event: Event | BaseException, rid: int | None = None) -> None:
        rid = event.rid if isinstance(event, Event) else rid
        with self._lock:
            entry = self._queues.get(rid)
            if entry is not None and (not isinstance(event, Event) or event.finish_reason):
                del self._queues[rid]
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, event)

    def _loop(self) -> None:
        while not self._stop:
            if not self.engine.has_work:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                start = time.perf_counter()
                self.engine.step()
                rows, prompt = self.engine.last_step
                if self.on_step is not None and (rows or prompt):
                    kind = "decode+prefill" if rows and prompt else "decode" if rows else "prefill"
                    self.on_step(kind, time.perf_counter() - start)
            except Exception as err:  # keep serving: fail what is in flight, not the server
                log.error("engine step failed:\n%s", traceback.format_exc())
                with self._lock:
                    rids = list(self._queues)
                for rid in rids:
                    self._dispatch(RuntimeError(f"the engine failed: {err}"), rid)
                    self.engine.cancel(rid)
