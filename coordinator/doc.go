// Package coordinator forms and publishes the quorums of ftcomm's jobs,
// which members (package membership) learn by watching etcd. One
// coordinator serves every job under its key root; several may run on
// one etcd, and one of them leads.
//
//   - Coordinator (New, then Run): campaigns in an etcd election and,
//     while it leads, follows every job and publishes the decisions of
//     each job's quorum.Machine.
//   - Admin: reads and manages jobs through etcd directly, on any
//     instance, leader or not (the ftcoord API uses it): jobs, quorum,
//     history, Evict, NewRun (a new run of a job: membership.StartRun).
//   - QuorumSigner and Secrets (LoadOrCreateSecrets): the key that lets
//     members trust quorums, and the keys every coordinator of a root
//     shares.
//
// The service around it (etcd, the HTTP API, the dashboard and metrics)
// is package coordinator/server; an embedded etcd is package etcdhost.
//
// # Leading
//
// Run campaigns in an etcd election (concurrency.Election). At its first
// campaign an instance ends the session of its own previous process (an
// election key holding its name under another lease: names are unique),
// so a restarted instance leads at once instead of waiting for the
// session of its killed predecessor to expire, which a restart of its
// embedded etcd renews; a second live process under the same name is
// deposed by it once (its writes are fenced), not in turns. While it
// leads, every decision is made by a pure machine (machine.go; a new term
// in machine_load.go: no goroutines, clock or I/O), the way ft's step
// protocol is: its inputs are
// what the leader learns — a member's record, a key deleted, a revocation,
// a foreign write of a quorum key, a gossip death, a probe's verdict, the
// answer to its own write, a tick with the time — and its outputs are
// actions: publish an epoch, probe a member's port, delete a registration,
// repair a quorum key. Each job's quorum rules are a quorum.Machine inside
// it. The leadership (leadership.go) is its thin driver: it reads every job
// under the root, then follows one watch on the root (resuming from its
// revision; a compaction or broken watch makes it read again), its gossip
// node's deaths and its probes' dials, feeds each to the machine, and
// carries out the actions. Every write is one Txn whose compares are the
// leader key's create revision and, for a quorum, the quorum key's mod
// revision: a deposed leader's write fails (ErrNotLeader) and it
// campaigns again. The machine's scripts (testdata/machine/*.txt) state
// these decisions one scenario at a time. A job whose quorum waits a
// second or more is logged ("quorum waits", with the rules' reason) when
// the wait begins and when what it waits for changes.
//
// What a member's going means is its quorum.Cause: a lease that expired
// or a gossip death is a lapse (the process may be alive, as after an
// etcd outage, and come back holding the job's step); a leave or the end
// of its run is orderly (the epoch it leaves is not revoked); an eviction
// or a closed port is neither. On a gossip death the leader also deletes
// the member's registration (fenced), so a restarted process can register
// at once. A member that a peer blames for a failed collective is dialled
// at its address, and removed at once if the port refuses connections
// (also when a new term finds the blame in a revocation of the current
// epoch, stored while no coordinator led); so is the holder a new process
// of the same id claims (membership.Claim):
// a restarted replica need not wait for its old lease, its own or its
// group's.
// Config.EvictKeepOut (default DefaultEvictKeepOut) keeps an evicted
// member out for a while. Members that wait for a holder of a step the job
// committed (MemberRecord.WaitingFor) are logged and counted
// (ftcomm_coordinator_waiting_members).
//
// A publication is one transaction: the revocation, the quorum record and
// its history entry — the whole list in the compact form members read
// (membership.EncodeQuorumRecord: ids, groups and incarnations packed and
// compressed, about 2.6 bytes per participant; addresses and steps are
// in the members' own records, and Admin.Job fills them in) — and the
// view (a change of the previous epoch). At 100,000 participants that is
// about 0.8 MB, within etcd's default request limit. A record or history
// entry of the JSON encoding written before is read as well (a
// coordinator started on an older data directory goes on from it).
//
// With Config.QuorumSigner every quorum carries an ed25519 signature over
// its canonical bytes (the view's header, which binds the packed list by
// its digest; a record of the old encoding: membership.CanonicalQuorum); a
// member with the matching membership.QuorumVerifier acts on no other
// record. The leader
// watches the quorum keys: a write that is not its own (its own are
// recognised by revision, so its writes seen late raise no alarm) is
// logged, counted (ftcomm_coordinator_foreign_quorum_writes_total) and
// undone at once — its record restored, or, without a signer (members
// cannot tell), its participants republished above the foreign epoch. A
// leader that loads a job trusts only a record signed with its key
// (without a signer: the one its history agrees with) and restores the
// newest trusted history entry otherwise. Coordinators publish their key
// ids and refuse to run beside an instance with another (ErrKeyMismatch).
// A publication that etcd refuses for its size (--max-request-bytes, or
// the client's send limit) can never be written as it is: the leader logs
// it at the error level with its size and participants, and counts it
// (ftcomm_coordinator_publish_too_large_total); it still retries, as the
// job's next decision may be smaller.
//
// A job's settings (membership.JobSettings) are changed by any instance
// (Coordinator.SetSettings, the API, `ftcoord job set`): validated whole,
// versioned, signed with the quorum key, stored unless another change came
// first. The leader adopts a document a coordinator signed and publishes it
// as a new epoch with the same participants; every replica of that epoch
// uses it from the epoch's first step. See docs/quorum.md.
//
// # Lifecycle and concurrency
//
// New checks the configuration; Run, called once, starts the gossip node
// (Config.Gossip) and campaigns until ctx ends, then resigns, so a
// standby takes over at once. It returns ctx's error, or an error
// wrapping ErrKeyMismatch; its goroutines have exited by then, but for a
// dial that checks a blamed member's port, which ends at its own timeout
// (0.5 s) or with the leadership's ctx. Coordinator and Admin are safe for
// concurrent use. The caller owns the etcd client and closes it after Run
// returns. Metrics go to Config.Registerer only: two coordinators in one
// process share nothing.
package coordinator
