"""Which model the server runs: load the version ``--model`` names into an Engine, follow the
alias and swap models live.

Live swap, as the deploy and rollback flows rely on it:

1. A poller thread reads the alias every ``serve.poll_interval_s`` (``check_for_update``).
2. When it points at another version, that version is downloaded, its manifest verified
   (sha256 of every file, by the Engine when ``serve.verify_artifact``) and a one-token
   warm-up run proves the graph executes. Only then does it become ``current``.
3. New requests lease ``current``; requests already holding a lease on the old model
   finish there. The old engine is shut down when its last lease is returned (or after
   ``serve.drain_timeout_s``), and its downloaded folder is deleted.
4. A version that fails to load is logged and remembered; the server keeps serving the
   old one and does not retry that version on every poll (POST /admin/reload does).

Resolving ``--model`` to a version and fetching its folder is serve/registry/resolver.py's job;
this module owns the engines: load, lease, swap, drain, free.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import shutil
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from serve.artifact import MANIFEST, sha256_file
from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.engine.stats import EngineStats
from serve.registry.resolver import ModelSource, ModelSourceError

log = logging.getLogger(__name__)


class NotReadyError(RuntimeError):
    """No model is loaded yet (HTTP 503)."""


@dataclass
class LoadedModel:
    """One engine and where it came from; leased by requests."""

    name: str
    version: str | None
    alias: str | None
    uri: str
    path: Path
    engine: Engine
    generation: int  # increases with every load, also when a local folder is reloaded
    loaded_at: float = field(default_factory=time.time)
    downloaded: bool = False
    # sha256 of manifest.json (which holds every file's sha256): the registry's `artifact_sha256` tag, so a
    # deploy can tell "version 2 of this store" from "version 2 of another store".
    artifact_sha256: str | None = None
    # what drafts for it (serve.speculative as resolved: off, prompt_lookup, the registered drafter "<model>/<version>"
    # that auto brought along with the version, or a folder)
    speculative: str = "off"
    leases: int = 0
    retired: bool = False  # no longer current: draining
    closed: bool = False  # engine shut down

    @property
    def key(self) -> str:
        """Identity for the result cache: changes whenever the served model changes."""
        return f"{self.name}:{self.version}:{self.generation}"

    @property
    def manifest(self) -> dict:
        return self.engine.manifest

    @property
    def chat_template(self) -> str | None:
        return self.engine.manifest.get("chat_template")


@dataclass
class ReloadResult:
    changed: bool
    version: str | None
    previous: str | None
    error: str | None = None


EngineFactory = Callable[[Path, ServeConfig], Engine]


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc's malloc_trim; a no-op elsewhere).

    glibc keeps the pages of a freed ONNX Runtime session in its heap: without this the soak's RSS
    rose ~200 MiB with every swap of a SmolLM2 artifact, flat in between.
    """
    gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


def _default_engine_factory(path: Path, config: ServeConfig) -> Engine:
    return Engine(path, config)


class ModelManager:
    """Holds the current model, swaps it, drains and frees the old ones.

    ``on_swap`` callbacks run (in the loading thread) after a new model became current,
    with (new, old); ``on_retire`` callbacks run just before an old engine is shut down
    (metrics fold its counters into their totals there).
    """

    def __init__(self, source: ModelSource | str, config: ServeConfig | None = None, *,
                 engine_factory: EngineFactory = _default_engine_factory, tracking_uri: str | None = None,
                 served_name: str | None = None):
        self.source = (source if isinstance(source, ModelSource)
                       else ModelSource(source, tracking_uri, served_name=served_name))
        self.config = config or ServeConfig()
        self.source.wants_drafter = self.config.speculative == "auto"
        self._factory = engine_factory
        self._lock = threading.Condition()
        self._load_lock = threading.Lock()  # one load at a time (poller vs admin reload)
        self._current: LoadedModel | None = None
        self._draining: list[LoadedModel] = []
        self._generation = 0
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self.failed_version: str | None = None
        self.last_error: str | None = None
        self.num_swaps = 0
        self.num_load_failures = 0
        self.num_polls = 0  # alias polls finished: "after N polls" without guessing how long N take
        self.on_swap: list[Callable[[LoadedModel, LoadedModel | None], None]] = []
        self.on_retire: list[Callable[[LoadedModel], None]] = []

    # ---- leasing ---------------------------------------------------------------------------
    @property
    def current(self) -> LoadedModel | None:
        return self._current

    @property
    def ready(self) -> bool:
        return self._current is not None

    def live_models(self) -> list[LoadedModel]:
        """The current model and those still draining (for metrics)."""
        with self._lock:
            return ([self._current] if self._current else []) + list(self._draining)

    def acquire(self) -> LoadedModel:
        with self._lock:
            lm = self._current
            if lm is None:
                raise NotReadyError(self.last_error or "the model is still loading")
            lm.leases += 1
            return lm

    def release(self, lm: LoadedModel) -> None:
        with self._lock:
            lm.leases -= 1
            self._lock.notify_all()

    @contextmanager
    def lease(self):
        lm = self.acquire()
        try:
            yield lm
        finally:
            self.release(lm)

    # ---- loading ---------------------------------------------------------------------------
    def _load(self, version: str | None) -> LoadedModel:
        fetched = self.source.fetch(version)
        config, drafts = self.config, self.config.speculative
        if config.speculative == "auto":  # the version's own drafter (with prompt lookup), else prompt lookup
            config = config.model_copy(update={"speculative": str(fetched.drafter) if fetched.drafter
                                               else "prompt_lookup"})
            drafts = fetched.drafter_link or config.speculative
        try:
            engine = self._factory(fetched.path, config)
        except Exception as e:
            if fetched.downloaded:
                shutil.rmtree(fetched.path, ignore_errors=True)
            raise ModelSourceError(f"loading {fetched.name} version {version} from {fetched.path} failed: "
                                   f"{type(e).__name__}: {e}") from e
        try:
            # One greedy token proves the graph runs before any user request is routed to it.
            bos = engine.manifest.get("bos_token_id")
            engine.generate([int(bos) if bos is not None else 0], SamplingParams.greedy(1), timeout=120)
        except Exception as e:
            engine.shutdown()
            if fetched.downloaded:
                shutil.rmtree(fetched.path, ignore_errors=True)
            raise ModelSourceError(f"{fetched.name} version {version}: warm-up generation failed: "
                                   f"{type(e).__name__}: {e}") from e
        self._generation += 1
        return LoadedModel(fetched.name, fetched.version, fetched.alias, self.source.spec.uri, fetched.path, engine,
                           self._generation, downloaded=fetched.downloaded,
                           artifact_sha256=sha256_file(Path(fetched.path) / MANIFEST), speculative=drafts)

    def load_initial(self) -> LoadedModel:
        """Load the model the source names now; raises ModelSourceError when it cannot."""
        result = self.reload(force=True)
        if result.error:
            raise ModelSourceError(result.error)
        assert self._current is not None
        return self._current

    def reload(self, force: bool = False) -> ReloadResult:
        """Load the wanted version if it differs from the served one (always when ``force``)."""
        with self._load_lock:
            cur = self._current
            previous = cur.version if cur else None
            try:
                wanted = self.source.wanted_version()
            except Exception as e:  # noqa: BLE001 - keep serving what we have
                return self._failed(None, previous, e)
            if not force and cur is not None and wanted == cur.version:
                # The alias is back on what we serve: a later move to the failed version deserves a retry.
                self.failed_version = self.last_error = None
                return ReloadResult(False, wanted, previous)
            if not force and wanted is not None and wanted == self.failed_version:
                return ReloadResult(False, previous, previous, self.last_error)
            t0 = time.perf_counter()
            try:
                new = self._load(wanted)
            except Exception as e:  # noqa: BLE001
                return self._failed(wanted, previous, e)
            self._install(new)
            log.info("now serving %s version %s (loaded in %.2f s; previous %s)", new.name, new.version,
                     time.perf_counter() - t0, previous)
            return ReloadResult(True, new.version, previous)

    def _failed(self, version: str | None, previous: str | None, e: Exception) -> ReloadResult:
        msg = str(e) if isinstance(e, ModelSourceError) else f"{type(e).__name__}: {e}"
        if self._current is not None:
            msg += f"; still serving version {self._current.version} of {self._current.name}"
        if version is not None:
            self.failed_version = version
            self.num_load_failures += 1
            log.error("model load failed: %s", msg)
        elif msg != self.last_error:
            # Resolving the alias failed (registry down, alias deleted): say so once, not on every poll.
            log.warning("cannot resolve %s: %s", self.source.spec.uri, msg)
        self.last_error = msg
        return ReloadResult(False, previous, previous, msg)

    def _install(self, new: LoadedModel) -> None:
        with self._lock:
            old = self._current
            self._current = new
            if old is not None:
                old.retired = True
                self._draining.append(old)
            self.failed_version = None
            self.last_error = None
            if old is not None:
                self.num_swaps += 1
        for cb in self.on_swap:
            try:
                cb(new, old)
            except Exception:  # noqa: BLE001 - a metrics hook must not undo a swap
                log.exception("on_swap callback failed")
        if old is not None:
            threading.Thread(target=self._drain, args=(old,), name=f"drain-{old.key}", daemon=True).start()

    def _drain(self, old: LoadedModel) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        with self._lock:
            while old.leases > 0 and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("%s version %s: %d requests still running after drain_timeout_s=%.0f; shutting it "
                                "down anyway", old.name, old.version, old.leases, self.config.drain_timeout_s)
                    break
                self._lock.wait(min(left, 0.5))
        self._retire(old)
        del old  # the last reference: the engine, its session and KV buffers go now
        release_freed_memory()

    def _close(self, lm: LoadedModel) -> None:
        """Fold its stats into the totals and shut the engine down, exactly once."""
        with self._lock:
            if lm.closed:
                return
            lm.closed = True
        for cb in self.on_retire:
            try:
                cb(lm)
            except Exception:  # noqa: BLE001 - a metrics hook must not keep an engine alive
                log.exception("on_retire callback failed")
        lm.engine.shutdown()

    def _retire(self, old: LoadedModel) -> None:
        self._close(old)
        with self._lock:
            if old in self._draining:
                self._draining.remove(old)
            self._lock.notify_all()
        if old.downloaded:
            shutil.rmtree(old.path, ignore_errors=True)
        log.info("retired %s version %s", old.name, old.version)

    def wait_drained(self, timeout: float = 10.0) -> bool:
        """Block until no old model is draining (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._draining:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def load_until_ready(self) -> None:
        """First load in the background (the API answers /health meanwhile); retried every poll interval."""
        while not self.ready and not self._stop.is_set():
            if self.reload(force=True).error:
                self._stop.wait(self.config.poll_interval_s)

    # ---- polling ---------------------------------------------------------------------------
    def start_polling(self) -> None:
        """Follow the alias (no-op for a local folder or a pinned version)."""
        if not self.source.spec.follows_alias or self._poller is not None:
            return
        self._poller = threading.Thread(target=self._poll_loop, name="alias-poller", daemon=True)
        self._poller.start()

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.config.poll_interval_s):
            try:
                if self.reload().changed:
                    self._record_champion()
            except Exception:  # noqa: BLE001 - the poller must survive anything
                log.exception("alias poll failed")
            self.num_polls += 1

    def _record_champion(self) -> None:
        """A move of ``champion`` this server followed is recorded in the champion history when no one has (a move
        made by hand in the UI), so the registry's pages name the version it now serves."""
        spec = self.source.spec
        if spec.alias != "champion":
            return
        from serve.registry.champion import sync

        try:
            if sync(spec.name, "server poll"):
                log.info("%s@champion was moved by hand; recorded in its champion history", spec.name)
        except Exception as e:  # noqa: BLE001 - labels only; serving goes on (a read-only registry user, say)
            log.warning("could not record the champion move of %s: %s", spec.name, e)

    def stats(self) -> list[EngineStats]:
        return [lm.engine.stats() for lm in self.live_models()]

    def shutdown(self) -> None:
        """Stop polling, shut every engine down (unfinished requests end 'cancelled'), delete downloads."""
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5)
            self._poller = None
        with self._load_lock:
            with self._lock:
                models = ([self._current] if self._current else []) + list(self._draining)
                self._current = None
                self._draining = []
                self._lock.notify_all()
            for lm in models:
                self._close(lm)
                if lm.downloaded:
                    shutil.rmtree(lm.path, ignore_errors=True)
        self.source.cleanup()
