"""Every peer derives the same groups, whatever it has banned: bans skip a partner at exchange time only."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from locomm.compression.payload import PayloadCodec
from locomm.config import RunSpec
from locomm.peer.transport.gossip import Faults, Gossip
from locomm.peer.transport.rpc import Limits, RpcServer
from locomm.peer.transport.swarm import Heartbeat, members_for_round
from locomm.protocol.schedule import group_of, noloco_groups

PEERS = ["pa", "pb", "pc", "pd", "pe", "pf"]


def beats(round_idx: int) -> list[Heartbeat]:
    return [Heartbeat(peer=p, round=round_idx, join_round=0) for p in PEERS]


def test_groups_identical_across_peers_while_one_has_banned_another():
    faults = {p: Faults(max_faults=1) for p in PEERS}
    faults["pa"].record("pb", "garbage")  # pa bans pb; nobody else does
    assert faults["pa"].banned == {"pb"}
    for r in range(20):
        views = {p: members_for_round(beats(r), r, p) for p in PEERS}
        assert len({tuple(v) for v in views.values()}) == 1, views  # bans never change the members
        groups = {p: noloco_groups(r, views[p], 2, seed=0) for p in PEERS}
        assert len({repr(g) for g in groups.values()}) == 1


def test_a_banned_partner_is_skipped_at_exchange_time():
    spec = RunSpec.preset("nano")
    codec = PayloadCodec({"w": (4, 4)}, {"theta": "parameter"}, spec.compression)
    faults = Faults(max_faults=1)
    faults.record("pb", "garbage")

    async def run() -> dict:
        with ThreadPoolExecutor(1) as pool:
            server = RpcServer(None, "run", Limits(), pool)  # type: ignore[arg-type]
            g = Gossip(
                None,
                server,
                run_id="run",
                me="pa",
                codec=codec,
                limits=Limits(),
                faults=faults,  # type: ignore[arg-type]
                max_body_bytes=1 << 20,
            )
            # The only partner is banned: no stream is opened (there is no network here), the round is local.
            return await g.exchange(0, ["pa", "pb"], {})

    assert asyncio.run(run()) == {}
    members = members_for_round(beats(0), 0, "pa")
    assert "pb" in members and group_of("pa", noloco_groups(0, members, 2)) is not None


def test_admission_without_a_flood_is_the_announced_round():
    from locomm.protocol.membership import admission_rounds

    beats = [Heartbeat(peer=f"p{i}", join_round=0) for i in range(8)]
    beats += [Heartbeat(peer="late", join_round=5), Heartbeat(peer="waiting", join_round=2**31 - 1)]
    rounds = admission_rounds(beats)
    assert rounds == {**{f"p{i}": 0 for i in range(8)}, "late": 5}


def test_a_flood_of_joiners_is_admitted_a_bounded_number_per_round_and_alike():
    from locomm.protocol.membership import JOIN_CAP_MIN, admission_rounds, join_cap

    founders = [Heartbeat(peer=f"f{i}", round=10, join_round=0) for i in range(8)]
    flood = [Heartbeat(peer=f"sybil{i}", round=10, join_round=10) for i in range(200)]
    rounds = admission_rounds(founders + flood)
    assert all(rounds[f"f{i}"] == 0 for i in range(8))  # the flood never displaces earlier members
    per_round: dict[int, int] = {}
    for p, r in rounds.items():
        if p.startswith("sybil"):
            per_round[r] = per_round.get(r, 0) + 1
    established = 8
    for r in sorted(per_round):
        assert per_round[r] <= join_cap(established), (r, per_round[r])
        established += per_round[r]
    assert per_round[10] == JOIN_CAP_MIN
    # Every reader computes the same rounds, whatever order it read the records in.
    assert admission_rounds(list(reversed(founders + flood))) == rounds
    members = members_for_round(founders + flood, 10, "f0")
    assert len(members) == 8 + JOIN_CAP_MIN


def test_a_minority_claiming_a_far_round_does_not_set_the_swarms_round():
    from locomm.protocol.membership import swarm_round

    honest = [Heartbeat(peer=f"h{i}", round=r) for i, r in enumerate((5, 5, 6))]
    liar = Heartbeat(peer="liar", round=10**9)
    assert swarm_round(honest) == 6
    assert swarm_round([*honest, liar]) == 6
    assert swarm_round([*honest[:2], liar]) == 5  # 1 of 3
    assert swarm_round([Heartbeat(peer="w", round=3, join_round=2**31 - 1)]) == 0  # not admitted: not counted


def test_an_island_is_one_participant_and_counts_from_its_representative_on():
    from locomm.protocol.membership import islands_led

    rep = Heartbeat(peer="QmA", island="x", island_rep=True)
    fol = Heartbeat(peer="QmB", island="x")
    single = Heartbeat(peer="QmC")
    assert members_for_round([rep, fol, single], 0, "QmC") == ["QmA", "QmC"]  # the follower is no member
    assert members_for_round([rep, fol, single], 0, "QmB") == ["QmA", "QmB", "QmC"]  # except to itself
    assert islands_led([rep, fol, single]) and islands_led([single])
    assert not islands_led([Heartbeat(peer="QmA", island="x"), fol, single])  # formed, not yet published
    assert islands_led([Heartbeat(peer="QmA", island="y", finished=True), single])  # a left peer names nothing


def test_one_donor_rule_for_every_driver():
    """state_donors: live admitted peers near the robust top, nearest first; liars far ahead, leavers, paused
    peers, unstarted ones and island followers are never asked."""
    from locomm.protocol.membership import robust_top, state_donors

    def beat(peer: str, r: int, **kw) -> Heartbeat:
        return Heartbeat(peer=peer, round=r, started=kw.pop("started", True), **kw)

    beats = [beat(f"h{i}", r) for i, r in enumerate((10, 10, 11, 9, 8, 7))]
    beats += [beat("liar", 10**9), beat("gone", 10, finished=True), beat("paused", 10, paused=True)]
    beats += [
        beat("new", 10, started=False),
        beat("follower", 10, island="i"),
        beat("rep", 10, island="i", island_rep=True),
    ]
    top = robust_top(b.round for b in beats)
    assert top == 11  # the median is 10, and one round of slack
    # Fewer than half the identities cannot move it (two thirds could: 3 of 7 claiming 10^9 set it there);
    # a majority can (4 of 7: the first configuration past the bound).
    assert robust_top([5, 5, 5, 6] + [10**9] * 3) == 6
    assert robust_top([5, 5, 5] + [10**9] * 4) == 10**9
    got = state_donors(beats, top, lambda b: b.round)
    assert got == ["h2", "h0", "h1", "rep", "h3"]  # at the top first, then nearest to it
    assert state_donors(beats, top, lambda b: b.round, n=10)[-2:] == ["h4", "h5"]
    assert state_donors(beats, 10, lambda b: b.round, slack=0) == ["h0", "h1", "rep", "h3", "h4"]  # 11 is past
    # the user's --initial-peers first, when they qualify: minted identities at the top round cannot crowd them
    # out of the list; one that does not qualify (a liar far ahead, a leaver) is not asked for being named
    prefer = {"h5", "liar", "gone"}
    assert state_donors(beats, top, lambda b: b.round, prefer=prefer) == ["h5", "h2", "h0", "h1", "rep"]


def test_donors_come_one_per_network_group_before_a_second_of_any():
    """Identities minted behind one address (one machine, one provider's /16) all claim the top round: without
    groups they were every donor a joiner asked; with them they fill one slot while other groups have peers,
    so neither the majority rule nor the median of 5 is theirs. Between equals, the peer seen alive longest
    first. The group is what the live connection shows, not what the peer declares."""
    from locomm.protocol.membership import netgroup, state_donors

    def beat(peer: str, r: int) -> Heartbeat:
        return Heartbeat(peer=peer, round=r, started=True)

    sybils = [beat(f"s{i}", 12) for i in range(8)]
    honest = [beat(f"h{i}", 11) for i in range(4)]
    groups = {f"s{i}": netgroup([f"/ip4/203.0.{113 + i % 2}.7/tcp/{4000 + i}"]) for i in range(8)}
    groups |= {"h0": netgroup(["/ip4/198.51.100.2/tcp/1"]), "h1": netgroup(["/ip6/2001:db8::1/tcp/1"])}
    groups |= {"h2": netgroup(["/ip4/192.0.2.9/tcp/1/p2p/QmR/p2p-circuit", "/ip4/10.1.2.3/tcp/1"])}  # direct wins
    # h3: no live connection, the "?" group
    assert len({groups[f"s{i}"] for i in range(8)}) == 1  # one /16
    assert groups["h2"] == "ip4:10.1.0.0/16" and groups["h1"] == "ip6:2001:db8::/32"
    beats = sybils + honest
    assert state_donors(beats, 12, lambda b: b.round) == ["s0", "s1", "s2", "s3", "s4"]  # before: all minted
    got = state_donors(beats, 12, lambda b: b.round, groups=groups)
    assert got == ["s0", "h0", "h1", "h2", "h3"]  # one minted identity of five
    # fewer groups than donors: once every group has given one, the rest fill in the same order (the bound is
    # in groups: 5 donors need 5 groups for one group to hold one slot)
    assert state_donors(beats, 12, lambda b: b.round, groups=groups, n=7) == [*got, "s1", "s2"]
    # relayed only: the relay's group (the peer's own address is hidden behind it); names, then nothing
    assert netgroup(["/ip4/192.0.2.9/tcp/1/p2p/QmR/p2p-circuit"]) == "relay:ip4:192.0.0.0/16"
    assert netgroup(["/dns4/Peer.example/tcp/1"]) == "dns:peer.example" and netgroup([]) == netgroup(["junk"]) == "?"
    assert netgroup(["/ip6/::ffff:203.0.113.7/tcp/1"]) == groups["s0"]  # a mapped IPv4 is that IPv4
    # between equals, the one seen alive longest (our round when we first saw it) first
    since = {"h1": 3, "h0": 9}
    assert state_donors(honest, 11, lambda b: b.round, since=since) == ["h1", "h0", "h2", "h3"]


def test_identities_minted_recently_stand_behind_peers_seen_alive_for_long_whatever_round_they_claim():
    """Identities in as many network groups as the honest peers (a provider's addresses) claim the top round; the
    honest peers are a round behind. Ordered by claimed round they were every donor; with the round each was first
    seen alive in (``Host.ages``: ours, or the trusted peers'), the peers seen for long come first, and an
    identity nobody has seen counts as seen last. A peer far behind the top is still asked after those near it."""
    from locomm.protocol.membership import state_donors

    def beat(peer: str, r: int) -> Heartbeat:
        return Heartbeat(peer=peer, round=r, started=True)

    beats = [beat(f"s{i}", 12) for i in range(6)] + [beat(f"h{i}", 11) for i in range(4)] + [beat("old", 2)]
    groups = {b.peer: f"ip4:10.{i}.0.0/16" for i, b in enumerate(beats)}  # every identity a group of its own
    assert state_donors(beats, 12, lambda b: b.round, groups=groups) == ["s0", "s1", "s2", "s3", "s4"]
    since = {"h0": 1, "h1": 4, "h2": 2, "h3": 7, "s5": 11, "old": 0}
    got = state_donors(beats, 12, lambda b: b.round, groups=groups, since=since, young_after=12 - 3)
    assert got == ["h0", "h2", "h1", "h3", "s5"]  # the old first; the young (seen in the last 3 rounds, or never) after
    assert state_donors(beats, 12, lambda b: b.round, groups=groups, since=since, young_after=9, n=12)[-1] == "old"
    # among the old, nearest the top first (a stale majority one round behind does not win by age alone); among
    # those far behind, age does not count: the nearest represents its group
    beats = [beat("a", 12), beat("b", 11), beat("c", 12), beat("far_old", 0), beat("far_near", 8)]
    since = {"a": 5, "b": 1, "c": 6, "far_old": 0, "far_near": 4}
    groups = {"a": "ga", "b": "gb", "c": "gc", "far_old": "g", "far_near": "g"}
    got = state_donors(beats, 12, lambda b: b.round, since=since, young_after=9, groups=groups)
    assert got == ["a", "c", "b", "far_near", "far_old"]


def test_a_heartbeat_from_the_future_does_not_keep_a_peer_fresh():
    """A heartbeat's ``time`` is its writer's to choose: one far in the reader's future kept a dead (or minted)
    peer a member for the record's whole life. Within MAX_CLOCK_SKEW_S it is a clock, past it a lie."""
    from locomm.protocol.membership import MAX_CLOCK_SKEW_S, MEMBER_LAG_ROUNDS

    now, r = 1000.0, 10 + MEMBER_LAG_ROUNDS + 1  # their round counters lag: only freshness keeps them in
    beats = [
        Heartbeat(peer="QmSkewed", round=10, time=now + MAX_CLOCK_SKEW_S / 2),
        Heartbeat(peer="QmFuture", round=10, time=now + 10 * MAX_CLOCK_SKEW_S),
        Heartbeat(peer="QmStale", round=10, time=now - 100.0),
    ]
    assert members_for_round(beats, r, "QmMe", fresh_s=60.0, now=now) == ["QmMe", "QmSkewed"]


def test_a_round_counter_far_ahead_keeps_no_dead_or_minted_peer_in():
    """One stored heartbeat claiming a round far ahead was a member of every round while its record lived (up to
    2 x 5 rounds of its declared round time): the counter alone counts within MEMBER_LAG_ROUNDS either way; past
    that only a fresh heartbeat keeps a peer in (a live peer ahead of us is fresh)."""
    from locomm.protocol.membership import MEMBER_LAG_ROUNDS

    now, r = 1000.0, 10
    beats = [
        Heartbeat(peer="QmGhost", round=10**6, time=now - 100.0),  # one store, long ago
        Heartbeat(peer="QmFastLive", round=r + MEMBER_LAG_ROUNDS + 5, time=now - 1.0),
        Heartbeat(peer="QmAheadStale", round=r + MEMBER_LAG_ROUNDS, time=now - 100.0),  # within the lag: in
    ]
    assert members_for_round(beats, r, "QmMe", fresh_s=30.0, now=now) == ["QmAheadStale", "QmFastLive", "QmMe"]


def test_a_leaver_waits_for_no_partner_that_is_leaving_too():
    """Two peers that end together each waited for the other to pull its last payload, up to max_wait_s: a
    leaving partner's exchanges are over, and its heartbeat now says so (``leaving``), which the record keeps."""
    from locomm.protocol.membership import may_still_pull

    last, now, ttl = 9, 100.0, 6.0
    on_its_way = Heartbeat(peer="QmB", round=last + 1, time=now - 1)
    assert may_still_pull(on_its_way, last, now, ttl)
    leaving = Heartbeat(peer="QmB", round=last + 1, time=now - 1, leaving=True, serves=(last,))
    assert not may_still_pull(leaving, last, now, ttl)
    assert Heartbeat.parse("QmB", leaving.record()) == leaving  # it travels in the record
    for gone in (
        Heartbeat(peer="QmB", round=last + 2, time=now - 1),  # two rounds on: that exchange ended
        Heartbeat(peer="QmB", round=last, time=now - ttl),  # stale
        Heartbeat(peer="QmB", round=last, time=now - 1, finished=True),
        Heartbeat(peer="QmB", round=last, time=now - 1, paused=True),
        None,
    ):
        assert not may_still_pull(gone, last, now, ttl), gone


def test_freshness_is_judged_on_the_readers_clock():
    """A writer 30 s behind (heartbeats every 3 s, read as often, 12 s freshness): by its own times it is stale at
    every read. From
    its second version on it is fresh, placed no earlier than the read that saw its previous one; a writer
    ahead of the reader is placed no later than the read; an unchanged record keeps its time and ages."""
    from locomm.protocol.membership import live, observed_time

    prev = None
    fresh = []
    for read in (100.0, 103.0, 106.0):  # the reader's clock at each read; the writer wrote 1 s before, 30 s behind
        written = read - 1.0 - 30.0
        t = observed_time(written, read, prev)
        prev = (written, t, read)
        fresh.append(bool(live([Heartbeat(peer="b", time=t)], read, 12.0)))
    assert fresh == [False, True, True]
    assert prev[1] == 103.0  # the last version: no earlier than the read that saw the one before
    assert observed_time(prev[0], 140.0, prev) == 103.0  # the same version read again keeps its time
    assert not live([Heartbeat(peer="b", time=observed_time(prev[0], 140.0, prev))], 140.0, 12.0)  # a dead writer
    ahead = observed_time(10_000.0, 150.0, prev)  # a writer far ahead (or lying about its time)
    assert ahead == 150.0 and not live([Heartbeat(peer="b", time=ahead)], 163.0, 12.0)
    assert observed_time(149.0, 150.0, prev) == 149.0  # a synced writer keeps its own time


def test_a_restarted_partner_sends_nothing_and_its_lower_round_is_read():
    """A partner killed and restarted is another process: what we waited for from the old one will not come
    (chaos: a partner restarted every 20-40 s was waited for 255 s to its ETA at the floor rate). Its new record
    replaces the old even with a lower round; a replay of the old process's record does not."""
    from locomm.protocol.membership import newer, restarted

    old = Heartbeat(peer="b", round=54, time=100.0, incarnation="aa")
    new = Heartbeat(peer="b", round=12, time=130.0, incarnation="bb")
    assert restarted(new, "aa") and not restarted(old, "aa")
    assert not restarted(new, "") and not restarted(None, "aa")  # not known then: no verdict
    assert not restarted(Heartbeat(peer="b", round=55, time=140.0), "aa")  # an older version's record: none
    assert newer(new, old)  # the restart's record is read though its round is lower
    assert not newer(old, new)  # a replay of the earlier process
    assert not newer(Heartbeat(peer="b", round=53, time=140.0, incarnation="aa"), old)  # the round never goes back
    assert newer(Heartbeat(peer="b", round=55, time=103.0, incarnation="aa"), old)
