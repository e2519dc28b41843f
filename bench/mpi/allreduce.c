// allreduce times MPI_Allreduce (float32 sum) with the method and table of
// cmd/ftbench and bench/gloo/allreduce.cc, so Open MPI's shared-memory
// transport (vader) can stand beside them in bench/compare-cpu.sh.
//
//   mpirun -np 2 --mca pml ob1 --mca btl self,vader allreduce -b 4K -e 64M -f 4 -w 5 -n 20
//
// Per size: exact float32 inputs, one checked op (#wrong), -w warm-up
// iterations, a barrier, -n timed iterations; time is the slowest rank's
// mean; busbw = algbw * 2(n-1)/n, GB = 1e9.
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t size_arg(const char *s) {
  char *e; double v = strtod(s, &e);
  if (*e == 'K' || *e == 'k') v *= 1024; else if (*e == 'M' || *e == 'm') v *= 1048576;
  else if (*e == 'G' || *e == 'g') v *= 1073741824.0;
  return (size_t)v;
}

static float value(int r, size_t i) { return (float)((i * 7 + (size_t)r * 13) % 16); }

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, np; MPI_Comm_rank(MPI_COMM_WORLD, &rank); MPI_Comm_size(MPI_COMM_WORLD, &np);
  size_t lo = 4096, hi = 64 << 20; double f = 4; int warm = 5, iters = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "-b")) lo = size_arg(argv[i + 1]); else if (!strcmp(argv[i], "-e")) hi = size_arg(argv[i + 1]);
    else if (!strcmp(argv[i], "-f")) f = atof(argv[i + 1]); else if (!strcmp(argv[i], "-w")) warm = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "-n")) iters = atoi(argv[i + 1]);
    else { if (!rank) fprintf(stderr, "allreduce: unknown flag %s\n", argv[i]); MPI_Abort(MPI_COMM_WORLD, 2); }
  }
  if (!rank) printf("# MPI_Allreduce, %d ranks, float32 sum, warmup %d, iters %d\n#\n"
                    "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s\n", np, warm, iters,
                    "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong");
  long total = 0;
  for (double sz = lo; sz <= hi * 1.000001; sz *= f) {
    size_t n = (size_t)sz / 4; float *buf = malloc(n * 4);
    for (size_t i = 0; i < n; i++) buf[i] = value(rank, i);
    MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    long wrong = 0;
    for (size_t i = 0; i < n; i++) { float w = 0; for (int r = 0; r < np; r++) w += value(r, i); wrong += buf[i] != w; }
    for (int i = 0; i < warm; i++) MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; i++) MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double us = (MPI_Wtime() - t0) * 1e6 / iters, mx; long wsum;
    MPI_Reduce(&us, &mx, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    MPI_Reduce(&wrong, &wsum, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
    if (!rank) { double alg = n * 4.0 / (mx * 1e-6) / 1e9;
      printf("  %10zu  %12zu  %8s  %6s  %6d  %7.2f  %6.2f  %6.2f  %6ld\n", n * 4, n, "float", "sum", -1, mx, alg, alg * 2.0 * (np - 1) / np, wsum);
      fflush(stdout); total += wsum; }
    free(buf);
  }
  MPI_Finalize();
  return total != 0;
}
