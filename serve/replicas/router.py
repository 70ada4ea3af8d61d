"""Ray Serve request routers for the engine replicas (serve/replicas/deploy.py): prefix-aware, round-robin, least-loaded.

Plugged in through Ray Serve's request router API (``RequestRouterConfig(request_router_class=...)``); the
router runs inside the ingress's process, in its handle to the engine deployment, and reads the
``ForwardedRequest`` the ingress built (serve/replicas/forwarding.py).

``prefix`` (the default): the prompt's whole 64-character blocks are hashed as a chain (the same rule as the
engine's prefix cache, which keys full KV blocks by their parent's hash). The replica that last took the longest
matching chain gets the request, so requests sharing a system prompt or a conversation's history meet their KV
blocks already cached; Ray's ``PrefixCacheAffinityRouter`` does the same with a prefix tree, but needs Ray Serve
LLM's vLLM or SGLang. When that replica has ``imbalance`` more requests in flight than the least loaded one,
or for a prompt no replica has seen, the least loaded replica takes it (ties broken by a hash of the first block,
so identical short prompts also meet their result cache) and becomes the chain's owner. The later ranks are the
other replicas, least loaded first, for when the preferred one is at ``max_ongoing_requests``.

``round_robin``: each replica in turn, whatever the prompt (the baseline the prefix-hit rate is measured against).
``least_loaded``: fewest requests in flight.

A request with ``target`` set goes to that replica only (the ingress's per-replica /health and /metrics).

The table lives in the ingress's process. When the ingress restarts, it asks every replica for the chains it has
served (serve/replicas/deploy.py) and the router takes them as owners, so a conversation keeps meeting its cached blocks.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# Ray pickles this module by value into the caller's process (RequestRouterConfig): state shared with the ingress
# lives in serve/replicas/forwarding.py, reached through its functions (pickled by reference).
from serve.replicas.forwarding import POLICIES, ForwardedRequest, count_routing, set_live_replicas, take_chains

log = logging.getLogger(__name__)

MAX_CHAINS = 200_000  # block digests remembered (LRU); ~60 bytes each

def _forwarded(pr: PendingRequest | None) -> ForwardedRequest | None:
    if pr is None:
        return None
    for a in (*pr.args, *pr.kwargs.values()):
        if isinstance(a, ForwardedRequest):
            return a
    return None


def _score(key: bytes, replica: ReplicaID) -> bytes:
    """Rendezvous hashing: each key's order of replicas, stable when others come and go."""
    return hashlib.blake2b(key + replica.unique_id.encode(), digest_size=8).digest()


class ReplicaRouter(RequestRouter):
    """See the module docstring. ``request_router_kwargs``: policy, imbalance."""

    def initialize_state(self, policy: str = "prefix", imbalance: int = 16, **kwargs) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r}: use one of {', '.join(POLICIES)}")
        self.policy, self.imbalance = policy, int(imbalance)
        self._owner: OrderedDict[bytes, ReplicaID] = OrderedDict()
        self._rr = 0
        self._key = (self._deployment_id.app_name, self._deployment_id.name)

    def _count(self, what: str, n: int = 1) -> None:
        count_routing(self._key, what, n)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        set_live_replicas(self._key, sorted(r.replica_id.unique_id for r in replicas))
        gone = {rid for rid in set(self._owner.values()) if rid not in self._replica_id_set}
        if gone:  # a dead replica's prefixes are free again
            for h in [h for h, rid in self._owner.items() if rid in gone]:
                del self._owner[h]

    def _restore(self) -> None:
        """Chains the replicas reported after the ingress (re)started (serve/replicas/deploy.Ingress._restore_routes): an
        owner for each chain this router has not seen yet, kept behind its own newer claims in the LRU order."""
        offered = take_chains(self._key)
        if not offered:
            return
        live = {rid.unique_id: rid for rid in self._replica_id_set}
        n = 0
        for h, uid in offered:
            if h not in self._owner and uid in live:
                self._owner[h] = live[uid]
                self._owner.move_to_end(h, last=False)
                n += 1
        while len(self._owner) > MAX_CHAINS:
            self._owner.popitem(last=False)
        self._count("restored", n)

    def _load(self, r: RunningReplica) -> int:
        q = self._replica_queue_len_cache.get(r.replica_id)
        return 0 if q is None else q

    def _claim(self, fwd: ForwardedRequest, rid: ReplicaID) -> None:
        for h in fwd.prefix_hashes:
            self._owner[h] = rid
            self._owner.move_to_end(h)
        while len(self._owner) > MAX_CHAINS:
            self._owner.popitem(last=False)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._restore()
        fwd = _forwarded(pending_request)
        if fwd is not None and fwd.target is not None:
            for r in candidate_replicas:
                if r.replica_id.unique_id == fwd.target:
                    return [[r]]
            # Gone: any replica answers, and says 404 because it is not the target (never an endless retry).
            return [list(candidate_replicas)]
        if self.policy == "round_robin":
            order = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            first = order[self._rr % len(order)]
            self._rr += 1
            return [[first], [r for r in order if r is not first]]
        key = (fwd.prefix_hashes[0] if fwd and fwd.prefix_hashes else fwd.short_key if fwd else b"") or b"-"
        ranked = sorted(candidate_replicas, key=lambda r: (self._load(r), _score(key, r.replica_id)))
        if self.policy == "least_loaded" or fwd is None or not fwd.prefix_hashes:
            if self.policy == "prefix":
                self._count("no_prefix")
            return [[r] for r in ranked]
        by_id = {r.replica_id: r for r in candidate_replicas}
        owner = None
        for h in reversed(fwd.prefix_hashes):  # the longest chain some live replica holds
            rid = self._owner.get(h)
            if rid is not None and rid in by_id:
                owner = by_id[rid]
                break
        preferred = ranked[0]
        if owner is not None:
            if self._load(owner) - self._load(ranked[0]) <= self.imbalance:
                preferred = owner
                self._count("affinity")
            else:
                self._count("imbalanced")
        else:
            self._count("new_prefix")
        # Claimed now, before any await: requests routed concurrently with this one see the owner.
        self._claim(fwd, preferred.replica_id)
        return [[preferred]] + [[r] for r in ranked if r is not preferred]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        fwd = _forwarded(pending_request)
        if fwd is not None and fwd.target is not None:
            self._count("targeted")
            return
        self._count(f"routed:{replica_id.unique_id}")
        if (fwd is not None and self.policy == "prefix" and fwd.prefix_hashes
                and self._owner.get(fwd.prefix_hashes[-1]) != replica_id):
            self._claim(fwd, replica_id)  # it went to a later rank: the blocks are cached there now
