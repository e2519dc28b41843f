// allreduce times Debian libgloo's ring allreduce over TCP loopback, one
// process per rank, and prints the nccl-tests table layout (size, count,
// type, redop, root, time, algbw, busbw, #wrong) so it can stand beside
// ftbench's output. It is the yardstick of bench/compare-gloo.sh.
//
//   allreduce -np 2 -b 4K -e 64M -f 4 -w 5 -n 20 [-algo ring|legacy]
//
// The parent forks -np ranks before any thread exists; they rendezvous
// through a gloo FileStore in a fresh temporary directory and connect a full
// mesh over 127.0.0.1. Rank 0 prints the rows. The parent waits for every
// rank; if one fails, it kills the others and exits non-zero. Every gloo op
// runs under a timeout, so a lost peer ends the run instead of hanging it.
//
// Method (the same as ftbench's): per size, fill float32 data whose sum is
// exact, run one allreduce and count wrong elements, run -w warm-up
// iterations, barrier, time -n back-to-back iterations; time is the mean
// per-iteration time of the slowest rank. algbw = bytes/time, busbw =
// algbw*2(n-1)/n, GB = 1e9.

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gloo/allreduce.h"
#include "gloo/allreduce_ring.h"
#include "gloo/barrier.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/transport/tcp/device.h"

namespace {

struct Options {
  int np = 2;
  size_t minBytes = 4096;
  size_t maxBytes = 64 << 20;
  double factor = 4;
  int warmup = 5;
  int iters = 20;
  std::string algo = "ring";  // ring: gloo::allreduce with RING; legacy: gloo::AllreduceRing
  int timeoutSec = 60;
};

[[noreturn]] void usage(const char* msg) {
  fprintf(stderr,
          "allreduce: %s\nusage: allreduce [-np N] [-b SIZE] [-e SIZE] [-f FACTOR] "
          "[-w WARMUP] [-n ITERS] [-algo ring|legacy] [-timeout SEC]\n",
          msg);
  exit(2);
}

size_t parseSize(const char* s) {
  char* end = nullptr;
  double v = strtod(s, &end);
  if (end == s || v < 0) usage("bad size");
  double mul = 1;
  switch (*end) {
    case 'k': case 'K': mul = 1024; end++; break;
    case 'm': case 'M': mul = 1024.0 * 1024; end++; break;
    case 'g': case 'G': mul = 1024.0 * 1024 * 1024; end++; break;
    default: break;
  }
  if (*end == 'B' || *end == 'b') end++;
  if (*end != '\0') usage("bad size suffix");
  return static_cast<size_t>(v * mul);
}

Options parseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (i + 1 >= argc) usage(("missing value for " + a).c_str());
    const char* v = argv[++i];
    if (a == "-np") o.np = atoi(v);
    else if (a == "-b") o.minBytes = parseSize(v);
    else if (a == "-e") o.maxBytes = parseSize(v);
    else if (a == "-f") o.factor = atof(v);
    else if (a == "-w") o.warmup = atoi(v);
    else if (a == "-n") o.iters = atoi(v);
    else if (a == "-algo") o.algo = v;
    else if (a == "-timeout") o.timeoutSec = atoi(v);
    else usage(("unknown flag " + a).c_str());
  }
  if (o.np < 1) usage("-np must be >= 1");
  if (o.minBytes < 4 || o.maxBytes < o.minBytes) usage("need 4 <= -b <= -e");
  if (o.factor <= 1) usage("-f must be > 1");
  if (o.iters < 1 || o.warmup < 0) usage("need -n >= 1 and -w >= 0");
  if (o.algo != "ring" && o.algo != "legacy") usage("-algo must be ring or legacy");
  if (o.timeoutSec < 1) usage("-timeout must be >= 1");
  return o;
}

// value is the input of element i on rank r: a small integer from a hash, so
// every partial sum is exact in float32 and a misplaced block is caught.
float value(int r, size_t i) {
  uint64_t z = (static_cast<uint64_t>(r) << 40) ^ i;
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<float>(z % 16);
}

void fill(std::vector<float>& buf, int rank) {
  for (size_t i = 0; i < buf.size(); i++) buf[i] = value(rank, i);
}

long countWrong(const std::vector<float>& buf, int np) {
  long wrong = 0;
  for (size_t i = 0; i < buf.size(); i++) {
    float want = 0;
    for (int r = 0; r < np; r++) want += value(r, i);
    if (buf[i] != want) wrong++;
  }
  return wrong;
}

// Runner runs one allreduce of the chosen algorithm over a fixed buffer.
class Runner {
 public:
  Runner(const std::shared_ptr<gloo::Context>& ctx, const std::string& algo,
         std::vector<float>& buf)
      : ctx_(ctx), buf_(buf) {
    if (algo == "legacy") {
      std::vector<float*> ptrs{buf.data()};
      legacy_ = std::make_unique<gloo::AllreduceRing<float>>(ctx, ptrs, static_cast<int>(buf.size()));
    } else {
      opts_ = std::make_unique<gloo::AllreduceOptions>(ctx);
      opts_->setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      opts_->setOutput(buf.data(), buf.size());
      void (*fn)(void*, const void*, const void*, size_t) = &gloo::sum<float>;
      opts_->setReduceFunction(fn);
    }
  }
  void run() {
    if (legacy_) legacy_->run();
    else gloo::allreduce(*opts_);
  }

 private:
  std::shared_ptr<gloo::Context> ctx_;
  std::vector<float>& buf_;
  std::unique_ptr<gloo::AllreduceRing<float>> legacy_;
  std::unique_ptr<gloo::AllreduceOptions> opts_;
};

// reduceScalars combines per-rank (time, wrong) pairs: max time, summed wrong.
void reduceScalars(const std::shared_ptr<gloo::Context>& ctx, double* t, double* wrong) {
  gloo::AllreduceOptions o(ctx);
  o.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
  o.setOutput(t, 1);
  void (*mx)(void*, const void*, const void*, size_t) = &gloo::max<double>;
  o.setReduceFunction(mx);
  gloo::allreduce(o);
  gloo::AllreduceOptions s(ctx);
  s.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
  s.setOutput(wrong, 1);
  void (*sm)(void*, const void*, const void*, size_t) = &gloo::sum<double>;
  s.setReduceFunction(sm);
  gloo::allreduce(s);
}

void barrier(const std::shared_ptr<gloo::Context>& ctx) {
  gloo::BarrierOptions b(ctx);
  gloo::barrier(b);
}

int runRank(const Options& o, int rank, const std::string& dir) {
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  attr.ai_family = AF_INET;
  auto dev = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore store(dir);
  gloo::rendezvous::PrefixStore prefixed("allreduce", store);
  auto rctx = std::make_shared<gloo::rendezvous::Context>(rank, o.np);
  rctx->setTimeout(std::chrono::seconds(o.timeoutSec));
  rctx->connectFullMesh(prefixed, dev);
  std::shared_ptr<gloo::Context> ctx = rctx;

  if (rank == 0) {
    printf("# libgloo %s allreduce, %d ranks, tcp loopback, float32 sum, warmup %d, iters %d\n",
           o.algo == "legacy" ? "AllreduceRing" : "AllreduceOptions(RING)", o.np, o.warmup, o.iters);
    printf("#\n");
    printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s\n", "size", "count", "type",
           "redop", "root", "time", "algbw", "busbw", "#wrong");
    printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s\n", "(B)", "(elements)", "", "", "",
           "(us)", "(GB/s)", "(GB/s)", "");
    fflush(stdout);
  }
  long totalWrong = 0;
  for (double sz = static_cast<double>(o.minBytes); sz <= static_cast<double>(o.maxBytes) * 1.000001;
       sz *= o.factor) {
    size_t count = static_cast<size_t>(sz) / sizeof(float);
    if (count == 0) continue;
    std::vector<float> buf(count);
    Runner runner(ctx, o.algo, buf);
    fill(buf, rank);
    runner.run();
    double wrong = static_cast<double>(countWrong(buf, o.np));
    for (int i = 0; i < o.warmup; i++) runner.run();
    barrier(ctx);
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < o.iters; i++) runner.run();
    auto t1 = std::chrono::steady_clock::now();
    double us = std::chrono::duration<double, std::micro>(t1 - t0).count() / o.iters;
    reduceScalars(ctx, &us, &wrong);
    totalWrong += static_cast<long>(wrong);
    if (rank == 0) {
      double bytes = static_cast<double>(count * sizeof(float));
      double algbw = bytes / (us * 1e-6) / 1e9;
      double busbw = algbw * 2.0 * (o.np - 1) / o.np;
      char tbuf[32];
      if (us >= 10000) snprintf(tbuf, sizeof tbuf, "%7.0f", us);
      else if (us >= 100) snprintf(tbuf, sizeof tbuf, "%7.1f", us);
      else snprintf(tbuf, sizeof tbuf, "%7.2f", us);
      printf("  %10zu  %12zu  %8s  %6s  %6d  %7s  %6.2f  %6.2f  %6ld\n", count * sizeof(float), count,
             "float", "sum", -1, tbuf, algbw, busbw, static_cast<long>(wrong));
      fflush(stdout);
    }
  }
  barrier(ctx);
  if (totalWrong != 0) {
    if (rank == 0) fprintf(stderr, "allreduce: %ld wrong elements\n", totalWrong);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parseArgs(argc, argv);
  char tmpl[] = "/tmp/gloo-allreduce-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    perror("allreduce: mkdtemp");
    return 1;
  }
  std::string dir = tmpl;
  fflush(stdout);
  std::vector<pid_t> pids;
  for (int r = 0; r < o.np; r++) {
    pid_t pid = fork();
    if (pid < 0) {
      perror("allreduce: fork");
      for (pid_t p : pids) kill(p, SIGKILL);
      return 1;
    }
    if (pid == 0) {
      int rc = 1;
      try {
        rc = runRank(o, r, dir);
      } catch (const std::exception& e) {
        fprintf(stderr, "allreduce: rank %d: %s\n", r, e.what());
        rc = 1;
      }
      fflush(stdout);
      _exit(rc);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  size_t left = pids.size();
  while (left > 0) {
    int status = 0;
    pid_t p = wait(&status);
    if (p < 0) break;
    left--;
    bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && !failed) {
      failed = 1;
      for (size_t r = 0; r < pids.size(); r++) {
        if (pids[r] == p) {
          fprintf(stderr, "allreduce: rank %zu failed (%s %d); killing the others\n", r,
                  WIFEXITED(status) ? "exit" : "signal",
                  WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
        }
      }
      for (pid_t q : pids) {
        if (q != p) kill(q, SIGKILL);
      }
    }
  }
  std::string cmd = "rm -rf '" + dir + "'";
  if (system(cmd.c_str()) != 0) fprintf(stderr, "allreduce: could not remove %s\n", dir.c_str());
  return failed;
}
