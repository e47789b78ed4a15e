"""Co-activation clustering and multi-path placement (runtime/cluster.py, Swarm §5)."""
import numpy as np
import pytest
import torch

from edgekv.runtime.cluster import (Clusters, coactivation_clusters, jaccard_similarity, layout, observation_picks,
                                    place, refetch_cost, stripe)


def picked(n_obs: int, n_groups: int, sets: dict[int, range | list[int]]) -> np.ndarray:
    """A pick matrix where group g is picked by the observations ``sets[g]``."""
    picks = np.zeros((n_obs, n_groups), dtype=bool)
    for group, observations in sets.items():
        picks[list(observations), group] = True
    return picks


def brute_force_picks(q, k, G, picked_groups, first_group, end_group, scaling):
    """One query and one head at a time, straight from the rule's definition."""
    n_heads, n_obs, _ = q.shape
    n_kv, n_tokens, _ = k.shape
    n_groups = n_tokens // G
    picks = np.zeros((n_obs, n_groups), dtype=bool)
    for w in range(n_obs):
        position = n_tokens - n_obs + w
        scores = {}
        for g in range(first_group, min(end_group, n_groups)):
            visible = range(g * G, min((g + 1) * G, position + 1))
            if len(visible) == 0:
                continue
            token_scores = [sum(float(q[h, w] @ k[h // (n_heads // n_kv), t]) for h in range(n_heads)) * scaling
                            for t in visible]
            scores[g] = max(token_scores)
        for g in sorted(scores, key=scores.get, reverse=True)[:picked_groups]:
            picks[w, g] = True
    return picks


@pytest.mark.parametrize("n_heads,n_kv", [(6, 2), (4, 4)])
@pytest.mark.parametrize("n_obs,first_group,end_group", [(8, 1, 9), (30, 1, 99), (5, 0, 4)])
def test_observation_picks_equal_brute_force(n_heads, n_kv, n_obs, first_group, end_group):
    torch.manual_seed(n_heads + n_obs)
    q = torch.randn(n_heads, n_obs, 16, dtype=torch.float64)
    k = torch.randn(n_kv, 37, 16, dtype=torch.float64)  # 9 whole groups of 4 and one token
    picks = observation_picks(q, k, 4, 3, first_group, end_group, scaling=0.25)
    assert picks.shape == (n_obs, 9)
    np.testing.assert_array_equal(picks, brute_force_picks(q, k, 4, 3, first_group, end_group, 0.25))


def test_causal_queries_see_only_groups_up_to_their_position():
    torch.manual_seed(3)
    picks = observation_picks(torch.randn(4, 30, 8), torch.randn(2, 37, 8), 4, 5, 0, 9, scaling=1.0)
    assert picks[0].sum() == 2 and not picks[0, 2:].any()  # query at token 7 sees groups 0 and 1 only
    assert picks.sum(axis=1).tolist() == [min(5, (7 + w) // 4 + 1) for w in range(30)]


def test_half_precision_keys_pick_as_their_float32_values():
    torch.manual_seed(4)
    q, k = torch.randn(6, 8, 16).bfloat16(), torch.randn(2, 64, 16).bfloat16()
    picks = observation_picks(q, k, 4, 3, 1, 16, scaling=0.25)
    np.testing.assert_array_equal(picks, observation_picks(q.float(), k.float(), 4, 3, 1, 16, scaling=0.25))


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="GQA"):
        observation_picks(torch.randn(5, 2, 8), torch.randn(2, 16, 8), 4, 1, 0, 4, 1.0)
    with pytest.raises(ValueError, match="W=20"):
        observation_picks(torch.randn(2, 20, 8), torch.randn(2, 16, 8), 4, 1, 0, 4, 1.0)


def test_blocks_give_exactly_those_clusters_in_density_order():
    sets = {2: range(3), 3: range(3), 4: range(3),  # block A: identical picks
            9: range(3, 9), 8: range(3, 8), 10: range(4, 9), 11: [3, 4, 6, 7, 8],  # block B around 9
            17: range(12)}  # the hottest group, close to nothing
    clusters = coactivation_clusters(picked(12, 20, sets), radius=0.45)
    assert [m.tolist() for m in clusters.members] == [[9, 8, 10, 11], [2, 3, 4], [17]]
    assert clusters.medoids.tolist() == [9, 2, 17]
    assert clusters.cold.tolist() == sorted(set(range(20)) - set(sets))
    assert clusters.activation[17] == 12 and clusters.activation[9] == 6
    assert clusters.memberships().max() == 1


def test_medoid_is_the_densest_not_the_hottest():
    sets = {0: range(2), 1: range(2), 2: range(2), 3: range(2), 5: range(10), 6: range(2, 10)}
    clusters = coactivation_clusters(picked(10, 8, sets), radius=0.3)
    assert clusters.medoids[0] == 0 and clusters.members[0].tolist() == [0, 1, 2, 3]
    assert clusters.members[1].tolist() == [5, 6]  # 5: the hottest, one neighbour


def test_entry_coactivated_with_two_disjoint_blocks_is_in_both():
    sets = {**{g: range(4) for g in range(4)}, **{g: range(4, 8) for g in range(10, 14)}, 20: range(8)}
    clusters = coactivation_clusters(picked(8, 24, sets), radius=0.6)
    assert [sorted(m.tolist()) for m in clusters.members] == [[0, 1, 2, 3, 20], [10, 11, 12, 13, 20]]
    assert clusters.medoids[0] == 20  # co-activated with both blocks: the densest
    assert clusters.memberships()[20] == 2


def test_max_size_caps_clusters_and_still_covers_every_picked_group():
    clusters = coactivation_clusters(picked(4, 12, {g: range(4) for g in range(10)}), radius=0.5, max_size=3)
    assert [m.tolist() for m in clusters.members] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]]


def test_at_equal_distance_a_capped_cluster_takes_a_group_in_no_cluster_yet():
    picks = picked(3, 4, {0: [1], 1: [0], 2: [0, 1], 3: [0, 2]})  # 2 and 3 both at distance 0.5 from 1
    clusters = coactivation_clusters(picks, radius=0.6, max_size=2)
    assert [m.tolist() for m in clusters.members] == [[2, 0], [1, 3]]  # not [1, 2], which leaves 3 alone


def test_nothing_picked_gives_no_clusters_and_a_bad_radius_is_named():
    clusters = coactivation_clusters(np.zeros((4, 6), dtype=bool), radius=0.5)
    assert clusters.members == [] and clusters.cold.tolist() == list(range(6))
    with pytest.raises(ValueError, match="radius"):
        coactivation_clusters(np.zeros((4, 6), dtype=bool), radius=0.0)


def test_jaccard_similarity_equals_set_arithmetic():
    rng = np.random.default_rng(5)
    picks = rng.random((16, 30)) < 0.3
    picks[:, 0] = False
    sets = [set(np.flatnonzero(picks[:, g]).tolist()) for g in range(30)]
    expected = [[len(a & b) / max(1, len(a | b)) for b in sets] for a in sets]
    np.testing.assert_allclose(jaccard_similarity(picks), expected, rtol=1e-6)


def test_a_distance_equal_to_the_radius_is_out():
    picks = picked(5, 2, {0: range(2), 1: range(5)})  # Jaccard distance 1 - 2/5 = 0.6
    assert len(coactivation_clusters(picks, radius=0.6).members) == 2
    assert len(coactivation_clusters(picks, radius=0.61).members) == 1


def distance(picks: np.ndarray, a: int, b: int) -> float:
    both, either = np.sum(picks[:, a] & picks[:, b]), np.sum(picks[:, a] | picks[:, b])
    return 1 - both / either


@pytest.mark.parametrize("seed", range(6))
def test_random_picks_follow_algorithm_1(seed):
    """Alg. 1's invariants, group by group, on picks with twins, overlaps and noise."""
    rng = np.random.default_rng(seed)
    picks = rng.random((12, 120)) < 0.08
    picks[0, 40] = True
    picks[:, 40:48] = picks[:, [40]]  # a span of twins
    radius = 0.5
    clusters = coactivation_clusters(picks, radius)
    picked_once = np.flatnonzero(picks.any(axis=0))
    assert sorted(set(np.concatenate(clusters.members).tolist())) == picked_once.tolist()
    density = {g: sum(distance(picks, g, o) < radius for o in picked_once if o != g) for g in picked_once}
    assert all(density[a] >= density[b] for a, b in zip(clusters.medoids, clusters.medoids[1:]))
    covered = set()
    for members in clusters.members:
        medoid = members[0]
        assert medoid not in covered  # medoids are taken among groups in no cluster yet
        for i, group in enumerate(members[1:], start=1):
            assert distance(picks, medoid, group) < radius
            assert np.mean([distance(picks, group, m) for m in members[:i]]) < radius
        covered |= set(members.tolist())
    twins = [m for m in clusters.members if 40 in m]
    assert all(set(range(40, 48)) <= set(m.tolist()) for m in twins)


def random_clusters(seed: int, n_groups: int = 200, n_obs: int = 32) -> Clusters:
    """Overlapping co-activation blocks plus noise: many clusters, several replica candidates."""
    rng = np.random.default_rng(seed)
    picks = rng.random((n_obs, n_groups)) < 0.01
    for _ in range(25):
        groups = rng.choice(n_groups, size=rng.integers(2, 12), replace=False)
        observations = rng.random(n_obs) < 0.3
        picks[np.ix_(observations, groups)] |= rng.random((observations.sum(), len(groups))) < 0.9
    return coactivation_clusters(picks, radius=0.6)


def check_layout(clusters: Clusters, n_groups: int, n_paths: int, replica_share: float) -> int:
    """Every invariant ``place`` promises; returns the number of replicated groups."""
    per_path, labels = layout(clusters, n_groups, n_paths, replica_share)
    assert all(np.array_equal(a, b) for a, b in zip(per_path, place(clusters, n_groups, n_paths, replica_share)))
    assert len(per_path) == n_paths
    for groups in per_path:
        assert len(np.unique(groups)) == len(groups)  # no path holds a group twice: copies on different paths
    copies = np.bincount(np.concatenate(per_path), minlength=n_groups)
    assert len(copies) == n_groups and copies.min() >= 1 and copies.max() <= 2
    sizes = [len(groups) for groups in per_path]
    assert max(sizes) - min(sizes) <= 1
    replicated = np.flatnonzero(copies == 2)
    assert len(replicated) <= int(replica_share * n_groups)
    assert (clusters.memberships()[replicated] >= 2).all()
    first_cluster = {}
    for index, members in enumerate(clusters.members):
        for group in members.tolist():
            first_cluster.setdefault(group, index)
    for index, members in enumerate(clusters.members):
        stored = np.concatenate([groups[label == index] for groups, label in zip(per_path, labels)])
        assert set(stored.tolist()) <= set(members.tolist())
        assert {g for g in members.tolist() if first_cluster[g] == index} <= set(stored.tolist())
        for groups, label in zip(per_path, labels):
            at = np.flatnonzero(label == index)
            assert len(at) <= -(-len(stored) // n_paths)  # dealt over the paths
            assert len(at) == 0 or at[-1] - at[0] == len(at) - 1  # one run of consecutive records
            assert np.all(np.diff(groups[at]) > 0)  # in token order
    return len(replicated)


@pytest.mark.parametrize("n_paths", [1, 2, 3, 4])
@pytest.mark.parametrize("replica_share", [0.0, 0.05, 1.0])
def test_placement_invariants(n_paths, replica_share):
    replicas = [check_layout(random_clusters(seed), 200, n_paths, replica_share) for seed in range(4)]
    if n_paths == 1 or replica_share == 0:
        assert sum(replicas) == 0
    else:
        assert sum(replicas) > 0


@pytest.mark.parametrize("n_paths", [2, 3, 4])
def test_a_bridging_group_gets_its_second_copy_on_another_path(n_paths):
    sets = {**{g: range(4) for g in range(4)}, **{g: range(4, 8) for g in range(10, 14)}, 20: range(8)}
    clusters = coactivation_clusters(picked(8, 24, sets), radius=0.6)
    per_path = place(clusters, 24, n_paths, replica_share=0.05)
    assert sum(20 in groups for groups in per_path) == 2
    assert sum(20 in groups for groups in place(clusters, 24, n_paths, replica_share=0.0)) == 1
    check_layout(clusters, 24, n_paths, 0.05)


def test_cold_groups_follow_the_clusters_striped_in_token_order():
    clusters = coactivation_clusters(picked(2, 10, {3: [0], 7: [0]}), radius=0.5)
    assert [g.tolist() for g in place(clusters, 10, 2, 0.0)] == [[3, 0, 2, 5, 8], [7, 1, 4, 6, 9]]


@pytest.mark.parametrize("n_paths", [1, 2, 3, 4])
def test_stripe_is_place_of_all_cold_groups(n_paths):
    cold = coactivation_clusters(np.zeros((4, 23), dtype=bool), radius=0.5)
    placed = place(cold, 23, n_paths, replica_share=0.05)
    assert [g.tolist() for g in placed] == [g.tolist() for g in stripe(23, n_paths)]
    assert [g % n_paths for g in range(23)] == [p for g in range(23) for p in range(n_paths) if g in placed[p]]
    if n_paths == 1:
        assert placed[0].tolist() == list(range(23))


def test_bad_layouts_are_named():
    clusters = coactivation_clusters(np.zeros((4, 6), dtype=bool), radius=0.5)
    with pytest.raises(ValueError, match="n_paths=0"):
        place(clusters, 6, 0, 0.0)
    with pytest.raises(ValueError, match="6 groups placed as 7"):
        place(clusters, 7, 2, 0.0)
    with pytest.raises(ValueError, match="replica_share"):
        place(clusters, 6, 2, 1.5)


def test_refetch_cost_falls_with_the_length_of_the_run():
    sets = {**{g: [0] for g in range(8)}, **{g: [1] for g in range(8, 12)}, **{g: [2] for g in (12, 13)}, 14: [3]}
    clusters = coactivation_clusters(picked(4, 20, sets), radius=0.5)
    per_path, labels = layout(clusters, 20, 1, 0.0)
    cost = refetch_cost(per_path, labels, 20, addr_cost_s=80e-6, entry_cost_s=5e-6)
    np.testing.assert_allclose(cost[[0, 8, 12, 14, 19]], 5e-6 + 80e-6 / np.array([8, 4, 2, 1, 1]))
    assert cost[0] < cost[8] < cost[12] < cost[14]


def test_refetch_cost_takes_the_cheaper_copy():
    sets = {**{g: range(4) for g in range(4)}, **{g: range(4, 8) for g in range(10, 14)}, 20: range(8)}
    clusters = coactivation_clusters(picked(8, 24, sets), radius=0.6)
    per_path, labels = layout(clusters, 24, 2, 0.05)
    cost = refetch_cost(per_path, labels, 24, addr_cost_s=1.0, entry_cost_s=0.0)
    assert cost[20] == pytest.approx(1 / 3)  # runs of 3 (first copy) and 2 (replica) on its paths
    with pytest.raises(ValueError, match="on no path"):
        refetch_cost([per_path[0]], [labels[0]], 24, 1.0, 0.0)


def test_a_realistic_layer_runs_end_to_end():
    """8K tokens in groups of 4, the prompt's last 32 queries, GQA 32/8 heads: the size a prefill clusters
    per layer.  Times are measured elsewhere (nothing here asserts on them)."""
    torch.manual_seed(0)
    q, k = torch.randn(32, 32, 64), torch.randn(8, 8192, 64)
    k[:, 4096:4160] += 3 * q[::4, -1:].mean(dim=1, keepdim=True)  # a span every query favours
    picks = observation_picks(q, k, 4, 100, 1, 2040, scaling=0.125)
    assert picks.shape == (32, 2048) and (picks.sum(axis=1) == 100).all()
    clusters = coactivation_clusters(picks, radius=0.6)
    assert check_layout(clusters, 2048, 4, 0.05) <= int(0.05 * 2048)
