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
// changes at the same sync.
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
