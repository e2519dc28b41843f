// Package ft is what a training loop imports: a fault-tolerant communicator
// that keeps a data-parallel job training through the loss and return of
// replicas, with no job restart and no checkpoint reload.
//
//	c, err := ft.New(ctx, ft.Config{Job: "llama", Group: "g3", Coordinator: endpoints,
//		Backend: "gloo", MinReplicas: 2, Secret: secret})
//	c.Register("params", comm.Float32s(params))   // what a healing replica receives
//	for {
//		if err := c.Step(ctx); err != nil { … }    // quorum; reconfigure; heal if behind
//		grads := forwardBackward(batch)
//		if hasNaN(grads) { c.FailStep("loss is NaN") }   // before the all-reduce: no replica commits the step
//		c.AllReduce(ctx, comm.Float32s(grads), comm.Avg) // an error here is recorded, not raised
//		if ok, err := c.Commit(ctx); ok { optimizer.Step() } else if err != nil { … }
//	}
//
// # The step protocol
//
// Each process registers with the coordinator (membership) as member
// "<group>.<group rank>" in New, and asks to take part at its first Step:
// a replica that builds its model and optimizer after New (seconds, for a
// PyTorch job) is not counted on until then, so the others train on
// instead of waiting for it in a reconfiguration; it joins with the next
// grow. The coordinator publishes quorums (epochs); the
// Comm follows them by watch, so a step whose epoch is unchanged costs no
// round trip. Step moves to a new epoch when there is one. The protocol is
// a state machine with no goroutines, clock or I/O (machine.go, tested by
// the scripts in testdata/machine), whose inputs are what happened — a
// quorum, a comm formed or failed, records gathered, state healed, the
// vote, Step, Commit, Close — and whose outputs are actions; where the
// training loop stands is its phase (idle, stepping, in a step,
// committing), as raft names a node's state. One goroutine of the Comm,
// the driver, owns every comm, the registration, the recovery server and
// the reports, and carries the actions out; the Comm's methods only hand
// it requests and read what it publishes, through their link (link.go).
// Every decision is a pure function of what all ranks of the epoch know
// alike (protocol.go, tested by driving the coordinator's real quorum
// machine through random histories), never of what one rank happened to
// form:
//
//  1. Who takes part: from the quorum, the replica groups that are
//     complete; rank i of each forms FT comm i (view.go).
//  2. How to get there: a formation can succeed at some ranks and fail at
//     others (an epoch superseded while forming), so a rank's memory of its
//     comms is not shared knowledge. Each rank reports to the coordinator
//     when it holds what an epoch asked of it (its comms, or none when it
//     sat out); the next quorum's Base is that epoch only if every
//     continuing participant reported it. With a Base, the ranks of Base's
//     FT comm shrink it (the new members are a subset, in order) or grow it
//     (joiners appended), and every other rank joins with a new comm; with
//     Base 0 everyone creates new comms. A lost or late report costs a new
//     comm, never a disagreement.
//  3. Where to continue from: the ranks all-gather (committed step, epoch
//     that committed it, state address) over the new comm and continue from
//     the most advanced step, and among equal steps the one committed by
//     the newest epoch. A rank holding anything else fetches that state
//     from every rank that holds it (package recovery), before Step returns.
//
// The old comms are revoked the moment a quorum or a revocation shows that
// one of their members is gone, so a survivor never waits out a collective
// timeout for a peer the coordinator already knows is dead. And any comm
// of a step failing acts at once (comm.Comm.Broken), before the
// coordinator knows: the step fails, its data comm is stopped when its
// control comm failed (NCCL never sees a dead peer; gloo sees its reset
// connection at once), and the peer the failure names is blamed to the
// coordinator, which confirms the death by the peer's closed port without
// waiting for gossip or its lease. A formation that passes its deadline
// blames the peers that never came. A peer that closed its comm in an
// orderly way (comm.ErrPeerClosed: it left, or moved on to a newer epoch)
// is never blamed, and fails the step only where one of its ops needed it.
// A rank whose step fails also blames every peer its control comm has
// heard nothing from at all (comm.SilenceReporter: gloo hears every peer
// every heartbeat): when one rank's op fails on a cut link, the others'
// end by the revocation, and this way the coordinator still sees the cut
// from both sides at once and keeps one of them.
//
// A step can also fail for a reason the training loop finds outside ft: a
// NaN in its loss, an error on a comm of its own (an FSDP shard comm), a
// data loader's failure. Between Step and Commit the loop calls FailStep:
// this rank votes no (the reason, wrapping ErrStepFailed, is the step's
// first error) and revokes its FT comms at once, as a failed collective
// of the step does, so that each peer's FT op of the step that needs this
// rank's part fails, and the peer's commit with it; with GroupSize > 1
// the group's vote carries the no to the rest of each group whose rank
// saw it. It costs no collective: across replica groups there is no vote
// to carry it (one would cost every step a round trip, and could itself
// complete at some ranks only), and a revocation is what any failure of
// the step sends already. A peer learns of it only through a collective,
// or through the coordinator once Commit has reported the failure, so a
// peer whose FT ops of the step all completed before the revocation
// reached it commits the step (this rank heals to it). The loop therefore
// fails the step before issuing the FT collective that would carry what
// is wrong — an all-reduce, reduce-scatter, all-gather or all-to-all
// needs every participant's part — and then no replica commits it.
//
// # Stalls
//
// Each rank keeps how long its last 64 steps took (from one Step's return
// to the next). Past its stall bound — Config.StallFactor times the
// slowest of them, at least Config.StallMin — a step that has not moved is
// reported to the coordinator, once: waiting (an op of the epoch, or the
// epoch's formation, has waited that long for peers; peers it hears
// nothing from at all are blamed instead, as above) or not stepping (the
// loop is idle since its last Commit, or computes without having started
// the step's collectives). The coordinator leaves out at once a
// participant that does not step while a peer waits for it, and lets it
// back when its loop steps again (it heals if behind): a hung data loader
// costs its peers about a second instead of the collective's Timeout. A
// replica merely slower than its peers makes the job's steps longer and
// its peers wait about one of their own steps for it, well within their
// bound. See docs/quorum.md, "Stalls".
//
// # Spares
//
// A process with Config.Spare registers as a warm standby: it builds what a
// replica builds (and ft warms its data backend up: a one-rank comm made
// and closed in New's background, so NCCL's one-time set-up — loading its
// kernels — is not paid in the promotion), and its first Step waits, taking
// part in nothing, until the coordinator promotes it because the job runs
// below its target size (the most replica groups of the run, or the job
// setting ftcomm.target_replicas). It is promoted in the epoch after the
// one that removed the dead (the survivors shrink first), a prepared grow
// (below), heals from its peers like a joiner, and Step returns with
// EventPromoted reported; Comm.Spare says whether it still waits. A replica
// restarted after a spare took its group's place waits as the next spare.
// See docs/spares.md.
//
// # Grows
//
// A grow — a spare promoted, a replica group restarted or joining — is
// prepared (membership.Quorum.Prepared, when the epoch only adds whole
// replica groups to the one before and nothing else changes): the survivors
// do not stop for it. Each forms the new epoch's FT comms in the background
// while its loop steps on in the old epoch (no step is revoked); once every
// rank of the new epoch holds them, the ranks agree, in one all-reduce on
// the new control comm, on a step a little ahead of the most advanced
// survivor (2 steps, more where steps are shorter than 25 ms), and every
// survivor moves at its first Step after committing it: it closes the old
// comms and gathers the step records on the new ones, where the joiners
// wait, and the joiners heal as any joiner does. So the joiner's start-up —
// a new process's first NCCL comm and its connections, a second on GPUs —
// costs the survivors nothing; they move in the time of a step record
// exchange. The ranks move at once instead (a survivor's step in flight
// fails, as at any new epoch) where that costs less device time — the
// survivors are at most three times the joiners, who would idle through a
// step and a half — or where the steps are not known yet, or the steps up
// to the move would keep the joiners waiting near Config.Timeout. A
// survivor that cannot prepare (its comms broke, it was still
// reconfiguring) forms the same comms and joins the same agreement when it
// reconfigures, so every rank runs the same collectives on the new comms.
// The new epoch is reported formed only when a survivor moves, and a newer
// epoch drops the preparation. The job setting ftcomm.prepared_grow = false
// turns prepared grows off. See docs/spares.md, "Prepared grows".
//
// # Peer snapshots
//
// A replica group whose shards have no copy in another group (an FSDP job
// whose one group spans every GPU) sets Config.SnapshotEvery = K: at the
// start of the step after every K-th committed step, each rank copies its
// registered state into host memory of its own, in the background of the
// step (Commit waits for the copy), and its buddy — another rank of the
// group, on another host where the group spans hosts — pulls that copy
// into its host memory. The group learns in its commit vote that every
// copy arrived: that snapshot is complete, and the next starts only then.
// When a rank is replaced — by its restarted process, or by a slot spare
// (Config.GroupRank AnyRank with Spare: New waits until a rank of its
// group dies and takes its place) — the group's ranks find at their
// reconfiguration that their steps differ, and restore the newest
// complete snapshot of which every rank has a copy: the new rank from its
// buddy's, the others from their own, once every rank holds its copy (a
// barrier), so that a death during the restore leaves every survivor's
// state as it was. Step reports EventRestored, and a *RollbackError with
// Snapshot set where steps were lost (at most K, more while transfers lag
// behind K steps). When a shard has no copy left (a rank died with its
// buddy) every rank's Step returns a *SnapshotLostError, before anything
// was written; the ranks pass a barrier before they return it, so one that
// exits at once does not cut a peer off before it has the inventories and
// the same decision (a silent peer delays the error up to the op timeout).
// See docs/snapshots.md.
//
// # Data
//
// NewSampler ties what each rank reads to the job's committed steps: the
// job's position (the samples its committed steps consumed) is registered
// state, so it heals with the model; between Step and Commit,
// Sampler.Plan cuts the step's global batch — the next positions of the
// epoch's permutation — among the step's participants by FT rank (and
// among a group's ranks by group rank), and the position moves only when
// Commit returns true. Across commits, failed steps, shrinks, grows and
// heals the job's committed steps read every sample of every epoch
// exactly once. SamplerConfig.Policy (or the job setting
// ftcomm.batch_policy, at run time) keeps either the per-replica batch
// (Plan.LRScale says how the global batch moved) or the global batch
// (survivors take more micro-batches, up to MaxAccum). See docs/data.md.
//
// # The end of a run
//
// When the training loop is done it calls Finish, then Close: the
// coordinator publishes the run's last step (membership.Quorum.Final), and
// every other replica's Step returns a *FinishedError (ErrFinished) — a
// replica that lagged behind or joined late never redoes a step its peers
// will never take again, and no replica waits for one that stopped. A
// replica that finished or left departs without revoking its epoch
// (membership.Quorum.Departed): a peer still ending the same step commits
// it. Every replica ends with the run's final state: Finish serves it
// (membership.Quorum.FinalFrom says where), Close after Finish waits —
// Config.Timeout at most — until no replica of the run is left that has
// not finished, and a replica behind the final step heals to it from
// those that finished before its Step returns the *FinishedError (whose
// Step is then Final), then says it finished too.
//
// # What Commit promises
//
// Commit votes: the step commits only if none of its collectives failed,
// the loop did not fail it (FailStep), at least MinReplicas replica groups
// took part and, with GroupSize > 1, every rank of the group voted yes (an
// all-reduce of min over the group's control comm). A failed commit rolls the step back (the caller skips its
// optimizer step), is reported to the coordinator, which forces the next
// epoch, and counts toward MaxCommitFailures. Avg divides by the
// participants of the step.
//
// A collective can complete at some ranks and fail at others (a link cut
// after a rank received its last bytes but before its peers did). Those
// ranks commit the step; the others fail it, and if the ones that
// committed are then cut off, the rest form a new epoch and commit the
// same step again with other participants — other contents. No vote taken
// over the same links can prevent this (the vote itself can complete at
// some ranks only), so ft offers two guarantees:
//
//   - Default: detection. Every replica keeps the epochs that committed its
//     steps (its history; it travels with healed state). When replicas
//     meet again, the agreement continues from the most advanced step, the
//     newest epoch winning a tie, and a replica whose own committed steps
//     are not in that history learns it while healing: Step returns a
//     *RollbackError naming the discarded steps (after healing to the job's
//     state, with the step started), the Comm reports EventRolledBack, and
//     ftcomm_ft_rollbacks_total counts it. A newer epoch that supersedes
//     the one that healed (a quorum arriving as the heal completes) does
//     not drop it: the next Step returns it all the same, merged with any
//     later rollback. Never a silent heal over a committed step. Cost:
//     nothing per step.
//   - DurableCommit: prevention. Before Commit returns true, each rank
//     records (step, epoch) in etcd with a transaction that succeeds only
//     if no other epoch recorded the step first. A replica that reports a
//     step committed therefore owns it for the job: the step is never
//     redone, and replicas that lose every holder of the job's newest step
//     wait (EventWaiting) for a quorum that brings one back instead of
//     redoing it; a waiting replica says so to the coordinator (`ftcoord
//     status`, the dashboard, ftcomm_coordinator_waiting_members). The
//     records are the job's current run's (below): replicas none of which
//     holds any step, facing records of their run, fail at once with a
//     *StaleRunError — no wait could end. Cost: one etcd transaction per
//     replica group per step (docs/scaling.md), and availability during
//     such a partition.
//
// In a replica group (GroupSize > 1) the group's rank 0 alone writes the
// record, after the group's vote said yes at every rank, and broadcasts
// whether the record names this epoch on the group's control comm; the
// other ranks commit only on that word. Why this keeps the guarantee: a
// rank commits step s in epoch e only if the record of s names e — the
// leader read it from etcd's one transaction, the others heard it from
// the leader over a comm of epoch e (the group comm is per epoch, so the
// word is about e, never an older epoch's record). The record is written
// once (create-if-absent, fenced on the run), so no other epoch can own s
// afterwards: no rank commits a step twice, nor a step the job's history
// lacks. The leader commits on its record whatever becomes of the
// broadcast (its record stands); a rank that never hears it does not
// commit and stands one step behind the rest of its group — the known
// limit below, with the record showing the step to heal to.
//
// TestPartitionProcesses cuts four replica processes apart in network
// namespaces mid-all-reduce, in both modes.
//
// What ends the wait of ranks whose collective spans a cut does not
// change this: the op's Timeout, a liveness check, a stall report or the
// coordinator's revocation. The epoch's collectives cross the cut, so
// no rank commits in it once the cut is complete; the coordinator (one
// fenced writer) keeps one side in the next epoch and revokes the old
// one; the other side sits the next epoch out with no comms. Ending the
// wait sooner only ends the same epoch sooner.
//
// # Runs
//
// A run is one training of a job from step 0, recorded with the job
// (membership.RunRecord). A replica with an empty Config.Run joins the
// job's current run (a restarted replica heals into it); a Config.Run the
// job has not used starts a new run once the previous run's replicas are
// gone (`ftcoord job new-run <job>` does it from outside). A new run
// starts with no commit records; a replica whose registration was lost
// registers again, with the step it holds, only in its own run, and Step
// fails with ErrMembershipLost (errors.Is membership.ErrRunEnded) once
// that ended.
//
// A run's history is never restarted from step 0 untold, in either mode:
// every quorum carries the highest step the run is known to have reached
// (membership.Quorum.RunStep; with DurableCommit the commit records say
// it too), and when no participant holds any step of a run that reached
// one — a job restarted with fresh replicas against a coordinator that
// kept its data — Step returns a *StaleRunError naming the choice: a new
// run (`ftcoord job new-run <job>`, or Config.Run), or this run continued
// from a restored state (Config.InitialStep: the step of the checkpoint
// the replica registered). By default the coordinator knows a run's step
// from the members' heartbeats (membership.MemberConfig.HeartbeatInterval),
// so a run that ended within its first heartbeat interval is not known to
// have reached a step; DurableCommit records every step.
//
// # Settings
//
// A job's settings (`ftcoord job set JOB key=value…`, the coordinator's
// API) reach the replicas through their quorums: a new version forms an
// epoch, and every participant of it takes the version from the epoch's
// first step, which their step agreement fixes. Settings returns what is
// in force for the current step; it changes only inside Step, with an
// EventSettings. A training loop that reads its learning rate or sync
// period from it after Step uses the same values at the same step as
// every other replica.
//
// # Replica groups (HSDP)
//
// With GroupSize > 1, rank i of every complete group forms FT comm i (the
// replicate dimension) and the group's ranks share a group comm (the shard
// dimension, Group()). Through Coordinator, the group's ranks share one
// etcd lease (membership.MemberConfig.GroupLease; Config.RankLeases opts
// out): the rank that joined first renews it, heartbeats and gossips for
// the group, the others hold a link to it; a rank whose link ends is
// removed by that leader, and when the leader's ends a rank takes the
// lease over — either way the coordinator sees one member gone, one
// epoch, as before. When any rank of a group dies, the group is
// incomplete in the next quorum and all its ranks sit out (ErrNotParticipating
// on their collectives); when the rank returns the group rejoins whole and
// its ranks heal shard by shard. ft registers GroupSize with the
// coordinator (membership.MemberRecord.GroupSize), which admits a group's
// ranks only together: the rest of a group that lost a rank leaves the
// epoch with it, so a group-mate's own death a moment later (a launcher
// ending the rest of the group) is no participant's and costs no epoch.
//
// A group keeps its comms from one epoch to the next while its ranks are
// the ones they were formed among (another group's death or return): at
// the reconfiguration its ranks vote on it on the group's control comm —
// every rank must hold both comms healthy — and form new ones otherwise
// (a rank that formed new ones closed these, which fails the vote at the
// others). Config.GroupBackend sets the backend of the group's data comm:
// a loop that shards over comms of its own (Python's FT-HSDP: FSDP2 over
// its own device mesh, with no Group()) sets it to the control backend,
// so the group has one host comm and no device comm to make.
//
// The group's gate: at every Step the group's ranks exchange, in one host
// all-reduce on the group's control comm, the newest epoch each knows and
// whether each could start the step in its current one, and the step
// starts only when every rank could, in one epoch, with no newer one known
// to any; otherwise they wait for the newest epoch together. A rank
// deciding alone could start the step while its group-mate reconfigures:
// the collectives of comms the group shares outside ft (FSDP's shard comm)
// would then differ at its two ranks and wait for each other until their
// timeout. The gate costs each Step one host round trip within the group
// (docs/measurements.md has the figure).
//
// Known limit: the group's vote is one all-reduce, so like any collective it
// can complete at one rank and fail at the other (a rank dying or its link
// cut mid-vote); the group's shards then stand one step apart. Healing
// repairs it when another replica group holds the lagging shard's step (rank
// i heals from FT comm i). With no such group that shard's step is lost:
// after every reconfiguration the group's ranks compare their steps (one
// small all-reduce on the group's control comm), and if they differ Step
// returns a *GroupDivergedError (ErrGroupDiverged) at every rank of the
// group, then and at every later call — restore the group from a
// checkpoint; it never trains on with its shards at different steps. With
// DurableCommit the lagging rank sees the job's recorded step above what
// its FT comm holds and waits (EventWaiting) instead.
//
// # Caller duties
//
//   - Register the state a healing replica needs, the same names in the
//     same order on every replica, before the first Step: host tensors, or
//     device tensors with a device data backend.
//   - Between Step and Commit do not write the registered state (it is
//     being served to healers); write it only after Commit returns true.
//   - Fail a step that went wrong outside ft (a NaN loss, a failed op on
//     a comm of the loop's own) with FailStep, before the FT collective
//     that would carry it; after it the step's remaining FT ops may be
//     issued (they fail at once) or skipped.
//   - Call Step, the collectives and Commit from one goroutine. Close may
//     come from another (a signal handler): it cancels a reconfiguring
//     Step, which returns ErrClosed.
//   - Treat a *RollbackError from Step as a started step whose registered
//     state moved to the job's history (a Sampler's position moved with
//     it; rewind any data position of your own). With SnapshotEvery,
//     register all of a rank's training state — parameters, optimizer
//     state, data position — or what is left out is not rolled back.
//   - At the end of the run call Finish, then Close (it may wait for
//     replicas behind to heal from this one: do not write the registered
//     state between the two); a *FinishedError from Step means another
//     replica ended the run.
//   - Close the Comm; it leaves the job gracefully. With a device data
//     backend, free the device tensors the Comm used (registered or passed
//     to its collectives) only after Close returns: Close waits until
//     every device comm it formed, those of earlier epochs included, has
//     stopped its GPU work (nccl: ncclCommAbort, run in the background
//     since the comm was closed) and no state-transfer copy it abandoned
//     still runs, at most Config.Timeout in all, and returns an error if
//     that is not so.
//
// # Backends: data on the GPU, control on the host
//
// The training loop's collectives run on the data backend (Config.Backend);
// ft's own control messages — the step agreement and the group's vote —
// run on a host comm. With a host backend (gloo) one comm does both. With a
// device backend (nccl) ft forms a control comm on ControlBackend (gloo by
// default; import it) beside every data comm, at the same epochs, through
// the same Store, moved the same way (shrink, grow or new), so no control
// message waits behind GPU work and Commit never needs the GPU; a failure
// of either fails the step. The collectives then take device tensors (a
// host tensor fails with comm.ErrInvalidArgument). NCCL cannot tell that
// a peer will never post its part of an op (a peer that moved to a new
// epoch, or whose control link failed, just stops calling), so when a new
// epoch appears in the middle of a step ft stops that step's device ops
// on the replicate dimension's data comm (never the control comms that
// carry the group's vote, nor the replica group's data comm, whose ranks
// started the step together at the group's gate; a group-mate that is
// gone stops the group's comms as well): the step fails
// within milliseconds rather than at the op's Timeout, and the next Step
// reconfigures. The group's own device ops (Group()) count in its vote: a
// failed one fails the step at every rank of the group. Registered device
// tensors heal through the data backend's comm.HostCopier: a source copies
// each requested chunk of its live device state into a pinned staging
// buffer and sends it; the healer receives chunks into pinned buffers and
// copies them into its device tensors — with the same authentication and
// CRC checks as host state, and no copy per step. With a device data
// backend that implements comm.HealthWatcher (nccl, through NVML), ft
// watches the GPU and reports the replica Critical on a fatal fault (XID,
// uncorrectable ECC, lost NVLink), with the reason shown on the coordinator's
// dashboard; Config.DisableHealthWatch turns that off.
//
// # Events
//
// Config.OnEvent receives every reconfiguration (and how), heal, rollback,
// sit-out, wait, failed commit and change of settings, in order, on the training goroutine
// while it waits in Step or Commit (or at its next call): what a progress
// display or a data loader needs to follow. An Event carries what it
// reports (epoch, step, rank, participants); the Comm's accessors may
// already show a later state.
//
// # Metrics
//
// Prometheus (Config.Registerer), labelled ftcomm_job and member:
// ftcomm_ft_failure_to_commit_seconds
// (first failure seen → next committed step), ftcomm_ft_detection_seconds
// (first failure seen → the resolving epoch known), ftcomm_ft_heal_seconds,
// ftcomm_ft_healed_bytes_total, ftcomm_ft_heal_bytes_per_second,
// ftcomm_ft_reconfigurations_total{how}, ftcomm_ft_commits_total{result},
// ftcomm_ft_epoch, ftcomm_ft_committed_step, ftcomm_ft_step_seconds,
// ftcomm_ft_rollbacks_total, ftcomm_ft_rolled_back_steps_total; and the
// op metrics of every comm the Comm forms (ftcomm_comm_ops_total,
// ftcomm_comm_bytes_total, ftcomm_comm_op_duration_seconds, by comm and op).
//
// # Concurrency
//
// A Comm runs its driver goroutine, which follows the membership's quorums
// and revocations and owns every comm; it releases what it holds when its
// loop ends at Close. Beside it at most one task of the
// driver's (forming comms, gathering records, healing, voting), one
// watcher per comm (it exits when the comm breaks or closes), and a
// reporter that sends the coordinator its reports in order (one that etcd
// did not take, as while the coordinator's etcd is down, is made again
// until it is: a failed epoch and the peers it blames are what the
// coordinator decides on, also after an outage). All exit by the
// time Close returns; so do the membership's, the recovery server's and
// (with a GPU data backend) the health watcher's.
//
// # Without a cluster
//
// coordinator/memcoord runs the coordinator's quorum machine in memory:
// Config.Membership = coord.Join(…) runs a whole job in one process (the
// package Example does), for tests and for trying ft out.
package ft
