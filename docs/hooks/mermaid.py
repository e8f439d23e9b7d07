"""MkDocs hook: puts mermaid, which draws the site's diagrams, into the built site.

The repository holds only the diagrams' sources (```mermaid blocks in the pages) and the few
lines that start the drawing (``assets/javascripts/diagrams.js``). Mermaid itself (MIT) comes
from the npm registry at build time, pinned by version and checked against the registry's
sha512 before use, and is cached between builds under ``$XDG_CACHE_HOME/celery-dflock-docs``
(``~/.cache`` by default). The built site then loads nothing from elsewhere.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import tarfile
import urllib.request
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

MERMAID_VERSION = "11.17.2"
TARBALL = f"https://registry.npmjs.org/mermaid/-/mermaid-{MERMAID_VERSION}.tgz"
INTEGRITY = (
    "sha512-"
    "V6K3C8EBdEsPFZXSKMJe6ppQOENxuHARr9GvHX4hh47lAbhMRD9qf4oEK7LoaRQxULMa80/qt5gHO73aCleBBg=="
)
"""The registry's ``dist.integrity`` of that tarball."""
MEMBER = "package/dist/mermaid.min.js"
SITE_PATH = f"assets/javascripts/mermaid-{MERMAID_VERSION}.min.js"
"""Where the site loads it from (``extra_javascript`` in mkdocs.yml names the same path)."""


def cached_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "celery-dflock-docs" / f"mermaid-{MERMAID_VERSION}.min.js"


def _download() -> bytes:
    try:
        with urllib.request.urlopen(TARBALL, timeout=120) as reply:
            data: bytes = reply.read()
    except OSError as exc:
        raise PluginError(
            f"the docs' diagrams need mermaid {MERMAID_VERSION} from {TARBALL}, which could "
            f"not be fetched ({exc}); build with a network connection, or put its "
            f"{MEMBER} at {cached_path()}"
        ) from exc
    digest = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
    if digest != INTEGRITY:
        raise PluginError(f"{TARBALL} is not the published tarball: its digest is {digest}")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        member = tar.extractfile(MEMBER)
        if member is None:
            raise PluginError(f"{TARBALL} holds no {MEMBER}")
        return member.read()


def mermaid_js() -> bytes:
    """Mermaid's browser bundle: from the cache, or downloaded, checked and cached."""
    cached = cached_path()
    if cached.is_file():
        return cached.read_bytes()
    script = _download()
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    partial.write_bytes(script)
    os.replace(partial, cached)
    return script


def on_post_build(config: Any, **kwargs: Any) -> None:
    target = Path(config["site_dir"]) / SITE_PATH
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(mermaid_js())
