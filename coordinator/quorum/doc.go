// Package quorum is the coordinator's decision of who takes part in each
// epoch of one job: a pure state machine (Machine) with no goroutines, no
// clock and no I/O. The rules are torchft's lighthouse's (fast quorum, min
// replicas, strict majority, join timeout, shrink-only) and five for what
// the lighthouse cannot see: the end of a run, history (lapsed holders of
// the job's step), cuts, silence and stragglers (docs/quorum.md; Machine's
// documentation states each exactly).
//
// # Use
//
// The owner feeds the machine what it learns, each with the time: member
// records as they change (Upsert), the end of a registration with its
// Cause (Remove), stored revocations (Revoke), deaths being checked
// (Suspect, Unsuspect). It calls Advance to learn the Decision — a quorum
// to publish, a revocation to store, or why it waits and until when —
// stores it, and reports back what was stored (Published, Revoke). Time
// only moves when the owner says so: call Advance again at WakeAt.
//
// The coordinator (package coordinator) runs one Machine per job, fed
// from etcd and gossip; package memcoord runs one in memory, for tests and
// for trying a job in one process.
//
// # Tests
//
// The rules are tested by scripts in testdata, one file per rule, in the
// manner of etcd-io/raft's interaction tests: "> die c" then "> tick 0s"
// prints the quorum that follows, "epoch 2 [a#1 b#2] …", or why none does.
//
// # Concurrency
//
// A Machine is not safe for concurrent use: its owner drives it from one
// goroutine. Machines share nothing: two jobs, or two coordinators in one
// process, do not see each other.
package quorum
