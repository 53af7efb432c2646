"""Membership by observation: an identity counts once seen alive, and from the round it was first seen."""

from __future__ import annotations

from locomm.protocol.membership import JOIN_CAP_MIN, Heartbeat, admission_rounds, members_for_round
from locomm.protocol.sightings import ALIVE_S, BACKOFF_S, MAX_TRACKED, REPROBE_S, Sightings


def test_a_sighting_lasts_and_is_renewed_before_it_ends():
    s = Sightings()
    assert s.due("a", 0.0) and not s.alive("a", 0.0)
    s.asking("a", 0.0, 10.0)
    assert not s.due("a", 5.0)  # a hello under way is not sent twice
    s.saw("a", 1.0, 7)
    assert s.alive("a", 1.0) and s.alive("a", ALIVE_S) and not s.alive("a", 1.0 + ALIVE_S)
    assert not s.due("a", REPROBE_S) and s.due("a", 1.0 + REPROBE_S)  # asked again well before it ends
    s.saw("a", 1.0 + REPROBE_S, 9)
    assert s.since() == {"a": 7}  # renewed: still counted from the round first seen
    s.saw("a", 10 * ALIVE_S, 30)  # seen again after its sighting had ended: from then on
    assert s.since() == {"a": 30}


def test_a_ghost_is_asked_again_after_a_doubling_wait_up_to_a_bound():
    s = Sightings()
    t, waits = 0.0, []
    for _ in range(10):
        assert s.due("ghost", t)
        s.asking("ghost", t, 10.0)
        t += 10.0  # the hello times out
        s.missed("ghost", t)
        nxt = next(x for x in (t + k for k in range(0, 1000)) if s.due("ghost", x))
        waits.append(nxt - t)
        t = nxt
    assert waits[0] == BACKOFF_S[0] and waits[-1] == BACKOFF_S[1]
    assert all(b >= a for a, b in zip(waits, waits[1:], strict=False))
    assert not s.alive("ghost", t) and s.since() == {} and s.unanswered("ghost")
    s.saw("ghost", t, 4)  # it answers after all (a NATed peer whose relay slot came late)
    assert s.alive("ghost", t) and not s.unanswered("ghost")


def test_a_joiners_first_view_clamps_nobody_and_a_read_missing_a_member_forgets_nothing():
    s = Sightings()
    s.saw("founder", 0.0, None)  # seen before we had a round of our own
    assert s.since() == {}
    s.keep([], 1.0)  # a read that returned part of the swarm
    assert s.alive("founder", 1.0)
    s.keep([], ALIVE_S + 1.0)
    assert not s.alive("founder", ALIVE_S + 1.0) and len(s) == 0


def test_ghosts_filling_the_table_make_room_for_the_living():
    s = Sightings()
    for i in range(MAX_TRACKED):
        s.missed(f"ghost{i}", 0.0)
    s.saw("honest", 1.0, 3)
    assert s.alive("honest", 1.0) and len(s) == 1


def test_backdated_identities_are_admitted_from_the_round_first_seen_under_the_cap():
    """Issue 32: 24 minted identities declaring join_round 0 were all admitted in the first round they appeared
    (the cap is 16 a round): each backdated round had free slots. Counted from the round they were seen in, they
    share that round's slots; an honest joiner announcing a later round than it was seen in is unaffected."""
    founders = [Heartbeat(peer=f"f{i}", round=40, join_round=0) for i in range(3)]
    minted = [Heartbeat(peer=f"m{i:02d}", round=40, join_round=i) for i in range(24)]
    joiner = Heartbeat(peer="joiner", round=40, join_round=42)
    beats = founders + minted + [joiner]
    believed = admission_rounds(beats)
    assert all(believed[m.peer] <= 23 for m in minted)  # the records alone: all 24 members before round 40
    since = {**{m.peer: 40 for m in minted}, "joiner": 39}  # founders seen before we had a round: not clamped
    seen = admission_rounds(beats, since)
    assert all(seen[f.peer] == 0 for f in founders) and seen["joiner"] == 42
    per_round = {r: sum(1 for m in minted if seen[m.peer] == r) for r in (40, 41)}
    assert per_round == {40: JOIN_CAP_MIN, 41: 24 - JOIN_CAP_MIN}
    members = members_for_round(beats, 40, "f0", since=since)
    assert len(members) == 3 + JOIN_CAP_MIN


def test_an_identity_is_known_once_asked_or_seen():
    s = Sightings()
    assert "a" not in s
    s.asking("a", 0.0, 10.0)
    assert "a" in s and not s.alive("a", 0.0)


def test_what_a_peer_tells_a_joiner_of_ages_counts_peers_seen_before_it_had_a_round_as_old_and_ghosts_not_at_all():
    """``Sightings.ages`` (served to joiners that trust us): peers seen before we had a round were alive before every
    later sighting, so they get our earliest round, not "seen last"; an identity that never answered is left out."""
    s = Sightings()
    s.saw("founder", 1.0, None)  # seen before we had a round
    s.asking("ghost", 1.0, 10.0)
    s.missed("ghost", 11.0)
    assert s.ages() == {} and s.first_round is None
    s.saw("later", 100.0, 7)
    s.saw("founder", 120.0, 8)  # seen again: still the one first seen
    assert s.ages() == {"founder": 7, "later": 7} and s.since() == {"later": 7}
    s.saw("minted", 130.0, 40)
    assert s.ages()["minted"] == 40 and "ghost" not in s.ages()
