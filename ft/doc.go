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
//		c.AllReduce(ctx, comm.Float32s(grads), comm.Avg) // an error here is recorded, not raised
//		if ok, err := c.Commit(ctx); ok { optimizer.Step() } else if err != nil { … }
//	}
//
// # The step protocol
//
// Each process registers with the coordinator (membership) as member
// "<group>.<group rank>". The coordinator publishes quorums (epochs); the
// Comm follows them by watch, so a step whose epoch is unchanged costs no
// round trip. Step moves to a new epoch when there is one: it derives from
// the quorum which replica groups are complete and so take part, then
// shrinks the fault-tolerant (FT) comm when the participants are a subset of
// the last ones, grows it when joiners were appended, and creates it afresh
// otherwise — a choice made from the quorum alone, so every rank makes the
// same one. It then agrees on steps with one all-gather, and a replica that
// is behind fetches the committed state of the most advanced step from every
// replica at that step (package recovery) before Step returns.
//
// The old comm is revoked the moment a quorum or a revocation record shows
// that one of its members is gone, so a survivor never waits out a
// collective timeout for a peer the coordinator already knows is dead.
//
// Commit votes: the step commits only if none of its collectives failed,
// at least MinReplicas replica groups took part and, with GroupSize > 1,
// every rank of the group voted yes (an all-reduce of min over the group's
// comm). A failed commit rolls the step back (the caller skips its
// optimizer step), is reported to the coordinator, which forces the next
// epoch, and counts toward MaxCommitFailures. Avg divides by the
// participants of the step.
//
// # Replica groups (HSDP)
//
// With GroupSize > 1, rank i of every complete group forms FT comm i (the
// replicate dimension) and the group's ranks share a group comm (the shard
// dimension, Group()). When any rank of a group dies, the group is
// incomplete in the next quorum and all its ranks sit out (ErrNotParticipating
// on their collectives); when the rank returns the group rejoins whole and
// its ranks heal shard by shard.
//
// # Caller duties
//
//   - Register the state a healing replica needs (host memory), the same
//     names in the same order on every replica, before the first Step.
//   - Between Step and Commit do not write the registered state (it is
//     being served to healers); write it only after Commit returns true.
//   - Call Step, the collectives and Commit from one goroutine.
//   - Close the Comm; it leaves the job gracefully.
//
// # Backends
//
// The FT and group comms carry ft's own control messages (the step
// agreement, the group's commit vote) in host memory, so ft needs a
// host-memory backend such as gloo; a device backend is refused with
// comm.ErrBackendUnavailable at the first Step. GPU jobs use ft for the
// fault-tolerant replicate dimension on CPU-resident gradients, or drive
// backends/nccl directly through comm (with Revoke, Shrink and Grow) from
// the epochs ft publishes.
//
// # Metrics
//
// Prometheus (Config.Registerer): ftcomm_ft_failure_to_commit_seconds
// (first failure seen → next committed step), ftcomm_ft_detection_seconds
// (first failure seen → the resolving epoch known), ftcomm_ft_heal_seconds,
// ftcomm_ft_healed_bytes_total, ftcomm_ft_heal_bytes_per_second,
// ftcomm_ft_reconfigurations_total{how}, ftcomm_ft_commits_total{result},
// ftcomm_ft_epoch, ftcomm_ft_committed_step, ftcomm_ft_step_seconds.
//
// # Concurrency
//
// A Comm runs one goroutine, which follows the membership's quorums and
// revocations and exits in Close; its membership and recovery server run
// their own, also stopped by Close.
package ft
