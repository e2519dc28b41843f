package membership

import (
	"testing"
	"time"
)

// The history rule: a quorum none of whose candidates holds the job's
// step waits, bounded, for the participants that held it and lapsed.
func TestQuorumHistoryScripts(t *testing.T) {
	for name, script := range map[string]string{
		"an etcd outage lapses every holder while a fresh replica asks": `
		> config min=1
		> join a b c d
		> ask a b c d
		> tick 0s
		epoch 1 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: initial quorum
		> step a=14000 b=14269 c=14269 d=14268
		# a is killed and starts again from the initial state
		> die a
		> tick 0s
		epoch 2 [b#2 c#3 d#4] maxstep=14269
		  reason: a died (gossip)
		  revoke 1 failed=[a]
		> restart a
		# etcd restarts (down 3.1 s, leases 2 s): b, c and d lose their
		# leases together, before the coordinator admits a
		> lapse b c d
		> tick 0s
		waiting: the candidates hold step 0 at most, the job is at step 14269: waiting up to 15s for b,c,d to come back (wake +15s)
		  revoke 2 failed=[b c d]: b lease expired; c lease expired; d lease expired
		# b registers again; its step is not reported yet: it is back all
		# the same, and the quorum waits for c and d
		> restart b
		> tick 1s
		waiting: the candidates hold step 0 at most, the job is at step 14269: waiting up to 14s for c,d to come back (wake +14s)
		> restart c
		> restart d
		> tick 300ms
		epoch 3 [a#5 b#6 c#7 d#8] maxstep=0
		  reason: b lease expired; c lease expired; d lease expired; joined a,b,c,d
		`,
		"a holder back with its step ends the wait": `
		> config min=1
		> join b c
		> ask b c
		> tick 0s
		epoch 1 [b#1 c#2] maxstep=0
		  reason: initial quorum
		> step b=900 c=900
		> restart a
		> lapse b c
		> tick 0s
		waiting: the candidates hold step 0 at most, the job is at step 900: waiting up to 15s for b,c to come back (wake +15s)
		  revoke 1 failed=[b c]: b lease expired; c lease expired
		> restart b step=905
		> tick 1s
		epoch 2 [a#3 b#4] maxstep=905
		  reason: b lease expired; c lease expired; joined a,b
		`,
		"the wait is bounded": `
		> config min=1 grace=5s
		> join b
		> ask b
		> tick 0s
		epoch 1 [b#1] maxstep=0
		  reason: initial quorum
		> step b=70
		> restart a
		> lapse b
		> tick 0s
		waiting: the candidates hold step 0 at most, the job is at step 70: waiting up to 5s for b to come back (wake +5s)
		  revoke 1 failed=[b]: b lease expired
		> tick 5s
		epoch 2 [a#2] maxstep=0
		  reason: b lease expired; joined a
		`,
		"holders that are gone for good are not waited for": `
		> config min=1
		> join b c
		> ask b c
		> tick 0s
		epoch 1 [b#1 c#2] maxstep=0
		  reason: initial quorum
		> step b=70 c=70
		> restart a
		# c's port refused connections (its process is gone); b left
		> die c
		> leave b
		> tick 0s
		epoch 2 [a#3] maxstep=0 departed=[b]
		  reason: b left; c died (gossip); joined a
		  revoke 1 failed=[c]
		`,
		"a caught-up survivor holds the job's step, whatever its last report": `
		> config min=1
		> join a b c
		> ask a b c
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		# heartbeats lag: c's last report is the highest when it lapses
		> step a=100 b=100 c=101
		> lapse c
		> tick 0s
		epoch 2 [a#1 b#2] maxstep=100
		  reason: c lease expired
		  revoke 1 failed=[c]
		`,
		"a joiner of the last epoch that never reported the job's step holds nothing": `
		> config min=1
		> join b c
		> ask b c
		> tick 0s
		epoch 1 [b#1 c#2] maxstep=0
		  reason: initial quorum
		> step b=500 c=500
		> restart a
		> tick 0s
		epoch 2 [b#1 c#2 a#3] maxstep=500
		  reason: joined a
		# a was still healing when b and c lapsed
		> lapse b c
		> tick 0s
		waiting: the candidates hold step 0 at most, the job is at step 500: waiting up to 15s for b,c to come back (wake +15s)
		  revoke 2 failed=[b c]: b lease expired; c lease expired
		> step a=500
		> tick 10ms
		epoch 3 [a#3] maxstep=500
		  reason: b lease expired; c lease expired
		`,
		"a new run does not wait for the last run's members": `
		> config min=1
		> run r1
		> join a b
		> ask a b
		> tick 0s
		epoch 1 [a#1 b#2] maxstep=0
		  reason: initial quorum
		> step a=300 b=300
		# the run is stopped while no coordinator watches; the next starts
		# from step 0
		> reload lost=a,b
		> run r2
		> restart c
		> tick 0s
		epoch 2 [c#3] maxstep=0
		  reason: a gone; b gone; joined c
		  revoke 1 failed=[a b]
		`,
		"members gone while no coordinator watched count as lapsed": `
		> config min=1
		> join b c
		> ask b c
		> tick 0s
		epoch 1 [b#1 c#2] maxstep=0
		  reason: initial quorum
		> step b=300 c=300
		> tick 0s
		-
		# every coordinator is down; b and c's leases lapse meanwhile, a
		# restarts from the initial state
		> restart a
		> reload lost=b,c
		> tick 0s
		waiting: the candidates hold step 0 at most, the job is at step 0 or beyond: waiting up to 15s for b,c to come back (wake +15s)
		  revoke 1 failed=[b c]: b gone; c gone
		# what the others hold is unknown: the quorum waits for both
		> restart c step=300
		> tick 1s
		waiting: the candidates hold step 300 at most, the job is at step 0 or beyond: waiting up to 14s for b to come back (wake +14s)
		> restart b step=301
		> tick 0s
		epoch 2 [a#3 b#5 c#4] maxstep=301
		  reason: b gone; c gone; joined a,b,c
		`,
	} {
		t.Run(name, func(t *testing.T) { runQuorumScript(t, script) })
	}
}

// The cut rule: live members that blame each other do not share a quorum;
// the larger side (ties: deterministic) trains on.
func TestQuorumCutScripts(t *testing.T) {
	for name, script := range map[string]string{
		"a 2|2 cut where everyone reaches the coordinator": `
		> config min=1 settle=100ms
		> join a b c d
		> ask a b c d
		> tick 0s
		epoch 1 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: initial quorum
		> formed a b c d 1
		> step a=100 b=100 c=100 d=100
		# the cut {a,b} | {c,d} breaks the ring where it crosses: each rank
		# blames the neighbour it lost
		> blame a 1 d
		> tick 0s
		waiting: epoch 1 failed; waiting 100ms for more reports (wake +100ms)
		  revoke 1 failed=[d]: d cut off from a (blame); commit failed in epoch 1 (a)
		> blame b 1 c
		> blame c 1 b
		> blame d 1 a
		> tick 100ms
		epoch 2 [a#1 b#2] maxstep=100 base=1
		  reason: c cut off from b (blame); d cut off from a (blame); commit failed in epoch 1 (a,b,c,d)
		# c and d wait out the blame's hold, then join; the cut has healed
		> tick 10s
		- (wake +19.9s)
		> tick 19900ms
		epoch 3 [a#1 b#2 c#3 d#4] maxstep=100
		  reason: joined c,d
		> formed a b c d 3
		> tick 1h
		-
		`,
		"the side that trained on wins a tie when the others rejoin too early": `
		> config min=1 hold=10s
		> join a b c d
		> ask a b c d
		> tick 0s
		epoch 1 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: initial quorum
		> blame a 1 c d
		> blame b 1 c d
		> blame c 1 a b
		> blame d 1 a b
		> tick 0s
		epoch 2 [a#1 b#2] maxstep=0
		  reason: c cut off from a,b (blame); d cut off from a,b (blame); commit failed in epoch 1 (a,b,c,d)
		  revoke 1 failed=[c d]
		> step a=40 b=40
		> tick 10s
		epoch 3 [a#1 b#2 c#3 d#4] maxstep=40
		  reason: joined c,d
		# still cut: the grow's formation times out on both sides; c and d
		# wait twice as long now
		> blame a 3 c d
		> blame b 3 c d
		> blame c 3 a b
		> blame d 3 a b
		> tick 0s
		epoch 4 [a#1 b#2] maxstep=40
		  reason: c cut off from a,b (blame); d cut off from a,b (blame); commit failed in epoch 3 (a,b,c,d)
		  revoke 3 failed=[c d]
		> tick 10s
		- (wake +10s)
		> tick 10s
		epoch 5 [a#1 b#2 c#3 d#4] maxstep=40
		  reason: joined c,d
		`,
		"a side that trains on is not dropped for members whose blame ends first": `
		> config min=1 hold=10s settle=1s
		> join a b c d
		> ask a b c d
		> tick 0s
		epoch 1 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: initial quorum
		> blame a 1 c d
		> tick 0s
		waiting: epoch 1 failed; waiting 1s for more reports (wake +1s)
		  revoke 1 failed=[]: commit failed in epoch 1 (a)
		> tick 500ms
		waiting: epoch 1 failed; waiting 500ms for more reports (wake +500ms)
		> blame b 1 c d
		> blame c 1 b
		> blame d 1 b
		> tick 500ms
		epoch 2 [a#1 b#2] maxstep=0
		  reason: c cut off from a,b (blame); d cut off from a,b (blame); commit failed in epoch 1 (a,b,c,d)
		# a's blame ends first: {a,c,d} would be larger, but a and b train on
		> tick 9s
		- (wake +500ms)
		> tick 500ms
		epoch 3 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: joined c,d
		`,
		"the first reports name one side only: the next epoch's blame completes it": `
		> config min=1 settle=100ms
		> join a b c d
		> ask a b c d
		> tick 0s
		epoch 1 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: initial quorum
		> formed a b c d 1
		# the cut {a,d} | {b,c}: b's heartbeat from a stops first; a's and
		# d's ops end by the revocation, naming no one
		> blame b 1 a
		> blame c 1 a
		> commitfail a 1
		> commitfail d 1
		> tick 0s
		waiting: epoch 1 failed; waiting 100ms for more reports (wake +100ms)
		  revoke 1 failed=[a]: a cut off from b,c (blame); commit failed in epoch 1 (a,b,c,d)
		> tick 100ms
		epoch 2 [b#2 c#3 d#4] maxstep=0 base=1
		  reason: a cut off from b,c (blame); commit failed in epoch 1 (a,b,c,d)
		# epoch 2 crosses the cut: d's formation times out first, naming b
		# and c; theirs, naming d, follow within the settle time (deciding on
		# d's report alone would admit a again)
		> blame d 2 b c
		> tick 0s
		waiting: epoch 2 failed; waiting 100ms for more reports (wake +100ms)
		  revoke 2 failed=[]: commit failed in epoch 2 (d)
		> blame b 2 d
		> blame c 2 d
		> tick 100ms
		epoch 3 [b#2 c#3] maxstep=0
		  reason: d cut off from b,c (blame); commit failed in epoch 2 (b,c,d)
		`,
		"a failed epoch waits a while for the reports of the members blamed": `
		> config min=1 settle=100ms
		> join a b c d
		> ask a b c d
		> tick 0s
		epoch 1 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: initial quorum
		# the cut {a,b} | {c,d}: a and b's formations time out first
		> blame a 1 c d
		> blame b 1 c d
		> tick 0s
		waiting: epoch 1 failed; waiting 100ms for more reports (wake +100ms)
		  revoke 1 failed=[]: commit failed in epoch 1 (a,b)
		> tick 100ms
		waiting: epoch 1 failed; waiting up to 900ms for a report from c,d, blamed by a peer (wake +900ms)
		> blame c 1 a b
		> blame d 1 a b
		> tick 300ms
		epoch 2 [a#1 b#2] maxstep=0
		  reason: c cut off from a,b (blame); d cut off from a,b (blame); commit failed in epoch 1 (a,b,c,d)
		# a silent member delays the decision by that much at most
		> blame a 2 b
		> tick 0s
		waiting: epoch 2 failed; waiting 100ms for more reports (wake +100ms)
		  revoke 2 failed=[]: commit failed in epoch 2 (a)
		> tick 1s
		epoch 3 [a#1 b#2] maxstep=0
		  reason: commit failed in epoch 2 (a)
		`,
		"a minority side never trains while the majority can": `
		> config min=1
		> join a b c
		> ask a b c
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		> step a=9 b=9 c=9
		# c is cut from a and b, which reach each other
		> blame c 1 a b
		> blame a 1 c
		> blame b 1 c
		> tick 0s
		epoch 2 [a#1 b#2] maxstep=9
		  reason: c cut off from a,b (blame); commit failed in epoch 1 (a,b,c)
		  revoke 1 failed=[c]
		`,
		"min replicas binds the side that stays": `
		> config min=3
		> join a b c d
		> ask a b c d
		> tick 0s
		epoch 1 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: initial quorum
		> blame a 1 c d
		> blame b 1 c d
		> blame c 1 a b
		> blame d 1 a b
		> tick 0s
		waiting: 2 of 3 replicas needed (min_replicas) (wake +30s)
		  revoke 1 failed=[c d]: c cut off from a,b (blame); d cut off from a,b (blame); commit failed in epoch 1 (a,b,c,d)
		# the blame's hold ends: all four try again
		> tick 30s
		epoch 2 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: commit failed in epoch 1 (a,b,c,d)
		`,
		"a side that holds the job's step beats a larger one that does not": `
		> config min=1
		> join a b
		> ask a b
		> tick 0s
		epoch 1 [a#1 b#2] maxstep=0
		  reason: initial quorum
		> step a=800 b=800
		> die b
		> tick 0s
		epoch 2 [a#1] maxstep=800
		  reason: b died (gossip)
		  revoke 1 failed=[b]
		# three fresh replicas join, behind a cut from a
		> restart c
		> restart d
		> restart e
		> tick 0s
		epoch 3 [a#1 c#3 d#4 e#5] maxstep=800
		  reason: joined c,d,e
		> blame a 3 c d e
		> blame c 3 a
		> blame d 3 a
		> blame e 3 a
		> tick 0s
		epoch 4 [a#1] maxstep=800
		  reason: c cut off from a (blame); d cut off from a (blame); e cut off from a (blame); commit failed in epoch 3 (a,c,d,e)
		  revoke 3 failed=[c d e]
		`,
		"blame is forgotten once both form an epoch together": `
		> config min=1
		> join a b c
		> ask a b c
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		# a transient reset between a and c: c sits out the hold
		> blame a 1 c
		> blame c 1 a
		> tick 0s
		epoch 2 [a#1 b#2] maxstep=0
		  reason: c cut off from a (blame); commit failed in epoch 1 (a,c)
		  revoke 1 failed=[c]
		> tick 30s
		epoch 3 [a#1 b#2 c#3] maxstep=0
		  reason: joined c
		> formed a b c 3
		# a reset between them later starts a fresh hold, not a doubled one
		> blame a 3 c
		> blame c 3 a
		> tick 0s
		epoch 4 [a#1 b#2] maxstep=0 base=3
		  reason: c cut off from a (blame); commit failed in epoch 3 (a,c)
		  revoke 3 failed=[c]
		> tick 30s
		epoch 5 [a#1 b#2 c#3] maxstep=0
		  reason: joined c
		`,
	} {
		t.Run(name, func(t *testing.T) { runQuorumScript(t, script) })
	}
}

// The silence rule: a live participant that its peers blame while it
// reports nothing (its loop stopped calling Step) is left out after
// SilentEpochs failed epochs, until it shows life.
func TestQuorumSilenceScripts(t *testing.T) {
	for name, script := range map[string]string{
		"a joiner's formations time out on peers that stopped stepping": `
		> config min=1
		> join a b
		> ask a b
		> tick 0s
		epoch 1 [a#1 b#2] maxstep=0
		  reason: initial quorum
		> formed a b 1
		> step a=50 b=50
		> restart c
		> tick 0s
		epoch 2 [a#1 b#2 c#3] maxstep=50 base=1
		  reason: joined c
		# a and b stopped calling Step; c's formation times out naming both.
		# The first such epoch is tried again: a peer may just be late
		> blame c 2 a b
		> tick 0s
		epoch 3 [a#1 b#2 c#3] maxstep=50
		  reason: commit failed in epoch 2 (c)
		  revoke 2 failed=[]
		> blame c 3 a b
		> tick 0s
		epoch 4 [c#3] maxstep=0
		  reason: a silent (blamed in 2 failed epochs in a row, reported nothing); b silent (blamed in 2 failed epochs in a row, reported nothing); commit failed in epoch 3 (c)
		  revoke 3 failed=[a b]
		# a heartbeat without news changes nothing
		> health a healthy
		> tick 1s
		-
		# a's loop calls Step again: it sits out epoch 4 and says so; the
		# blame that named it silent does not keep it out
		> formed a 4
		> tick 0s
		epoch 5 [c#3 a#1] maxstep=50
		  reason: joined a
		> formed b 5
		> tick 0s
		epoch 6 [c#3 a#1 b#2] maxstep=50
		  reason: joined b
		`,
		"a peer that answers in the epoch is not silent": `
		> config min=1
		> join a b
		> ask a b
		> tick 0s
		epoch 1 [a#1 b#2] maxstep=0
		  reason: initial quorum
		> blame a 1 b
		> tick 0s
		epoch 2 [a#1 b#2] maxstep=0
		  reason: commit failed in epoch 1 (a)
		  revoke 1 failed=[]
		# b formed epoch 2 (late, but alive): its streak ends
		> formed b 2
		> blame a 2 b
		> tick 0s
		epoch 3 [a#1] maxstep=0
		  reason: b cut off from a (blame); commit failed in epoch 2 (a)
		  revoke 2 failed=[b]
		`,
	} {
		t.Run(name, func(t *testing.T) { runQuorumScript(t, script) })
	}
}

// The end of the run: a finished member takes no part and counts for
// nothing; the next quorum goes out at once and every later one carries
// Final.
func TestQuorumFinishScripts(t *testing.T) {
	for name, script := range map[string]string{
		"the run ends at the highest finished step, and stays ended": `
		> config min=2 timeout=10s settle=100ms
		> join a b c
		> ask a b c
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		> step a=99 b=99 c=99
		# a and b reach the end of their data; c does not call Step again
		> finish a 100
		> tick 0s
		epoch 2 [b#2 c#3] maxstep=99 final=100 departed=[a]
		  reason: a finished at step 100; the run ended at step 100
		> leave a
		# below min replicas and with a failed epoch: the end waits for nothing
		> commitfail c 2
		> finish b 100
		> tick 0s
		epoch 3 [c#3] maxstep=99 final=100 departed=[b]
		  reason: b finished at step 100; commit failed in epoch 2 (c)
		  revoke 2 failed=[]
		> leave b
		# a replica that comes later learns it from its first quorum
		> restart d
		> tick 0s
		epoch 4 [c#3 d#4] maxstep=99 final=100
		  reason: joined d
		`,
		"a finished member counts for neither the majority nor the stragglers": `
		> config min=1 timeout=10s
		> join a b c
		> ask a b c
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		> finish c 5
		> tick 0s
		epoch 2 [a#1 b#2] maxstep=0 final=5 departed=[c]
		  reason: c finished at step 5; the run ended at step 5
		# c stays registered. b dies, e asks, d has not asked yet: a and e
		# are a majority of the three live members, d the one straggler
		> join d
		> restart e
		> die b
		> tick 0s
		waiting: waiting up to 10s for 1 straggler(s) (wake +10s)
		  revoke 2 failed=[b]: b died (gossip)
		`,
		"a new run starts afresh": `
		> config min=1
		> run r1
		> join a b
		> ask a b
		> tick 0s
		epoch 1 [a#1 b#2] maxstep=0
		  reason: initial quorum
		> step a=90 b=90
		> finish a 100
		> finish b 100
		> tick 0s
		epoch 2 [] maxstep=0 final=100 departed=[a b]
		  reason: a finished at step 100; b finished at step 100; the run ended at step 100
		> leave a b
		# the job's next run: its replicas start from step 0, and neither the
		# last run's end nor its members hold them back, also after a new
		# coordinator took over
		> reload
		> run r2
		> restart c
		> restart d
		> tick 0s
		epoch 3 [c#3 d#4] maxstep=0
		  reason: joined c,d
		`,
		"a new coordinator keeps the end from the quorum record": `
		> config min=1
		> join a b
		> ask a b
		> tick 0s
		epoch 1 [a#1 b#2] maxstep=0
		  reason: initial quorum
		> finish a 7
		> tick 0s
		epoch 2 [b#2] maxstep=0 final=7 departed=[a]
		  reason: a finished at step 7; the run ended at step 7
		> leave a
		> reload
		> restart c
		> tick 0s
		epoch 3 [b#2 c#3] maxstep=0 final=7
		  reason: joined c
		`,
	} {
		t.Run(name, func(t *testing.T) { runQuorumScript(t, script) })
	}
}

// The straggler policy: out after Window above Factor × the others'
// median; back when it keeps up, or after a probation that doubles.
func TestQuorumStragglerScripts(t *testing.T) {
	for name, script := range map[string]string{
		"a starved replica is taken out and comes back when it keeps up": `
		> config min=1 factor=2 window=10s probation=1m
		> join a b c d
		> ask a b c d
		> tick 0s
		epoch 1 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: initial quorum
		> steptime a=50ms b=52ms c=48ms d=60ms
		> tick 1s
		-
		# d is pinned to a busy core: 5× slower
		> steptime d=250ms
		> tick 1s
		- (wake +10s)
		> steptime d=240ms
		> tick 5s
		- (wake +5s)
		> tick 5s
		epoch 2 [a#1 b#2 c#3] maxstep=0
		  reason: d straggling (step time 240ms, 4.8× the others' median 50ms, since 10s)
		  revoke 1 failed=[d]
		# out, d's loop still computes, as slowly
		> steptime d=245ms
		> tick 5s
		- (wake +55s)
		# the busy loop stops: d keeps up and is back at once
		> steptime d=55ms
		> tick 1s
		epoch 3 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: joined d
		# starved again within a window of its return: out for twice as long
		> steptime d=300ms
		> tick 1s
		- (wake +10s)
		> tick 10s
		epoch 4 [a#1 b#2 c#3] maxstep=0
		  reason: d straggling (step time 300ms, 6.0× the others' median 50ms, since 10s)
		  revoke 3 failed=[d]
		# its loop does not compute while it sits out: back after its
		# probation, judged again on its next report, not its old one
		> tick 1m
		- (wake +1m0s)
		> tick 1m
		epoch 5 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: joined d
		> tick 20s
		-
		# it keeps up for a window: its next take-out starts a fresh count
		> steptime d=50ms
		> tick 11s
		-
		> steptime d=400ms
		> tick 1s
		- (wake +10s)
		> tick 10s
		epoch 6 [a#1 b#2 c#3] maxstep=0
		  reason: d straggling (step time 400ms, 8.0× the others' median 50ms, since 10s)
		  revoke 5 failed=[d]
		> tick 1s
		- (wake +59s)
		`,
		"never more than a minority": `
		> config min=1 factor=2 window=10s
		> join a b c d
		> ask a b c d
		> tick 0s
		epoch 1 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: initial quorum
		> steptime a=50ms b=50ms c=200ms d=210ms
		> tick 0s
		- (wake +10s)
		# c and d are both slow, but only one of four may go: the slowest
		> tick 10s
		epoch 2 [a#1 b#2 c#3] maxstep=0
		  reason: d straggling (step time 210ms, 4.2× the others' median 50ms, since 10s)
		  revoke 1 failed=[d]
		`,
		"never below min replicas": `
		> config min=4 factor=2 window=10s
		> join a b c d e
		> ask a b c d e
		> tick 0s
		epoch 1 [a#1 b#2 c#3 d#4 e#5] maxstep=0
		  reason: initial quorum
		> steptime a=50ms b=50ms c=50ms d=200ms e=210ms
		> tick 0s
		- (wake +10s)
		> tick 10s
		epoch 2 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: e straggling (step time 210ms, 4.2× the others' median 50ms, since 10s)
		  revoke 1 failed=[e]
		`,
	} {
		t.Run(name, func(t *testing.T) { runQuorumScript(t, script) })
	}
}

// Upsert says when a record may change the decision, so that the
// coordinator runs Advance for those only (not for every heartbeat).
func TestQuorumUpsertSaysWhatMatters(t *testing.T) {
	now := time.Unix(0, 0)
	m := NewMachine("j", DefaultQuorumConfig(), nil)
	base := MemberRecord{ID: "a", Incarnation: 1, WantQuorum: true}
	if !m.Upsert(now, base) || !m.Upsert(now, MemberRecord{ID: "b", Incarnation: 2, WantQuorum: true}) {
		t.Fatal("a new member does not matter")
	}
	d := m.Advance(now.Add(DefaultFormWindow)) // once joins are quiet
	m.Published(*d.Quorum)
	for _, c := range []struct {
		name string
		mut  func(*MemberRecord)
		want bool
	}{
		{"step", func(r *MemberRecord) { r.Step = 9 }, false},
		{"step time without a policy", func(r *MemberRecord) { r.StepTime = time.Second }, false},
		{"formed", func(r *MemberRecord) { r.Formed = 1 }, false},
		{"health", func(r *MemberRecord) { r.Health = Critical }, true},
		{"commit failure", func(r *MemberRecord) { r.CommitFailed = 1 }, true},
		{"blame", func(r *MemberRecord) { r.CommitFailed, r.Blamed = 1, []string{"b"} }, true},
		{"finished", func(r *MemberRecord) { r.Finished = true }, true},
		{"a straggler policy", func(r *MemberRecord) { r.Stragglers = &StragglerPolicy{Factor: 2} }, true},
		{"new incarnation", func(r *MemberRecord) { r.Incarnation = 3 }, true},
	} {
		r := base
		c.mut(&r)
		if got := m.Upsert(now, r); got != c.want {
			t.Errorf("%s: Upsert = %v, want %v", c.name, got, c.want)
		}
		m = NewMachine("j", DefaultQuorumConfig(), nil)
		m.Upsert(now, base)
		m.Upsert(now, MemberRecord{ID: "b", Incarnation: 2, WantQuorum: true})
		d := m.Advance(now.Add(DefaultFormWindow))
		m.Published(*d.Quorum)
	}
	// With a policy, step times matter; while a quorum waits, steps do.
	m.Upsert(now, MemberRecord{ID: "a", Incarnation: 1, WantQuorum: true, Stragglers: &StragglerPolicy{Factor: 2}})
	if r, _ := m.Member("a"); !m.Upsert(now, func() MemberRecord { r.StepTime = time.Second; return r }()) {
		t.Error("a step time under a straggler policy does not matter")
	}
	if r, _ := m.Member("a"); !m.Upsert(now, func() MemberRecord { r.Step, r.StepTime = r.Step+1, 2*time.Second; return r }()) {
		t.Error("a step time that comes with a new step (every heartbeat) does not matter")
	}
	m.Upsert(now, MemberRecord{ID: "c", Incarnation: 5, MinReplicas: 9})
	m.Remove(now, "b", 0, "left")
	if d := m.Advance(now); d.Waiting == "" {
		t.Fatalf("no wait: %+v", d)
	}
	if r, _ := m.Member("a"); !m.Upsert(now, func() MemberRecord { r.Step = 4; return r }()) {
		t.Error("a step while the quorum waits does not matter")
	}
}

// Joins are batched: a quorum that would only admit joiners waits for a
// quiet FormWindow, and no longer than FormMaxWait; a loss or a failure
// is never held back by it.
func TestQuorumFormingScripts(t *testing.T) {
	for name, script := range map[string]string{
		"members that start together form one epoch": `
		> config min=1 form=200ms formmax=2s
		> join a
		> ask a
		> tick 0s
		waiting: forming: admitting joiners once none arrived for 200ms (at most 2s more) (wake +200ms)
		> tick 100ms
		waiting: forming: admitting joiners once none arrived for 200ms (at most 1.9s more) (wake +100ms)
		> join b c
		> ask b c
		> tick 150ms
		waiting: forming: admitting joiners once none arrived for 200ms (at most 1.75s more) (wake +50ms)
		> tick 50ms
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		`,
		"joins that keep coming form at FormMaxWait": `
		> config min=1 form=200ms formmax=500ms
		> join a
		> ask a
		> tick 0s
		waiting: forming: admitting joiners once none arrived for 200ms (at most 500ms more) (wake +200ms)
		> tick 150ms
		waiting: forming: admitting joiners once none arrived for 200ms (at most 350ms more) (wake +50ms)
		> join b
		> tick 150ms
		waiting: 1 of 2 live members take part: not a strict majority
		> join c
		> ask b c
		> tick 150ms
		waiting: forming: admitting joiners once none arrived for 200ms (at most 50ms more) (wake +50ms)
		> join d
		> ask d
		> tick 50ms
		epoch 1 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: initial quorum
		`,
		"a growing job batches its joiners; a death does not wait": `
		> config min=1 form=200ms formmax=2s
		> join a b
		> ask a b
		> tick 200ms
		epoch 1 [a#1 b#2] maxstep=0
		  reason: initial quorum
		> join c
		> ask c
		> tick 100ms
		waiting: forming: admitting joiners once none arrived for 200ms (at most 2s more) (wake +100ms)
		> join d
		> ask d
		> tick 200ms
		epoch 2 [a#1 b#2 c#3 d#4] maxstep=0
		  reason: joined c,d
		# a death with a joiner at the same moment: at once, joiner included
		> join e
		> ask e
		> die b
		> tick 0s
		epoch 3 [a#1 c#3 d#4 e#5] maxstep=0
		  reason: b died (gossip); joined e
		  revoke 2 failed=[b]
		# a failed commit is not held back either
		> join f
		> ask f
		> commitfail a 3
		> tick 0s
		epoch 4 [a#1 c#3 d#4 e#5 f#6] maxstep=0
		  reason: commit failed in epoch 3 (a); joined f
		  revoke 3 failed=[]
		`,
		"off: one epoch per joiner": `
		> config min=1
		> join a
		> ask a
		> tick 0s
		epoch 1 [a#1] maxstep=0
		  reason: initial quorum
		> join b
		> ask b
		> tick 0s
		epoch 2 [a#1 b#2] maxstep=0
		  reason: joined b
		`,
	} {
		t.Run(name, func(t *testing.T) { runQuorumScript(t, script) })
	}
}
