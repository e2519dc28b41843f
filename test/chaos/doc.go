// Command chaos is ftcomm's process-level chaos harness: it
// starts the coordinators (an etcd server and three ftcoord instances on
// it, or one ftcoord with its embedded etcd) and N replica processes of a
// deterministic toy job on ft.Comm, injects faults on a schedule or at
// random (the nemesis: replica SIGKILL and SIGSTOP past the lease, the
// ftcoord leader killed or terminated, every ftcoord down, etcd
// restarted, a 2|2 partition, one replica cut off, a slow link), checks
// the invariants over the recorded timeline while it runs and at the end,
// and writes a report (report.json, report.txt, faults.json,
// events.jsonl, timeline.png). With Config.Spares (-spares) a pool of
// spare processes (ft.Config.Spare) waits beside the replicas, the faults
// targeting them too: a spare contributes to no step before its
// promotion, a loss with a spare ready is followed by the job at full
// size within Config.SpareBound, and no quorum is larger than
// Config.Replicas (spares.go). Every replica reads a dataset through an
// ft.Sampler (Config.Data) and records its reads with its commits: the
// job's committed history reads every sample of every epoch exactly once
// (data.go).
//
//	go test -race -v ./test/chaos                # the CI mix (TestChaosMix), 2–3 minutes
//	go run ./test/chaos -duration 30m -mtbf 15s  # a soak; -h lists the flags
//	go run ./test/chaos -spares 2 -faults kill,stop,partition,cut  # a soak with spares
//	go run ./test/chaos show -dir DIR -fault 7   # a recorded run's timeline around a fault
//
// Partitions and slow links use network namespaces joined by veth pairs
// when running as root (internal/netns), else a fault-injecting TCP proxy
// between the replicas.
//
// Lifecycle: Run starts every process it needs and stops all of them
// (replicas, coordinators, etcd, CPU hogs) and removes the namespaces
// before it returns, also when its ctx ends; the program doubles as a
// replica process and as the etcd server (chosen by its environment).
// Run's goroutines (the watcher, the epoch poller, one per child process
// and its output) exit before it returns. A Run uses one Config and is not
// shared; several runs may share a machine (namespaces, bridges and
// subnets get random names, ports come from the OS), at the cost of each
// other's CPU.
package main
