// memcpy_bw measures this host's memory copy bandwidth from one process:
// T threads (default: every CPU it may run on) each memcpy a private
// buffer of -m MiB (default 256) into another, -n times; it prints the
// bytes copied per second over all threads (GB = 1e9), the ceiling
// bench/compare-cpu.sh states the shared-memory busbw against, and the
// same with one thread.
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static size_t bytes = 256 << 20; static int reps = 4;
static pthread_barrier_t bar;

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

int main(int argc, char **argv) {
  cpu_set_t cs; sched_getaffinity(0, sizeof cs, &cs);
  int threads = CPU_COUNT(&cs);
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "-t")) threads = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "-m")) bytes = (size_t)atoi(argv[i + 1]) << 20;
    else if (!strcmp(argv[i], "-n")) reps = atoi(argv[i + 1]);
  }
  if (threads < 1 || threads > 1024) { fprintf(stderr, "memcpy_bw: -t %d\n", threads); return 2; }
  run(threads); // warm the pages and the allocator
  double all = run(threads), one = run(1);
  printf("# memcpy_bw: %d threads, %zu MiB each, %d copies: %.2f GB/s copied (one thread %.2f GB/s)\n",
         threads, bytes >> 20, reps, all, one);
  return 0;
}
