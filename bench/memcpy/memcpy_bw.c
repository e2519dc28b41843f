// memcpy_bw measures this host's memory copy bandwidth from one process:
// T threads (default: every CPU it may run on) each memcpy a private
// buffer of -m MiB (default 256) into another, -n times; it prints the
// bytes copied per second over all threads (GB = 1e9), the ceiling
// bench/compare-cpu.sh states the shared-memory busbw against, and the
// same with one thread.
//
// With -r N it measures instead the bound of an N-rank all-reduce on this
// host: N input and N output buffers of -m MiB (default 64), every thread
// summing its slice of all N inputs and writing the sum into all N outputs
// with streaming stores. That is the least memory traffic an all-reduce of
// N ranks sharing one memory system can make (each input read once, each
// output written once, nothing through an intermediate buffer), so the
// busbw it prints (algbw x 2(N-1)/N, as for the all-reduces) is the most
// any implementation can reach here (the best of three runs after a warm-up;
// it needs AVX2).
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static size_t bytes = 256 << 20; static int reps = 4;
static pthread_barrier_t bar;
static int nranks, nthreads; static float **ins, **outs; static size_t elems;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static void *worker(void *arg) {
  char *src = malloc(bytes), *dst = malloc(bytes);
  memset(src, 1, bytes); memset(dst, 2, bytes);
  pthread_barrier_wait(&bar);
  for (int i = 0; i < reps; i++) {
    memcpy(dst, src, bytes);
    __asm__ volatile("" : : "r"(dst), "r"(src) : "memory"); // the copy must happen
  }
  pthread_barrier_wait(&bar);
  free(src); free(dst);
  return arg;
}

static double run(int threads) {
  pthread_t t[1024]; pthread_barrier_init(&bar, NULL, threads + 1);
  for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, worker, NULL);
  pthread_barrier_wait(&bar); double t0 = now();
  pthread_barrier_wait(&bar); double el = now() - t0;
  for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
  pthread_barrier_destroy(&bar);
  return (double)bytes * reps * threads / el / 1e9;
}

// One thread's slice of the all-reduce bound: 1 KiB blocks summed in
// registers-then-L1, streamed out to every output.
static void *arworker(void *arg) {
  long id = (long)arg;
  size_t lo = elems * id / nthreads & ~(size_t)7, hi = id == nthreads - 1 ? elems : elems * (id + 1) / nthreads & ~(size_t)7;
  for (int k = 0; k < nranks; k++) { memset(ins[k] + lo, 0, (hi - lo) * 4); memset(outs[k] + lo, 0, (hi - lo) * 4); }
  float tmp[256] __attribute__((aligned(32)));
  pthread_barrier_wait(&bar);
  for (int rep = 0; rep < reps; rep++) {
    for (size_t i = lo; i < hi; i += 256) {
      size_t m = hi - i < 256 ? hi - i : 256, j = 0;
      for (; j + 8 <= m; j += 8) {
        __m256 acc = _mm256_load_ps(ins[0] + i + j);
        for (int k = 1; k < nranks; k++) acc = _mm256_add_ps(acc, _mm256_load_ps(ins[k] + i + j));
        _mm256_store_ps(tmp + j, acc);
      }
      for (int r = 0; r < nranks; r++)
        for (size_t q = 0; q + 8 <= m; q += 8) _mm256_stream_ps(outs[r] + i + q, _mm256_load_ps(tmp + q));
    }
  }
  _mm_sfence();
  pthread_barrier_wait(&bar);
  return arg;
}

static double allreduce_bound(int threads, int n) {
  nranks = n; nthreads = threads; elems = bytes / 4 & ~(size_t)7;
  ins = calloc(n, sizeof *ins); outs = calloc(n, sizeof *outs);
  for (int k = 0; k < n; k++) { ins[k] = aligned_alloc(64, elems * 4); outs[k] = aligned_alloc(64, elems * 4); }
  pthread_t t[1024]; pthread_barrier_init(&bar, NULL, threads + 1);
  for (long i = 0; i < threads; i++) pthread_create(&t[i], NULL, arworker, (void *)i);
  pthread_barrier_wait(&bar); double t0 = now();
  pthread_barrier_wait(&bar); double el = now() - t0;
  for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
  pthread_barrier_destroy(&bar);
  for (int k = 0; k < n; k++) { free(ins[k]); free(outs[k]); }
  free(ins); free(outs);
  return (double)elems * 4 * reps / el / 1e9 * 2 * (n - 1) / n;
}

int main(int argc, char **argv) {
  cpu_set_t cs; sched_getaffinity(0, sizeof cs, &cs);
  int threads = CPU_COUNT(&cs);
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "-t")) threads = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "-m")) bytes = (size_t)atoi(argv[i + 1]) << 20;
    else if (!strcmp(argv[i], "-n")) reps = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "-r")) nranks = atoi(argv[i + 1]);
  }
  if (nranks) {
    if (nranks < 2 || nranks > 1024) { fprintf(stderr, "memcpy_bw: -r %d\n", nranks); return 2; }
    int custom = 0;
    for (int i = 1; i + 1 < argc; i += 2) custom |= !strcmp(argv[i], "-m");
    if (!custom) bytes = 64 << 20;
    int n = nranks;
    allreduce_bound(threads, n); // warm the pages
    double best = 0;
    for (int i = 0; i < 3; i++) { double b = allreduce_bound(threads, n); if (b > best) best = b; }
    printf("# allreduce_bound: %d ranks, %zu MiB, %d threads: busbw %.2f GB/s\n", n, bytes >> 20, threads, best);
    return 0;
  }
  if (threads < 1 || threads > 1024) { fprintf(stderr, "memcpy_bw: -t %d\n", threads); return 2; }
  run(threads); // warm the pages and the allocator
  double all = run(threads), one = run(1);
  printf("# memcpy_bw: %d threads, %zu MiB each, %d copies: %.2f GB/s copied (one thread %.2f GB/s)\n",
         threads, bytes >> 20, reps, all, one);
  return 0;
}
