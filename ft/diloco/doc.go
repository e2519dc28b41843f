// Package diloco runs DiLoCo and Streaming DiLoCo (Douillard et al. 2023,
// 2025) on a fault-tolerant ft.Comm: replicas train locally with their own
// inner optimizer and synchronise only every H inner steps, and a replica
// that dies costs the others one discarded sync, not the job.
//
//	c, _ := ft.New(ctx, ft.Config{Job: "lm", Group: "g3", Coordinator: endpoints, Secret: secret, MinReplicas: 2})
//	d, _ := diloco.New(c, model.Params, diloco.DefaultStreamingConfig()) // registers the global state
//	for c.CommittedStep() < syncs {
//		out, err := d.Tick(ctx) // before every inner step: syncs when due
//		if err != nil { … }
//		if out.Healed { innerOptimizer.Reset() }
//		innerStep(model.Params) // forward, backward, AdamW: updates the params in place
//	}
//
// # The algorithm
//
// Every replica starts from the same parameters. The job's global
// parameters θ and the outer momentum m are copies DiLoCo keeps and
// registers with the ft.Comm (what a healing replica receives); the
// caller's parameters are the replica's local ones. A sync computes the
// outer gradient g = θ − local, averages it over the replicas that commit,
// and applies SGD with Nesterov momentum (PyTorch's form; lr 0.7, momentum
// 0.9 by default): m ← μm + g, θ ← θ − lr(g + μm). The new θ is then mixed
// into the local parameters: local ← α·local + (1−α)·θ.
//
// With Fragments = F > 1 (Streaming DiLoCo) the parameters are cut into F
// contiguous fragments and a sync every H/F inner steps carries one of
// them, round robin over the committed steps, so each fragment is synced
// every H inner steps and a sync moves 1/F of the bytes. With Overlap = τ
// the sync's exchange runs behind τ more inner steps before Tick waits for
// it, commits and merges; α blends the local progress of those steps with
// the new global fragment.
//
// Outer gradients may travel as 8- or 4-bit codes with one float32 scale
// per QuantBlock values and error feedback (what rounding lost is added to
// the next sync of the fragment). A sum of quantized codes cannot be
// formed in the wire dtype, so they are not all-reduced: with a Comm that
// offers AllToAll (AllToAller), each replica sends chunk j of its codes to
// replica j, which averages the chunk, quantizes the average (with its own
// error feedback) and all-gathers it — 2(n−1)/n payloads per replica, 4.25
// bits a value against float32's 32 at QuantBlock 128; otherwise every
// replica all-gathers every payload and averages locally, n−1 payloads per
// replica (ft.Comm today). Every replica decodes the same bytes in the
// same order, so the global parameters stay bit-identical.
//
// # Failures
//
// Each sync is one ft step: Tick calls Step (which reconfigures and heals
// when the membership changed), issues the exchange, and later Commit. A
// sync that does not commit is discarded: no outer update, no change to
// the residuals, the local parameters keep training, and the next sync
// retries the same fragment (the fragment is the committed step mod F, so
// replicas that agree on the step agree on it). A replica whose Step
// healed it (a restarted one, or one whose commit failed where others'
// succeeded) now holds the committed θ and m; DiLoCo resets its local
// parameters to θ, drops its residuals, reports Outcome.Healed (reset the
// inner optimizer), and sends weight 0 in that sync, as does every
// replica's first sync: the average counts only replicas with progress to
// add (the weights travel with the values).
//
// # Caller duties
//
//   - Pass the same initial parameters on every replica, and call New
//     before the Comm's first Step (New registers the global state).
//   - Call Tick before every inner step and nowhere else touch the Comm's
//     collectives while DiLoCo runs on it; Step, the collectives and Commit
//     all happen inside Tick, on the caller's goroutine (ft.Comm's rule).
//   - Between Ticks read Global and Momentum if you like, never write them.
//
// # Bytes
//
// Outcome.Payload is what this replica handed to the collectives in a
// sync; Outcome.Wire what it sent, computed from the volumes of gloo's
// algorithms (ring or recursive-doubling all-reduce, ring all-gather,
// pairwise all-to-all). BenchmarkSyncBytes checks Wire against the bytes
// the processes really write to their sockets.
//
// # Concurrency
//
// A DiLoCo belongs to one goroutine. It starts none: the collectives run
// on the Comm's own worker while Tick returns to the training loop.
package diloco
