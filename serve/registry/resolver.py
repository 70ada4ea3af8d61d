"""Where the server's model comes from: parse ``--model``, resolve it to a version, fetch that version.

One job: turn a ``--model`` value (``models:/NAME@alias``, ``models:/NAME/VERSION`` or a local
artifact folder) into a version number and a local folder an Engine can load; loading,
swapping and draining engines is serve/registry/source.py's. The registry is reached only
through ``serve.registry.client`` (which imports MLflow lazily), so serving a local folder
needs no MLflow at all. A downloaded version gets a folder of its own under the download
root (deleted by ``cleanup`` when the root is ours); a local folder is used in place. A server killed
before its cleanup (a Ray Serve replica is killed, not closed) leaves its root behind: the next server
on the machine deletes the roots whose process is gone (``sweep_orphan_roots``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MODELS_SCHEME = "models:/"
ROOT_PREFIX = "compressor-serve-"  # then the owning process id, "-", mkdtemp's letters


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_orphan_roots(tmp: str | Path | None = None) -> list[Path]:
    """Delete download roots under the temp folder whose owning process no longer runs; returns them. Roots
    named without a process id (written before ids were part of the name) are left alone."""
    gone = []
    for root in Path(tmp or tempfile.gettempdir()).glob(f"{ROOT_PREFIX}*"):
        pid = root.name[len(ROOT_PREFIX):].split("-", 1)[0]
        if root.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(root, ignore_errors=True)
            gone.append(root)
    return gone


class ModelSourceError(RuntimeError):
    """The model URI cannot be resolved or loaded; the message says what to fix."""


@dataclass(frozen=True)
class ModelSpec:
    """A parsed ``--model`` value."""

    uri: str
    name: str  # registered model name, or the folder's name
    alias: str | None = None  # models:/NAME@alias: follow it
    version: str | None = None  # models:/NAME/3: pinned
    path: Path | None = None  # a local artifact folder

    @property
    def is_registry(self) -> bool:
        return self.path is None

    @property
    def follows_alias(self) -> bool:
        return self.alias is not None


def parse_model_uri(uri: str) -> ModelSpec:
    """``models:/NAME@alias``, ``models:/NAME/VERSION`` or a path to an artifact folder."""
    if uri.startswith(MODELS_SCHEME):
        rest = uri[len(MODELS_SCHEME):].strip("/")
        if "@" in rest:
            name, alias = rest.split("@", 1)
            if name and alias and "/" not in name:
                return ModelSpec(uri, name, alias=alias)
        elif "/" in rest:
            name, version = rest.split("/", 1)
            if name and version.isdigit():
                return ModelSpec(uri, name, version=version)
        raise ModelSourceError(f"model {uri!r}: expected models:/NAME@ALIAS (e.g. models:/smollm2-135m@champion), "
                               f"models:/NAME/VERSION or a local artifact folder")
    path = Path(uri).expanduser().resolve()
    if not path.is_dir():
        raise ModelSourceError(f"model {uri!r}: no such folder; pass an artifact folder (with manifest.json) "
                               f"or models:/NAME@ALIAS")
    if not (path / "manifest.json").is_file():
        raise ModelSourceError(f"model {uri!r}: {path} has no manifest.json; it is not an artifact folder "
                               f"written by the pipeline")
    return ModelSpec(uri, path.name, path=path)


@dataclass
class LocalVersion:
    """A version on local disk, ready for an Engine."""

    name: str
    version: str | None
    alias: str | None
    path: Path
    downloaded: bool  # we own the folder and delete it when the model retires
    # the version's own drafter (its ``drafter`` tag, flows/draft.py), fetched beside it for serve.speculative auto
    drafter: Path | None = None
    drafter_link: str | None = None  # its registered name, "<model>/<version>"


class ModelSource:
    """Resolves a ModelSpec to versions and local folders (the registry side of the swap)."""

    def __init__(self, spec: ModelSpec | str, tracking_uri: str | None = None, download_root: str | Path | None = None,
                 served_name: str | None = None):
        self.spec = parse_model_uri(spec) if isinstance(spec, str) else spec
        # The id clients use in "model" and see in /v1/models; default: the registered or folder name.
        self.served_name = served_name or self.spec.name
        self.tracking_uri = tracking_uri
        self._download_root = Path(download_root) if download_root else None
        self._own_root = download_root is None
        self._configured = False

    def _registry(self):
        from serve.registry import client as registry

        if not self._configured:
            os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no tqdm bars in server logs
            registry.connect(self.tracking_uri)
            self._configured = True
        return registry

    def wanted_version(self) -> str | None:
        """The version the server should run now (None for a local folder)."""
        spec = self.spec
        if not spec.is_registry:
            return None
        if spec.version is not None:
            return spec.version
        v = self._registry().version_for_alias(spec.name, spec.alias)
        if v is None:
            raise ModelSourceError(f"registered model {spec.name!r} has no alias {spec.alias!r} (or the registry "
                                   f"is unreachable); set it with `compressor registry promote` or check "
                                   f"MLFLOW_TRACKING_URI")
        return str(v.version)

    def fetch(self, version: str | None) -> LocalVersion:
        spec = self.spec
        if not spec.is_registry:
            return LocalVersion(self.served_name, None, None, spec.path, downloaded=False)
        if self._download_root is None:
            sweep_orphan_roots()
            self._download_root = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-"))
        dst = self._download_root / f"{spec.name}-v{version}-{time.monotonic_ns()}"
        dst.mkdir(parents=True)
        try:
            path = self._registry().download(f"{MODELS_SCHEME}{spec.name}/{version}", dst)
        except Exception as e:
            shutil.rmtree(dst, ignore_errors=True)
            raise ModelSourceError(f"downloading {spec.name} version {version} failed: {type(e).__name__}: {e}") from e
        drafter, link = self._fetch_drafter(version, dst) if self.wants_drafter else (None, None)
        return LocalVersion(self.served_name, str(version), spec.alias, Path(path), downloaded=True,
                            drafter=drafter, drafter_link=link)

    wants_drafter = False  # set by the server when serve.speculative is auto

    def _fetch_drafter(self, version: str, dst: Path) -> tuple[Path | None, str | None]:
        """The drafter the version links to (tag ``drafter``: "<model>/<version>"), downloaded into ``dst``, and that
        link; None without one, or when it cannot be fetched (the target is served without it, with a line in the
        log)."""
        import logging

        log = logging.getLogger(__name__)
        registry = self._registry()
        try:
            link = registry.get_version(self.spec.name, version).tags.get("drafter")
            if not link:
                return None, None
            path = Path(registry.download(f"{MODELS_SCHEME}{link}", dst / "drafter"))
            return (path, link) if (path / "manifest.json").is_file() else (None, None)
        except Exception as e:  # noqa: BLE001 - a drafter only changes the speed: serve without it
            log.warning("the drafter of %s version %s could not be fetched (%s: %s); serving without it",
                        self.spec.name, version, type(e).__name__, e)
            return None, None

    def cleanup(self) -> None:
        if self._own_root and self._download_root is not None:
            shutil.rmtree(self._download_root, ignore_errors=True)
