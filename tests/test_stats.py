"""Per-position acceptance counters and their totals over several generations."""

from __future__ import annotations

from verispec.core.types import DraftTree, Fate, GenerationStats, Step


def step(drafted: int, accepted: int) -> Step:
    tokens = list(range(accepted + 1))
    return Step(tokens=tokens, fates=[Fate.ACCEPTED] * accepted + [Fate.RECOVERED], num_drafted=drafted,
                num_accepted=accepted, draft_seconds=0.1, verify_seconds=0.2)


def test_acceptance_is_conditional_on_reaching_the_position():
    stats = GenerationStats()
    for drafted, accepted in [(4, 0), (4, 2), (4, 4), (2, 1)]:
        stats.add(step(drafted, accepted))
    assert stats.drafted_by_position == [4, 4, 3, 3]
    assert stats.reached_by_position == [4, 3, 2, 1]
    assert stats.accepted_by_position == [3, 2, 1, 1]
    assert stats.acceptance_by_position == [3 / 4, 2 / 3, 1 / 2, 1.0]
    assert stats.new_tokens == 1 + 3 + 5 + 2 and stats.target_forwards == 4
    assert stats.mean_accepted_tokens == 11 / 4


def test_total_sums_counters_of_different_lengths():
    a, b = GenerationStats(), GenerationStats()
    a.add(step(2, 2))
    b.add(step(4, 1))
    total = GenerationStats.total([a, b])
    assert total.drafted_by_position == [2, 2, 1, 1]
    assert total.accepted_by_position == [2, 1]
    assert total.reached_by_position == [2, 2]
    assert total.new_tokens == 5 and total.target_forwards == 2
    assert abs(total.verify_seconds - 0.4) < 1e-12


def test_a_position_reached_but_never_accepted_counts_as_zero():
    # Drafting 3 and accepting none reaches position 0 only: its rate is 0, not missing (the
    # accepted counter never grew there, the reached one did).
    stats = GenerationStats()
    stats.add(step(3, 0))
    stats.add(step(3, 1))
    assert stats.accepted_by_position == [1] and stats.reached_by_position == [2, 1]
    assert stats.acceptance_by_position == [1 / 2, 0.0]


def test_a_tree_reaches_only_the_depths_below_its_accepted_path():
    # Root children 0 and 1; node 1 has a child 2 (depth 2). Accepting node 0, a leaf, judged
    # depth 1 only: the tree's depth 2 lay under the other branch.
    leaf = DraftTree([5, 6, 7], [-1, -1, 1], [0], depth=2)
    stats = GenerationStats()
    stats.add(Step(tokens=[5, 9], fates=[Fate.ACCEPTED, Fate.BONUS], num_drafted=3, num_accepted=1,
                   draft_seconds=0.1, verify_seconds=0.2, tree=leaf))
    assert stats.drafted_by_position == [1, 1] and stats.reached_by_position == [1]
    assert stats.acceptance_by_position == [1.0]
    # Accepting node 1, whose child 2 was refused, judged depth 2 as well.
    inner = DraftTree([5, 6, 7], [-1, -1, 1], [1], depth=2)
    stats.add(Step(tokens=[6, 9], fates=[Fate.ACCEPTED, Fate.RECOVERED], rejected=[7], num_drafted=3,
                   num_accepted=1, draft_seconds=0.1, verify_seconds=0.2, tree=inner))
    assert stats.reached_by_position == [2, 1] and stats.acceptance_by_position == [1.0, 0.0]
