"""Co-activation clustering of one (sequence, layer)'s KV groups, and their placement over N paths (Swarm §5).

Entries are groups: record g holds tokens [gG, (g+1)G).  The prompt's last W queries say which groups a
step picks (KVSwap's grouped rule, ``observation_picks``); groups picked by the same queries are clustered
(``coactivation_clusters``, Swarm Alg. 1) and each cluster is dealt over the paths so that one activation
reads from every device at once, in one larger request per device (``place``).  Groups no query picked
are cold: striped in token order after the clusters, as a plain KVSwap store lays everything out.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch


def observation_picks(q: torch.Tensor, k: torch.Tensor, group_tokens: int, picked_groups: int, first_group: int,
                      end_group: int, scaling: float) -> np.ndarray:
    """bool [W, n_groups]: the groups each of the prompt's last W queries q [H, W, d] would pick among
    ``first_group <= g < end_group`` of the keys k [H_kv, T, d] (n_groups = T // G: a partial last group
    is never on disk).  Raw logits summed over heads, ReduceMax per group, top ``picked_groups``: the rule the
    decode-time selector applies, so the picks are the activations decoding will see.  Causal: the
    query at position T - W + w sees keys up to its own position only."""
    n_heads, n_obs, head_dim = q.shape
    n_kv_heads, n_tokens, _ = k.shape
    if n_heads % n_kv_heads or k.shape[2] != head_dim:
        raise ValueError(f"queries [{n_heads}, W, {head_dim}] do not fit keys {list(k.shape)} "
                         "(GQA needs H % H_kv == 0)")
    if n_obs > n_tokens or first_group < 0 or picked_groups < 0 or group_tokens < 1:
        raise ValueError(f"bad observation: W={n_obs} queries over T={n_tokens} keys, G={group_tokens}, "
                         f"first_group={first_group}, picked_groups={picked_groups}")
    n_groups = n_tokens // group_tokens
    picks = np.zeros((n_obs, n_groups), dtype=bool)
    end_group = min(end_group, n_groups)
    if picked_groups == 0 or end_group <= first_group:
        return picks
    accumulate = torch.promote_types(k.dtype, torch.float32)
    compute = k.dtype if k.is_cuda else accumulate  # CPU half-precision matmuls are several times slower
    summed = q.reshape(n_kv_heads, n_heads // n_kv_heads, n_obs, head_dim).to(accumulate).sum(dim=1).to(compute)
    keys = k[:, : end_group * group_tokens].to(compute)
    scores = torch.bmm(summed, keys.transpose(1, 2)).to(accumulate).sum(dim=0) * scaling  # [W, end_group * G]
    position = torch.arange(n_tokens - n_obs, n_tokens, device=k.device)[:, None]
    scores.masked_fill_(torch.arange(scores.shape[1], device=k.device) > position, float("-inf"))
    group_scores = scores.view(n_obs, end_group, group_tokens).amax(dim=-1)[:, first_group:]
    top = group_scores.topk(min(picked_groups, group_scores.shape[1]), dim=-1)
    rows = torch.arange(n_obs, device=k.device)[:, None].expand_as(top.indices)
    seen = top.values > float("-inf")  # a query earlier than a group sees none of it
    picks[rows[seen].cpu().numpy(), top.indices[seen].cpu().numpy() + first_group] = True
    return picks


@dataclass
class Clusters:
    """Alg. 1's result for one (sequence, layer).  ``members[i]`` starts with its medoid; a group may be a
    member of several clusters (a replica candidate); ``cold`` were never picked (token order)."""

    members: list[np.ndarray]
    medoids: np.ndarray
    cold: np.ndarray
    activation: np.ndarray  # picks per group over the observations

    def memberships(self) -> np.ndarray:
        """How many clusters each group belongs to (0 for cold groups)."""
        if not self.members:
            return np.zeros(len(self.activation), dtype=np.int64)
        return np.bincount(np.concatenate(self.members), minlength=len(self.activation))


def jaccard_similarity(picks: np.ndarray) -> np.ndarray:
    """float32 [n, n]: |A∩B| / |A∪B| of the observation sets A, B that picked two groups (columns).

    Swarm's Eq. 2-3 turn a pair's co-activation count into a probability and then a distance.  Dividing
    the count by the union rather than by the number of observations makes it symmetric and relative:
    two rarely picked groups that are always picked together are as close (distance 0) as two hot ones,
    and 1 - similarity (the Jaccard distance) is a metric, so Alg. 1's radius bounds a cluster's spread."""
    hits = torch.from_numpy(np.ascontiguousarray(picks, dtype=np.float32))
    both = hits.T @ hits
    count = both.diagonal().clamp_min(1.0)  # a never picked group: similar to nothing (no 0 / 0)
    union = (count[:, None] + count[None, :]).sub_(both)
    return both.div_(union).numpy()


SIMILARITY_TIE = 1e-6  # Jaccard values are ratios of small counts: one within this of the radius is on it


def coactivation_clusters(picks: np.ndarray, radius: float, max_size: int | None = None) -> Clusters:
    """Swarm's Alg. 1 over the groups picked at least once, with the Jaccard distance (``jaccard_similarity``).

    Density = neighbours within ``radius`` (distance < radius: one equal to it is out); medoids come in
    density order (then activation, then token order) among groups in no cluster yet.  A medoid's
    candidates are the groups within radius of it, nearest first (at equal distance, those in no cluster
    yet, then token order); one joins when its mean distance to the members so far is below radius, so
    every member co-activates with the whole cluster, not only with the medoid.  Candidates already in a
    cluster may join again (replicas); ``max_size`` caps a cluster's members.

    Groups picked by exactly the same observations (twins: distance 0 to each other, the same distance
    to everyone else) are one weighted entry, so the distance matrix is over distinct pick patterns:
    contiguous spans that the same queries pick cost one row, not one per group.  Twins join a cluster
    together, as Alg. 1 adds them one after the other."""
    if not 0 < radius <= 1:
        raise ValueError(f"cluster radius must be in (0, 1] (a Jaccard distance), got {radius}")
    if max_size is not None and max_size < 1:
        raise ValueError(f"max_size must be at least 1, got {max_size}")
    activation = picks.sum(axis=0, dtype=np.int64)
    cold = np.flatnonzero(activation == 0)
    if len(cold) == len(activation):
        return Clusters([], np.zeros(0, dtype=np.int64), cold, activation)
    twins, first = _twins(picks, np.flatnonzero(activation))
    weight = np.diff(np.r_[first, len(twins)])
    leader = twins[first]
    similarity = jaccard_similarity(picks[:, leader])
    min_similarity = 1 - radius + SIMILARITY_TIE
    near = similarity > min_similarity  # distance < radius
    np.fill_diagonal(near, False)  # a medoid is not its own candidate
    density = near.astype(np.float32) @ weight.astype(np.float32) + (weight - 1)  # neighbour groups, twins too
    queue = np.lexsort((-activation[leader], -density))  # stable: ties keep token order
    groups, first_of, weight_of = twins.tolist(), first.tolist(), weight.tolist()
    taken = [0] * len(first_of)  # each pattern's groups in some cluster: a prefix of its twins
    cap = max_size or len(groups)
    members = []
    for medoid in queue.tolist():
        while taken[medoid] < weight_of[medoid]:  # a cap may leave some of the medoid's twins to the next cluster
            cluster = []
            for pattern, n in _expand(medoid, similarity, near[medoid], taken, weight_of, min_similarity, cap):
                at, size, done = first_of[pattern], weight_of[pattern], taken[pattern]
                cluster += [groups[at + (done + i) % size] for i in range(n)]  # those in no cluster yet first
                taken[pattern] = min(size, done + n)
            members.append(np.array(cluster, dtype=np.int64))
    return Clusters(members, np.array([m[0] for m in members], dtype=np.int64), cold, activation)


def _twins(picks: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The picked groups by pick pattern: (groups, first) with pattern p's groups (token order) at
    ``groups[first[p]:first[p + 1]]``, patterns in the order of their first group."""
    packed = np.ascontiguousarray(np.packbits(picks[:, active], axis=0).T)
    keys = packed.view(np.dtype((np.void, packed.shape[1]))).ravel()
    _, first, inverse, counts = np.unique(keys, return_index=True, return_inverse=True, return_counts=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    by_pattern = active[np.argsort(rank[inverse.ravel()], kind="stable")]
    return by_pattern, np.cumsum(counts[order]) - counts[order]


def _expand(medoid: int, similarity: np.ndarray, near: np.ndarray, taken: list[int], weight: list[int],
            min_similarity: float, max_size: int) -> list[tuple[int, int]]:
    """Alg. 1's cluster expansion from pattern ``medoid`` (``near``: its neighbours, itself excluded): the
    (pattern, groups of it) that join.  A candidate joins when its mean similarity to the member groups is
    above ``min_similarity``; each join adds its similarities to the candidates after it.  Candidates are
    few (tens), so the loop runs over Python floats: numpy calls would cost more than the arithmetic."""
    size = min(weight[medoid], max_size)
    joined = [(medoid, size)]
    candidates = near.nonzero()[0]
    if len(candidates) == 0:
        return joined
    full = [taken[c] >= weight[c] for c in candidates.tolist()]
    candidates = candidates[np.lexsort((full, -similarity[medoid, candidates]))]
    total = (size * similarity[medoid, candidates].astype(np.float64)).tolist()  # summed similarity to the members
    for at, candidate in enumerate(candidates.tolist()):
        if size >= max_size:
            break
        if total[at] > min_similarity * size:
            n = min(weight[candidate], max_size - size)
            joined.append((candidate, n))
            for later, s in enumerate(similarity[candidate, candidates[at + 1:]].tolist(), start=at + 1):
                total[later] += n * s
            size += n
    return joined


def hot_replicas(clusters: Clusters, replica_share: float) -> np.ndarray:
    """bool [n_groups]: the groups allowed a second copy, the ``replica_share`` hottest of the layer's groups
    among those in two clusters or more (by activation, ties to token order).  A replica costs a record on
    disk and a routing choice, so only groups that many activations read earn one."""
    if not 0 <= replica_share <= 1:
        raise ValueError(f"replica_share must be in [0, 1], got {replica_share}")
    n_groups = len(clusters.activation)
    shared = np.flatnonzero(clusters.memberships() >= 2)
    hottest = shared[np.argsort(-clusters.activation[shared], kind="stable")][: int(replica_share * n_groups)]
    hot = np.zeros(n_groups, dtype=bool)
    hot[hottest] = True
    return hot


def layout(clusters: Clusters, n_groups: int, n_paths: int, replica_share: float
           ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``place``'s layout and, per path, the cluster each record was stored for (-1: cold), which
    ``refetch_cost`` needs to know which records one activation reads together."""
    if n_paths < 1:
        raise ValueError(f"a layout needs at least one path, got n_paths={n_paths}")
    if len(clusters.activation) != n_groups:
        raise ValueError(f"clusters of {len(clusters.activation)} groups placed as {n_groups} groups")
    hot = hot_replicas(clusters, replica_share)
    sizes = [len(m) for m in clusters.members]
    groups = np.concatenate([np.sort(m) for m in clusters.members] + [np.zeros(0, dtype=np.int64)])
    labels = np.repeat(np.arange(len(sizes)), sizes)
    stored = np.zeros(len(groups), dtype=bool)
    stored[np.unique(groups, return_index=True)[1]] = True  # a group's first cluster stores it
    stored[_replicas(groups, stored, hot, n_paths)] = True
    cold = np.setdiff1d(np.arange(n_groups), groups)
    groups = np.concatenate([groups[stored], cold])
    labels = np.concatenate([labels[stored], np.full(len(cold), -1)])
    # Eq. 7 with the pointer advancing by each cluster's stored members: one global round robin
    return [groups[p::n_paths] for p in range(n_paths)], [labels[p::n_paths] for p in range(n_paths)]


def _replicas(groups: np.ndarray, first: np.ndarray, hot: np.ndarray, n_paths: int) -> list[int]:
    """Positions in the dealing order (``groups``: clusters in order, members in token order) that store a
    second copy: a hot group's first later occurrence dealt to another path than its first copy.  A
    skipped occurrence takes no turn of the round robin, so each accepted one shifts the later turns."""
    if n_paths == 1:
        return []
    turns_before = np.cumsum(first) - first  # turns taken by first copies before each position
    home = dict(zip(groups[first].tolist(), np.flatnonzero(first).tolist()))
    accepted: list[int] = []
    copied = set()
    for at in np.flatnonzero(~first & hot[groups]).tolist():
        group = int(groups[at])
        if group in copied:
            continue
        first_at = home[group]
        home_path = (turns_before[first_at] + bisect.bisect_left(accepted, first_at)) % n_paths
        if (turns_before[at] + len(accepted)) % n_paths != home_path:
            accepted.append(at)
            copied.add(group)
    return accepted


def place(clusters: Clusters, n_groups: int, n_paths: int, replica_share: float) -> list[np.ndarray]:
    """Per path, the groups its file holds in record order.

    Clusters in Alg. 1's order, each dealt round robin over the paths from a global pointer that advances
    by the members stored (Swarm Eq. 7): one activation reads ~size/N records from every path.  A cluster's
    members on one path are consecutive records in token order, so they are one request, not several.  A
    group in several clusters is stored by its first; a second copy (``hot_replicas``) sits in a later
    cluster's run on another path.  Cold groups follow, striped in token order from the pointer: each path
    then holds every N-th of them in order, so a token-contiguous span of picks is one contiguous record
    span on each path.  Guarantees: every group on 1 or 2 paths (different ones), no path holds a group
    twice, and path sizes differ by at most one record (the dealing is one global round robin)."""
    return layout(clusters, n_groups, n_paths, replica_share)[0]


def stripe(n_groups: int, n_paths: int) -> list[np.ndarray]:
    """The layout without clustering: group g on path g % N, in token order (``place`` of all-cold groups)."""
    if n_paths < 1:
        raise ValueError(f"a layout needs at least one path, got n_paths={n_paths}")
    return [np.arange(p, n_groups, n_paths, dtype=np.int64) for p in range(n_paths)]


def refetch_cost(per_path: list[np.ndarray], record_clusters: list[np.ndarray], n_groups: int,
                 addr_cost_s: float, entry_cost_s: float) -> np.ndarray:
    """float64 [n_groups]: seconds to read a group again, Swarm's Eq. 6 at group granularity: its transfer
    plus its share of one request's addressing latency, shared with the records of the same cluster run
    on its path (``layout``'s ``record_clusters``; a cold record is a run of one).  A group read with many
    neighbours is cheap to drop from memory; a replicated group counts its cheaper copy."""
    cost = np.full(n_groups, np.inf)
    for groups, labels in zip(per_path, record_clusters):
        if len(groups) == 0:
            continue
        starts = np.flatnonzero(np.r_[True, (labels[1:] != labels[:-1]) | (labels[1:] < 0)])
        lengths = np.diff(np.r_[starts, len(groups)])
        run_length = np.repeat(lengths, lengths)
        np.minimum.at(cost, groups, entry_cost_s + addr_cost_s / run_length)
    if np.isinf(cost).any():
        raise ValueError(f"groups {np.flatnonzero(np.isinf(cost))[:8].tolist()} are on no path: no cost to read them")
    return cost


class CoactivationLayout:
    """What the disk policies call at prefill: a prompt layer's picks -> clusters -> layout over the paths, with
    each group's activation count and refetch cost for the cost-aware reuse buffer.  The default costs are a
    typical NVMe random read (80 us to address, 2 GB/s to transfer): only their ratio orders evictions."""

    def __init__(self, n_queries: int, radius: float, replica_share: float, scaling: float, record_bytes: int,
                 addr_cost_s: float = 80e-6, read_bytes_s: float = 2e9):
        self.n_queries = n_queries
        self.radius = radius
        self.replica_share = replica_share
        self.scaling = scaling
        self.addr_cost_s = addr_cost_s
        self.entry_cost_s = record_bytes / read_bytes_s

    @classmethod
    def from_config(cls, placement, scaling: float, record_bytes: int) -> "CoactivationLayout":
        """From the config's ``placement`` section (cluster_queries, cluster_radius, replica_share)."""
        return cls(placement.cluster_queries, placement.cluster_radius, placement.replica_share, scaling, record_bytes)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, group_tokens: int, picked_groups: int, first_group: int,
                 end_group: int, n_paths: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """(per-path record order, activation [n_groups], refetch cost [n_groups]) for one (sequence, layer)."""
        n_groups = k.shape[1] // group_tokens
        picks = observation_picks(q, k, group_tokens, picked_groups, first_group, end_group, self.scaling)
        clusters = coactivation_clusters(picks, self.radius)
        per_path, record_clusters = layout(clusters, n_groups, n_paths, self.replica_share)
        cost = refetch_cost(per_path, record_clusters, n_groups, self.addr_cost_s, self.entry_cost_s)
        return per_path, clusters.activation, cost

    def refine(self, picks: np.ndarray, n_paths: int) -> tuple[list[np.ndarray], np.ndarray]:
        """Decode steps' picks (bool [steps, n_groups]) -> (per path, the picked groups in their new record order;
        refetch cost [n_groups]).  Only picked groups move: decoding's co-activation is what later steps repeat
        (the prompt window's picks predict it less well), and groups no step picked stay where they are."""
        clusters = coactivation_clusters(picks, self.radius)
        per_path, record_clusters = layout(clusters, picks.shape[1], n_paths, 0.0)
        cost = refetch_cost(per_path, record_clusters, picks.shape[1], self.addr_cost_s, self.entry_cost_s)
        return [groups[labels >= 0] for groups, labels in zip(per_path, record_clusters)], cost
