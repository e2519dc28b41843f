// latency.c: the per-op cost of NCCL all-reduce when each op is waited for
// by polling the stream, in C, as a floor for ncclbench's blocking mode.
//
//   gcc -O2 -o latency latency.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -lnccl -lcudart -lpthread
//   ./latency NONBLOCKING PROCS    # NONBLOCKING 0|1: ncclConfig_t.blocking = !NONBLOCKING
//                                  # PROCS 0: one thread per GPU, 1: one process per GPU
//
// Two GPUs. Per size: 20 warm-up ops, then 200 ops each waited for
// (enqueue; on a nonblocking comm poll ncclCommGetAsyncError until it leaves
// ncclInProgress; spin on cudaStreamQuery), then 200 ops enqueued back to
// back and waited for once. Prints the mean per op of rank 0.
#include <nccl.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CK(x) do { int e_ = (int)(x); if (e_ != 0 && e_ != 7) { fprintf(stderr, "%s:%d %s = %d\n", __FILE__, __LINE__, #x, e_); exit(1); } } while (0)

static ncclUniqueId id;
static int nonblocking;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }

static void settle(ncclComm_t c) {
	if (!nonblocking) return;
	ncclResult_t a;
	do { CK(ncclCommGetAsyncError(c, &a)); } while (a == ncclInProgress);
	CK(a);
}

static void wait_stream(cudaStream_t s) {
	cudaError_t e;
	while ((e = cudaStreamQuery(s)) == cudaErrorNotReady) {}
	CK(e);
}

static void *rank_main(void *arg) {
	int r = (int)(long)arg;
	CK(cudaSetDevice(r));
	ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
	cfg.blocking = !nonblocking;
	ncclComm_t c;
	CK(ncclCommInitRankConfig(&c, 2, id, r, &cfg));
	settle(c);
	cudaStream_t s;
	CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	size_t maxb = 16 << 20;
	float *buf;
	CK(cudaMalloc((void **)&buf, maxb));
	size_t sizes[] = {8, 4096, 1 << 20, 16 << 20};
	for (int k = 0; k < 4; k++) {
		size_t n = sizes[k] / 4;
		for (int i = 0; i < 20; i++) { CK(ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, c, s)); settle(c); wait_stream(s); }
		double t0 = now(), enq = 0;
		for (int i = 0; i < 200; i++) {
			double a = now();
			CK(ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, c, s));
			settle(c);
			enq += now() - a;
			wait_stream(s);
		}
		double blocking = (now() - t0) / 200;
		double t1 = now();
		for (int i = 0; i < 200; i++) { CK(ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, c, s)); settle(c); }
		wait_stream(s);
		double stream = (now() - t1) / 200;
		if (r == 0)
			printf("C ref (%s comm): %9zu B  waited-for op %8.2f us (enqueue %.2f us)  back-to-back %8.2f us\n",
			       nonblocking ? "nonblocking" : "blocking", sizes[k], blocking, enq / 200, stream);
	}
	CK(ncclCommDestroy(c));
	return NULL;
}

int main(int argc, char **argv) {
	nonblocking = argc > 1 ? atoi(argv[1]) : 1;
	int procs = argc > 2 ? atoi(argv[2]) : 0;
	CK(ncclGetUniqueId(&id));
	printf("# %s per GPU\n", procs ? "one process" : "one thread");
	fflush(stdout);
	if (procs) {
		for (int r = 0; r < 2; r++) {
			if (fork() == 0) { rank_main((void *)(long)r); fflush(stdout); _exit(0); }
		}
		int st;
		while (wait(&st) > 0) {}
		return 0;
	}
	pthread_t t[2];
	for (int r = 0; r < 2; r++) pthread_create(&t[r], NULL, rank_main, (void *)(long)r);
	for (int r = 0; r < 2; r++) pthread_join(t[r], NULL);
	return 0;
}
