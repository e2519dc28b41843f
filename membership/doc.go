// Package membership is what a trainer links to take part in ftcomm's
// jobs: the member client, and the records it shares with the coordinator
// (package coordinator), which decides who takes part in each epoch (its
// rules: package coordinator/quorum) and publishes it in etcd. It links
// neither etcd's server (package etcdhost) nor the coordinator; what only
// the coordinator and tools use lives with them, and what both sides share
// underneath (the key layout, the gossip node) in internal packages.
//
// # Pieces
//
//   - Member (Join): one member of a job (for ft.Comm, one replica
//     group's leader). It composes parts that each own their state and
//     lock, or drive the parts they hold (see Member's fields): member.go
//     (config, Join, Leave), liveness.go (registration, renewal,
//     heartbeats, gossip, the watch of its own key), lease.go (the lease
//     the registration is bound to, and how Join binds it), one lease per
//     replica group in grouplease.go (a member that follows its leader,
//     and takes the lease over), grouplink.go (the group's links) and
//     grouproll.go (the leader's roll), reports.go (its record, what it
//     tells the coordinator, commit records), epochs.go and
//     groupquorum.go (the watch of quorums and revocations), reach.go,
//     run.go (runs).
//   - Quorum, Revocation, MemberRecord, CommitRecord, KeepOut, RunRecord:
//     the records in etcd; EncodeQuorumRecord, DecodeQuorumRecord and
//     EncodeQuorumView: the compact forms of a quorum, signed (record.go,
//     view.go, sign.go); QuorumCache: decoded quorums shared by the
//     members of one process.
//   - Runs: a job's runs come and go under its name (RunRecord, StartRun,
//     MemberConfig.Run); the commit records are the current run's.
//   - NewStore: an etcd comm.Store for rendezvous (Member.Store gives one
//     per epoch).
//   - GossipConfig: SWIM failure detection (hashicorp/memberlist) among
//     members and coordinators.
//   - NewClient and ClientConfig: etcd clients with ftcomm's settings;
//     Credentials and QuorumVerifier: a trainer's side of a secured
//     deployment (below).
//
// # Keys
//
// Everything lives under a root (default "/ftcomm"). What
// members write is under <root>/<job>/: members/<id> (bound to the
// member's lease), epoch/revoked/<epoch>, rdzv/<epoch>/…, commits/<step>,
// run, claims/<id> (Claim).
// What only coordinators write is under <root>/_coordinator/:
// jobs/<job>/quorum (the record: the whole list, compact), jobs/<job>/view
// (a change of the previous epoch, what members watch),
// jobs/<job>/history/<epoch> (each epoch's record),
// jobs/<job>/evicted/<id>, jobs/<job>/settings (JobSettings),
// the election, and the coordinators' gossip addresses and key ids.
//
// # Security
//
// The library's defaults are open, for tests and experiments: quorums are
// taken unverified and gossip is not encrypted. A deployment (`ftcoord
// serve` by default) secures etcd with TLS, client certificates and etcd
// roles under which trainers write only their jobs' keys (package
// etcdhost), signs every quorum (coordinator.QuorumSigner) and encrypts
// gossip. A member with MemberConfig.QuorumVerifier acts on no other
// record: an unsigned, altered or foreign-key quorum is logged ("ignored
// a quorum record") and ignored. GossipConfig.SecretKey encrypts and
// authenticates gossip, so a node without the key cannot join the cell
// and report deaths (a gossip death deletes a registration).
//
// Trainers get all they need in one file, Credentials (JSON, 0600):
// endpoints, root, CA, client certificate and key (or etcd user and
// password), quorum-verification keys, gossip key. LoadCredentials reads
// it; the environment variable FTCOMM_CREDENTIALS (CredentialsEnv) names
// it for ft.Config; Credentials.ClientConfig and ApplyMember configure a
// client and a member from it, and Credentials.Follow moves a client whose
// endpoints all fail to those the file names now (a coordinator restarted
// elsewhere rewrites it).
//
// # Member lifecycle (what ft.Comm does)
//
//	m, err := membership.Join(ctx, cfg)        // lease, record, watches, gossip
//	m.RequestQuorum(ctx, false)                // once: "I want in"
//	q, err := m.NextQuorum(ctx, 0)             // blocks until a quorum with me… or without
//	for each step {
//	    // No I/O here while the epoch holds: q is current until m.Changed()
//	    // fires. Select on m.Revoked(q.Epoch) beside long collectives and
//	    // revoke the communicator when it fires.
//	    m.SetStep(step)                        // local; travels with the next write
//	    m.SetStepTime(compute)                 // local; for a straggler policy
//	    if commit failed { m.ReportCommitFailure(ctx, q.Epoch, blamed...) }
//	}
//	m.Finish(ctx, step)                        // when the run is over
//	m.Leave(ctx)                               // or Close
//
// Join makes each of its steps again, after a pause (50 ms doubling to
// 2 s, until ctx ends), when etcd refused it without applying it ("too
// many requests": etcd shedding load, as a join storm of 100,000 ranks
// made it; no leader) and when its request was lost in transit (gRPC
// Unavailable: the client's connection broke, as when its keepalive goes
// unanswered on a starved host). A lost request may have been applied, so
// every step is one that can be made again: a lease granted unanswered
// expires unused; the run's and the group's records are read before any
// conditional write; a registration applied unanswered is found as this
// Join's own (the same record under the same lease) and kept. A lease that
// ended before the registration under it (the group leader's, or the
// member's own, when renewals went unanswered for a TTL) makes Join bind
// to a lease again. Any other failure ends Join, a request that timed out
// among them (it may have been applied, and ctx bounds the Join anyway).
//
// Steady state costs the coordinator nothing: a member learns a new epoch
// from its watches (pushed by etcd), not by asking: the quorum's view — a
// change of the previous epoch, a few bytes per participant that changed,
// not the whole list — and the job's revocations; of the member records,
// only its own. What
// reaches the coordinator is what changes a decision: joins
// (RequestQuorum), deaths (gossip, lease expiry), leaves, evictions, health
// changes (SetHealth) and commit failures (ReportCommitFailure). The
// optional periodic heartbeat (HeartbeatInterval, default 10 s, 0 = off)
// writes the member's step and health to etcd only when they changed: it
// feeds the dashboard and the quorum's MaxStep, and costs one etcd write
// per member per interval.
//
// A quorum is {Epoch, ordered Participants, MaxStep, Created, Reason}.
// Participant i is rank i. Survivors keep their relative order and joiners
// follow, so the ft layer can Shrink (a subset), Grow (survivors then
// joiners) or re-initialise (anything else). MaxStep is the highest step
// reported when the quorum formed; steps are reported on heartbeats, so
// agree on the exact step inside the job (an all-reduce of max) before
// healing.
//
// Epochs end by revocation. When a participant dies, leaves, is evicted or
// turns Critical, or a commit fails, the coordinator writes a revocation
// record for the current epoch at once — before the next quorum if that
// must wait for stragglers or min replicas — and Revoked(epoch) fires at
// every member. A member that sees a collective fail may also Revoke the
// epoch itself; the first record wins, and the coordinator then forms the
// next epoch (the same participants if all are alive).
//
// A member whose registration disappears (evicted, declared dead by
// gossip, lease expired) is over: Done closes, Err wraps ErrEvicted, and
// every method that writes fails with it. Renewals that go unanswered for
// a TTL (etcd down or cut off) are not the end of it: only etcd knows
// whether the lease expired, and an etcd that restarts restores every
// lease with a fresh TTL. The member asks once etcd answers again, and
// goes on under the same lease and incarnation when etcd kept it ("lease
// renewed again"), or is over when etcd says it expired. So a coordinator
// outage of any length, its embedded etcd down with it, costs no member
// its registration. Join again for a new
// incarnation; a restarted process is always a new incarnation, and Join
// fails with *DuplicateMemberError while the old one is alive (or waits
// with WaitForDuplicate). Finding its id held, Join writes a Claim: the
// coordinator dials the holder's Addr, and a refused connection (its
// process is gone) ends the holder's registration at once, for a lease of
// its own or its group's, so a restarted process does not wait for the
// old lease. An evicted member is kept out for a while
// (coordinator.Admin.EvictFor, coordinator.Config.EvictKeepOut, default
// 1 min): Join fails with a *KeptOutError (errors.Is ErrKeptOut) that
// says by whom and until when; the keep-out record is bound to an etcd
// lease and goes at that time even without a coordinator.
//
// The quorum record and each history entry hold the whole list in the
// view's compact form (ids and groups front-coded, incarnations as varint
// deltas, deflated: about 2.6 bytes per participant), so one epoch of
// 100,000 participants is one transaction of about 0.8 MB, within etcd's
// default request limit (MaxRequestBytes); a record of the JSON encoding
// written before is still read. Decoding bad input gives an error wrapping
// ErrMalformedQuorum (or ErrForgedQuorum), never a panic.
//
// A member started before its coordinator says what it waits for (a
// warning every few seconds naming the endpoints and why: connection
// refused, or TLS/credentials) and joins within about ReconnectMaxDelay
// (0.5 s) of etcd being reachable: ClientConfig caps gRPC's reconnect
// backoff, which otherwise grows to two minutes. Clients made by
// ClientConfig reconnect as fast after an etcd restart, and a
// registration outlives the restart (above), so a coordinator restart
// costs no epoch unless something changed meanwhile. Health
// Critical (e.g. a GPU XID fault reported by the NCCL backend through the
// app) excludes the member from the next quorum until it reports Healthy
// or Degraded; it stays registered.
//
// # Quorum rules (package coordinator/quorum)
//
// After torchft's lighthouse: fast quorum when every member of the
// previous quorum is still live and fit; otherwise at least MinReplicas
// candidates and a strict majority of live members taking part (no split
// brain), waiting up to JoinTimeout for stragglers (live members that
// have not asked); ShrinkOnly keeps joiners out while a participant holds
// it; joins are batched (FormWindow of quiet, at most FormMaxWait), so a
// job whose members start together forms in one epoch; losses that
// follow a published loss are batched too (LossWindow of quiet, at most
// LossMaxWait; for MassLoss ranks or more lost within MassLossMaxWait,
// longer than etcd's 500 ms between revocations of expired leases and the TTL/3 over which
// leases of ranks that died together expire; the first after a quiet
// spell is published at once, every epoch revoked at once), so many
// deaths at once cost two epochs; the
// epoch grows by one at every quorum, which is published only when the
// participants change or the epoch failed.
//
// Beyond the lighthouse (quorum.Config; quorum.Machine's documentation
// has the exact rules): a finished member (Finish) counts for nothing and the
// run's end (Quorum.Final) goes out at once and stays; a quorum none of
// whose members holds the job's last known step waits up to HolderGrace
// for members that held it and lapsed (an etcd outage) to come back; live
// members that blame each other (Blamed, a revocation's Failed) do not
// share a quorum — one side trains on, the other rejoins once one of a
// pair reports reaching the other again (Reached: a member keeps dialling
// the peers it blamed; past BlameMinHold) or after BlameHold; a
// participant that reports its loop does not step while a peer reports
// waiting for it in that step (ReportStall, each past its own bound) is
// left out until it steps again; a member blamed in
// SilentEpochs failed epochs while reporting nothing (a loop that stopped
// calling Step) is left out until it shows life; and an opt-in straggler
// policy (StragglerPolicy, MemberConfig.Stragglers, fed by SetStepTime)
// takes out a replica whose steps stay slower than a factor of its
// peers'. Every quorum also carries the run's last known step (RunStep)
// and the job's settings in force (Settings; the view that changes them
// carries the document, which Settings(ref) returns).
//
// # Replica groups: one lease per group
//
// With MemberConfig.GroupLease the members of one replica group (Group)
// share one lease, recorded at <root>/<job>/groups/<group>: the group's first member
// to join creates and renews it and is the group's leader (heartbeats and
// gossip run there only); the others bind their registrations to it and
// hold a TCP link to the leader, pinged both ways (GroupLinkInterval,
// GroupLinkTimeout). A link that ends without a goodbye is a death. A
// closed link ends at once; a silent one is judged as the gloo backend
// judges a silent peer (package internal/silence): each end tells the
// other its process (the hello; the group's record), and a peer on the
// same host and in the same pid and network namespaces is looked up in
// /proc — stopped or gone: dead at GroupLinkTimeout; runnable (starved of
// CPU, not dead): kept for up to 10 GroupLinkTimeouts; blocked in the
// kernel for another timeout: dead. Any other peer's timeout stretches
// with how late this end's own ticks run and with the longest recent gap
// between its pings, up to 10 GroupLinkTimeouts. A leader that drops a
// silent member says so on the link, and a member that gives up on a
// silent leader says goodbye, so that the other end, alive after all,
// does not take it for dead in turn (a dropped member does not take the
// lease over; a leader does not delete a member that left it). The
// leader deletes the registration of a member whose link ended (trying
// until etcd answers: nothing else removes a registration on the lease
// it renews). Every registration on the lease is linked to the leader or
// was within a bound, LeaseTTL + 4 GroupLinkTimeouts: the leader also
// deletes one that has had no link to it that long since it appeared on
// the lease or since its last link ended with a goodbye (a member that
// died before it linked, to this leader or, after a takeover, to the new
// one). Each write that binds a registration to the lease says so at
// <root>/<job>/groupjoined/<group>, which the leader watches from the
// revision at which it took the lease; a hello still being read holds
// such removals back, and a member whose hello comes after its removal
// was sent finds its registration deleted and its membership ends
// (ErrEvicted), as any removed member's does. A member
// whose link to the leader ended takes the lease over in two transactions
// fenced on the group's record: a claim (the record, still on the old
// lease, names it as taking over; the old leader's registration deleted),
// then the takeover (a new lease, the record naming it leader, its
// registration moved), and the others move their registrations to the
// new lease keeping their incarnations. The members take their turns by
// id among the group's members in the quorum they hold (one not in it
// yet last), a GroupLinkInterval apart, each watching the record while it
// waits: the first goes at once, and the others, seeing its claim, wait
// for its new lease instead of granting one of their own however slow
// etcd is (a claimer that has not moved the record a GroupLinkTimeout
// later is passed over: the next in line takes over from the claimed
// record). A group whose leader died costs etcd one new lease, and the
// coordinator sees the leader gone after one write, the claim. A member that ends its link by choice (the record
// moved, or its watch of it broke) says goodbye, and a leader that does
// not hold the lease a hello names (not yet: its takeover's transaction
// has not returned; or not any more) refuses it out loud: the member
// links again after a pause rather than take the lease over, and so a
// live member is never counted dead. A member watches the group's record from the revision
// at which its last fenced write (its registration, a move) found the
// record unchanged, not from the record's own revision, which may be as
// old as the group: etcd serves a watch that starts in the past from its
// log, a scan of every revision since under the lock its applies take,
// and at 100,000 ranks such watches tipped a busy etcd into refusing
// requests (docs/capacity.md). A registration marked SharedLease is removed without
// revoking its lease. Anyone who can read the job's keys can open a link
// (the hello carries the lease id, not a secret of its own), but the
// leader's delete is fenced on the named incarnation and on the group's
// lease: a stranger's link can remove no registration outside the group.
//
// Only a group's leader watches the job's epochs in etcd (unless
// MemberConfig.GroupEachWatches): it forwards every record that changed
// what it knows — the view, the whole list it read, a revocation — on the
// group's links, byte for byte as stored, and replays what it holds to a
// member that links. A member verifies the coordinator's signature itself
// and takes no epoch at or below the one it holds, so a leader can
// neither forge a quorum nor roll one back; it reads the record from etcd
// only when it cannot apply a forwarded view. The member that takes the
// lease over reads the record once and watches from then on; the others
// link to it. A group's other member reads no epoch at Join: its Quorum is
// empty until its link delivers the leader's (milliseconds). etcd thus
// serves one epoch watcher per group, and the whole list to one rank per
// group at the first quorum.
//
// # Failure detection
//
// Layered: TCP errors inside a collective, which a member reports by
// revoking the epoch with the peers it blames (Revoke's failed list) — the
// coordinator dials each blamed member's Addr and removes it at once if
// the port refuses connections (its process is gone; an answer or an
// unreachable host leaves it to the other layers), which takes tens of
// milliseconds after a SIGKILL; gossip (GossipConfig, about 1 s with
// DefaultGossipConfig for a killed or stopped process, the coordinator
// being a gossip node itself); lease expiry (LeaseTTL, ≥ 2 s) as the
// backstop. Whichever fires first ends the epoch. A member that leaves
// tells each gossip peer it knows over TCP and waits for their answers
// before memberlist announces the leave, so those peers report a leave,
// not a death, in whatever order gossip brings the rest.
//
// # Concurrency and goroutines
//
// Member, the Stores NewStore returns and QuorumVerifier are safe for
// concurrent use. A Member runs goroutines for lease renewal, the epoch
// watch, the watch of its own key, the dials of the peers it blamed
// (Reached),
// heartbeats and gossip, and with GroupLease the group's links (at the
// leader one per linked member, a watch of the group's joined record and
// one per removal under way; at the others the link, a watch of the
// group's record and, for a forwarded view it cannot apply, one read of the
// record); they exit at Leave or Close, or soon after the
// membership is lost (Close waits for them); its gossip node runs one
// event-forwarding goroutine until Close, and one short-lived goroutine
// per leave-handshake message it sends (Close waits for them). Every call
// that can block takes a ctx and ends at its deadline. The caller owns
// the etcd clients it passes in and closes them after the members that
// use them.
package membership
