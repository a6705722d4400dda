"""The node cache's disk layout, and the labels and annotations that name what it holds.

The node agent writes the layout (nodeagent/cache.py, views.py, evict.py); prewarm reads a
replica's view of it (prewarm/cachewait.py); the operator renders the labels and the annotation.

    <root>/sha256/<digest>            verified bytes only: a name here means "this hash"
    <root>/sha256/<digest>.partial    a download in progress (resumed by the next attempt)
    <root>/failed/<digest>            the termination line of a download that failed for good
    <root>/waiting/<digest>           why a download waits (a window), for prewarm's message
    <root>/used/<digest>              when a pod on this node last named it (eviction)
    <root>/views/<digest>/            one replica's view of one digest (below)
        data, data.partial, failed, waiting   hard links / copies of the four above
    <root>/adapters/<namespace>/<name>/<digest>
                                      one InferenceDeployment's LoRA adapters (http source):
                                      hard links to the verified blobs of its own adapters only
"""

from __future__ import annotations

from pathlib import Path

BLOBS_DIR = "sha256"
FAILED_DIR = "failed"
WAITING_DIR = "waiting"
USED_DIR = "used"
# A replica of an http source mounts, per digest of its files, `<cache>/views/<digest>`: the node
# agent's view holding that one file (`data`, a hard link to the verified blob), its download's
# `data.partial`, and `failed`/`waiting` lines; never the cache itself (nodeagent/views.py).
VIEWS_DIR = "views"
VIEW_DATA = "data"
# An http source's LoRA adapters (spec.adapters[].url): per InferenceDeployment, one directory
# `<cache>/adapters/<namespace>/<name>/` holding `<digest>`, a hard link to each verified blob of
# that object's adapters (and nothing else), mounted read-only into its runtime containers.
# Per object, not per digest, so an adapter added to the spec appears in a mount the pod already
# has: hot plug without a new volume (nodeagent/adapterviews.py, render._adapters_view).
ADAPTERS_DIR = "adapters"
VIEW_FAILED = FAILED_DIR
VIEW_WAITING = WAITING_DIR
PARTIAL_SUFFIX = ".partial"
HEX = frozenset("0123456789abcdef")


def adapters_view(root: str | Path, namespace: str, name: str) -> Path:
    """`<root>/adapters/<namespace>/<name>`: one InferenceDeployment's adapters view."""
    return Path(root) / ADAPTERS_DIR / namespace / name


def is_digest(name: str) -> bool:
    """A lowercase hex sha256: the only names the cache's directories hold (besides partials)."""
    return len(name) == 64 and all(c in HEX for c in name)


def partial_name(name: str) -> str:
    return f"{name}{PARTIAL_SUFFIX}"


def entry_size(path: Path) -> int:
    """The size of a cache file, 0 when it is not there (yet, or any more: an eviction or a
    finished download may move it between a listing and this call)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


# What the node agent fetches comes from an InferenceDeployment's own spec (validated by its
# CRD), never from anything a pod author writes: the pod names its InferenceDeployment with
# INSTANCE_LABEL, and the agent reads that object in the pod's own namespace (nodeagent/fetcher).
# A pod can so name only a spec of its own namespace, whose author could run it anyway.
INSTANCE_LABEL = "ember.dev/instance"
# On a pod whose model comes from an http source: a digest of its fetch list (`fetch_hash`). It
# says "read my InferenceDeployment's spec" (pods without it cost the agent nothing) and,
# being in the pod template, rolls the pods when a URL changes. Its value is never trusted.
FETCH_HASH_ANNOTATION = "ember.dev/model-fetch-hash"
# The node agent's live report of a waiting replica's download, on its pod (nodeagent/podprogress).
MODEL_DOWNLOAD_CONDITION = "ember.dev/ModelDownload"
# On a Node whose agent holds a file in its cache: `cache.ember.dev/<first 16 hex of the
# sha256>: "true"` (a sha256 does not fit a label name; 64 bits tell a fleet's models apart).
# The agent sets and removes it; the operator prefers nodes that carry it (nodeAffinity).
CACHE_LABEL_PREFIX = "cache.ember.dev/"
CACHE_LABEL_DIGEST = 16


def cache_label(sha256: str) -> str:
    return f"{CACHE_LABEL_PREFIX}{sha256[:CACHE_LABEL_DIGEST]}"
