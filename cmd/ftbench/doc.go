// Command ftbench measures ftcomm's collectives the way nccl-tests measures
// NCCL's, and prints the same table.
//
//	go run ./cmd/ftbench                     # gloo, 2 ranks, allreduce float32, 8 B … 64 MiB
//	ftbench -np 4 -op all -b 1K -e 16M -f 4  # every collective, 4 ranks
//	ftbench -json                            # one JSON object per line
//
// # Processes
//
// The launcher (the command as you run it) starts an embedded etcd
// (etcdhost.StartEmbedded, on free loopback ports, in a temporary
// directory) and -np worker processes: the same binary again (marked by
// FTBENCH_WORKER=1 in its environment), told on the first line of its
// stdin which rank it is, where etcd is and the run's secret.
// Workers rendezvous through membership's Store and create a comm.Comm on
// -backend (a device backend such as nccl gets GPU = local rank). Each
// worker prints its measurements as JSON lines on stdout and its logs on
// stderr (prefixed "[rank r]" by the launcher); the launcher combines the
// ranks' rows and prints them.
//
// Every worker is cleaned up: the launcher kills all of them (SIGKILL, by
// pid) as soon as one fails, sends no heartbeat for -timeout + 30 s, or
// the launcher gets SIGINT or SIGTERM; a worker whose launcher died sees
// EOF on its stdin and exits (and the kernel kills it too: Pdeathsig).
// Every op runs under the -timeout deadline, so a lost peer fails the op.
// The exit status is 0 only if every rank finished and every element of
// every checked result was right; 2 for a bad command line.
//
// # Method
//
// For each (op, dtype, reduction) series and each size: fill inputs whose
// result is exactly known, run the op once and count the wrong elements
// (#wrong, summed over ranks), run -w warm-up iterations, barrier, time -n
// iterations back to back. time is the mean per-iteration time of the
// slowest rank; algbw = size/time; busbw = algbw × 2(n-1)/n for allreduce,
// × (n-1)/n for allgather, reducescatter and alltoall, × 1 for broadcast,
// reduce and sendrecv (nccl-tests' definitions); GB = 1e9 bytes. The size
// column is the total buffer size (for allgather, reducescatter and
// alltoall: all ranks' blocks; count is then one block).
//
// The raw TCP baseline (-raw, on by default) follows each size of the
// allreduce series: the same processes, over plain net.TCPConn on
// loopback, each sending to its right neighbour while receiving from its
// left the bytes a ring allreduce moves per rank, 2(n-1)/n of the size,
// with no reduction. Its busbw is the transport's ceiling on the host. Its
// table lines start with '#' (nccl-tests parsers skip them) and have type
// rawtcp; in JSON its op is "rawtcp".
//
// -cpuprofile p writes each worker's CPU profile to p.rank<r> (go tool
// pprof p.rank0); -trace p its execution trace (go tool trace p.rank0, or
// go tool trace -pprof=net p.rank0 for where it waited on the network).
package main
