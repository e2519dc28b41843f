// Command diloco trains a character-level language model on Go source
// with Streaming DiLoCo over ft.Comm, kills a replica midway, restarts it,
// and shows that the job heals and ends where a run without failures ends.
//
//	go run ./examples/diloco            # 4 replicas on gloo, about 2 minutes on 2 cores
//	go run ./examples/diloco -h         # replicas, H, F, τ, α, quantization, failure schedule…
//
// It starts an embedded coordinator (etcd + ftcoord's coordinator,
// package coordinator/server) in this process and the replicas as processes of this
// same program (re-executed with FTCOMM_DILOCO_REPLICA set), alongside
// the same job without failures for comparison, and writes a summary and
// a loss-curve plot into the report folder (diloco-report/).
//
// # Settings while it runs
//
// The replicas follow their job's settings (ft.Comm.Settings): lr, the
// peak inner learning rate; outer_lr; and sync_every, H (a multiple of F).
// Change them while the demo runs, against the API of its dashboard's
// address:
//
//	ftcoord job set -addr http://127.0.0.1:PORT with-failures outer_lr=0.5 sync_every=200
//
// Every replica takes the new values at the same sync (the first of the
// epoch that carries them); the demo notes it. A run changed so no longer
// ends where the run without failures ends, unless that job gets the same
// changes at the same sync. ftcomm.batch_policy=global makes a sync with
// fewer replicas keep the global batch (see Data).
//
// # Data
//
// The replicas read the training text through ft's Sampler
// (ft.NewSampler, registered with the model, so a replica that heals
// takes the job's position with the global parameters): sample i is the
// text position Context+i, each epoch a permutation of them (-seed). A
// sync is one ft step, and its plan is what the replica's inner steps
// read from the sync's commit to the next commit: H/F micro-batches of
// -batch samples at the job's size (SamplerConfig.Accum = H/F, Replicas =
// -replicas), one per inner step. From the commit, not from the sync's
// start: the position advances only when a sync commits, while DiLoCo
// keeps the local progress of a sync that does not — inner steps that read
// a plan before its sync committed would, if it failed, read again the
// samples the retried sync hands out. After a sync that did not commit
// here the inner steps read nothing until the next commit (they pass on to
// it at once), and the τ inner steps before the first commit read nothing.
// So each sample a committed sync hands out goes to one replica, once; what
// a replica read since its last sync is lost with its local progress when
// it dies or heals, as DiLoCo loses it; the plan of the run's last sync is
// handed out and not read (the run ends there).
//
// Under the job setting ftcomm.batch_policy=global a sync of fewer
// replicas keeps the global batch: each survivor's plan has more
// micro-batches, spread evenly over the window's inner steps (some steps
// take two, their gradients averaged by size); a plan with fewer leaves
// some steps idle, and a window that sync_every made longer or shorter
// spreads its plan the same way. Learning rates are not scaled by
// Plan.LRScale: an inner step's batch stays the replica's own.
//
// Each replica appends its committed syncs' plans to plans/ in the report
// folder (one line per sync, written before the sync is reported), and
// the summary checks from them that the committed syncs read each sample
// they handed out once ("samples the committed syncs read"). The share of
// a replica that did not see its sync commit (killed before it recorded
// it, or its commit failed where the others' succeeded) is counted from
// the sync's size, and reported unread.
//
// # Roles
//
// The program is the demo (the parent) unless FTCOMM_DILOCO_REPLICA holds
// a replica's spec, when it is one replica process: it reads run.json
// from the report folder, registers with the coordinator through ft.New,
// reports "start" on stdout (JSON lines), waits for the demo's "go" on
// stdin (so a job's first quorum has all its replicas), trains, reports
// every sync, snapshot and ft event, and exits when the job has committed
// its syncs or when its stdin closes (the demo is gone).
//
// # Lifecycle
//
// The demo's goroutines: one per replica process reading its stdout
// (it exits at the process's end), one evaluator of snapshots (it exits
// when the demo closes its queue), the coordinator's Run (stopped by its
// close), and the progress container's. Run returns after every replica
// process has exited: on the end of the run, on SIGINT/SIGTERM, on
// -timeout or on an unexpected replica exit (stdin closed, then SIGKILL
// after 5 s).
package main
