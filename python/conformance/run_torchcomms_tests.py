#!/usr/bin/env python3
"""Run torchcomms' own Python integration tests against ftcomm.

torchcomms (github.com/meta-pytorch/torchcomms) tests its backends with
comms/torchcomms/tests/integration/py/*Test.py, each run as N rank
processes. This runner runs those files, unchanged, from a checkout of
torchcomms, with ``torchcomms`` resolving to ftcomm (the alias package next
to this file: every name comes from ftcomm, and ``torchcomms.tests`` from the
checkout). No torchcomms code is copied into this repository.

    git clone https://github.com/meta-pytorch/torchcomms /tmp/torchcomms
    go build -buildmode=c-shared -o /tmp/libftcomm.so ./capi
    FTCOMM_LIBRARY=/tmp/libftcomm.so /usr/bin/python3 python/conformance/run_torchcomms_tests.py \\
        --torchcomms /tmp/torchcomms --backend gloo --ranks 2,4 --sweep 0,1

Each (ranks, sweep, file) runs as N processes of ``python -m pytest`` with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and a free
MASTER_PORT), TEST_BACKEND, TEST_DEVICE (cpu for gloo) and TEST_FULL_SWEEP,
each process in a session of its own so that a hung file is killed whole at
--timeout. A test's outcome is the worst over its ranks (failed > error >
passed > skipped). Tests that cannot apply to ftcomm are listed in
NOT_APPLICABLE with the reason; they run, and are reported apart.

Torch 1.13 (Debian's, CI's) lacks torch.accelerator, which torchcomms'
helpers call; the runner adds a CPU-only one (nothing available) when the
running torch has none, so the tests run there too.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(HERE)  # python/, where the ftcomm package is

# The communicator API of torchcomms: every file of tests/integration/py that
# exercises a TorchComm directly (collectives, point-to-point, split,
# reconfigure, options, object collectives, lifecycle).
CORE = [
    "AbortTest.py", "AllGatherSingleTest.py", "AllGatherTest.py", "AllGatherVTest.py", "AllReduceTest.py",
    "AllToAllSingleTest.py", "AllToAllTest.py", "AllToAllvSingleTest.py", "BarrierTest.py",
    "BatchSendRecvTest.py", "BroadcastTest.py", "ExpandableSegmentsTest.py", "FinalizeWarningTest.py",
    "GatherSingleTest.py", "GatherTest.py", "GetInitHandleTest.py", "LazyP2PTest.py",
    "MultiCommTest.py", "ObjColTest.py", "OptionsTest.py", "ReconfigureTest.py", "ReduceScatterSingleTest.py",
    "ReduceScatterTest.py", "ReduceScatterVTest.py", "ReduceTest.py", "RegisterTensorTest.py", "ScatterTest.py",
    "SendRecvTest.py", "SplitTest.py", "WaitBlockingTest.py",
]

# PyTorch's parallelism stack over torchcomms (torch.distributed backend,
# DeviceMesh, DDP, FSDP2, DTensor): --set torch.
TORCH = [
    "BackendWrapperAllGatherAliasedTest.py", "BackendWrapperCoalescingTest.py", "BackendWrapperShutdownTest.py",
    "C10dBatchIsendIrecvTest.py", "C10dTorchCommTest.py", "DDPCommTest.py", "DPTPCommTest.py", "DeviceMeshTest.py",
    "FSDPCommTest.py", "MonitoredBarrierTest.py", "TPCommTest.py",
]

# Files of tests/integration/py that are in neither set, and why.
OUTSIDE = {
    "AllGatherPTest.py": "persistent all-gather (all_gather_p_*) is an NCCLX extension",
    "CudaGraphsAllGatherAwareTest.py": "CUDA graph capture of collectives: ftcomm's ops are not capturable",
    "CudaGraphsConcurrencyTest.py": "CUDA graph capture of collectives: ftcomm's ops are not capturable",
    "CudaGraphsLifecycleTest.py": "CUDA graph capture of collectives: ftcomm's ops are not capturable",
    "CudaGraphsMultipleTest.py": "CUDA graph capture of collectives: ftcomm's ops are not capturable",
    "CudaGraphsSingleTest.py": "CUDA graph capture of collectives: ftcomm's ops are not capturable",
    "CudaGraphsWindowTest.py": "CUDA graphs and RMA windows",
    "FullgraphCompileAutogradTest.py": "torch.compile of torchcomms' functional collectives (torchcomms.functional)",
    "FullgraphCompileTest.py": "torch.compile of torchcomms' functional collectives (torchcomms.functional)",
    "LazySetupChannelsTest.py": "NCCLX only",
    "MemPoolTest.py": "get_mem_allocator (an ncclMemAlloc pool for torch.cuda.MemPool): ftcomm has none",
    "SymmMemRendezvousTest.py": "symmetric memory",
    "TimeoutTest.py": "every test is NCCLX-only (skip_unless_ncclx: the watchdog aborting the process, CUDA graphs); "
                      "ftcomm's own test_abort_process_on_timeout_or_error covers abort_process_on_timeout_or_error",
    "WindowRmaTest.py": "RMA windows (new_window)",
}

# Single tests that cannot apply, by "File.py::Class::test".
NOT_APPLICABLE = {
    "WaitBlockingTest.py::WaitBlockingTest::test_wait_blocking_unsupported_backend":
        "asserts that the backend lacks wait_blocking(); ftcomm implements it (python/tests cover it)",
}

_RESULT = re.compile(r"^(\S+\.py::\S+?)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_RANK = {"FAILED": 4, "ERROR": 3, "XPASS": 2, "PASSED": 1, "XFAIL": 0, "SKIPPED": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def package_dir(path: str, work: str) -> str:
    """The directory of the torchcomms Python package (comms/torchcomms) in a
    checkout; a bare or mirror git directory is exported into work first."""
    for cand in (os.path.join(path, "comms", "torchcomms"), path):
        if os.path.isdir(os.path.join(cand, "tests", "integration", "py")):
            return os.path.abspath(cand)
    if os.path.exists(os.path.join(path, "HEAD")):  # a git directory without a work tree
        out = os.path.join(work, "torchcomms")
        os.makedirs(out)
        arch = subprocess.run(["git", "--git-dir", path, "archive", "--prefix=comms/torchcomms/tests/",
                               "HEAD:comms/torchcomms/tests"], check=True, stdout=subprocess.PIPE).stdout
        subprocess.run(["tar", "-x", "-C", out], input=arch, check=True)
        return os.path.join(out, "comms", "torchcomms")
    sys.exit("no comms/torchcomms/tests/integration/py under %s" % path)


def write_shims(work: str) -> str:
    """A sitecustomize that gives torch < 2.6 the torch.accelerator the
    helpers call (CPU only), imported by every rank process; and a pytest
    plugin that prints a failure's traceback when it happens (a rank killed
    at the timeout never reaches pytest's summary)."""
    d = os.path.join(work, "shims")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "ftcomm_instafail.py"), "w") as f:
        f.write(
            "def pytest_runtest_logreport(report):\n"
            "    if report.failed:\n"
            "        print('\\n--- %s %s\\n%s' % (report.nodeid, report.when, report.longreprtext), flush=True)\n")
    with open(os.path.join(d, "sitecustomize.py"), "w") as f:
        f.write(
            "try:\n"
            "    import torch, types\n"
            "    if not hasattr(torch, 'accelerator'):\n"
            "        torch.accelerator = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0,\n"
            "                                                  current_accelerator=lambda: None)\n"
            "except ImportError:\n"
            "    pass\n")
    return d


def run_file(pkg: str, test: str, backend: str, ranks: int, sweep: int, timeout: float, shims: str,
             python: str, logdir: str) -> Tuple[Dict[str, str], str, float]:
    """Runs one test file as `ranks` processes; returns {test: outcome},
    the file's status ("ok", "failed", "timeout") and its duration."""
    testdir = os.path.join(pkg, "tests", "integration", "py")
    port = free_port()
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join([HERE, PACKAGE, shims] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
        "FTCOMM_TORCHCOMMS_PACKAGE": pkg, "TEST_BACKEND": backend, "TEST_FULL_SWEEP": str(sweep),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    })
    if backend == "gloo":
        env["TEST_DEVICE"] = "cpu"
    procs, logs = [], []
    t0 = time.monotonic()
    for r in range(ranks):
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r), GROUP_RANK="0")
        log = open(os.path.join(logdir, "%s.n%d.s%d.r%d.log" % (test[:-3], ranks, sweep, r)), "w+")
        logs.append(log)
        procs.append(subprocess.Popen([python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "ftcomm_instafail",
                                       "-o",
                                       "faulthandler_timeout=%d" % max(60, int(timeout) - 30), test],
                                      cwd=testdir, env=e, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    status = "ok"
    deadline = t0 + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            status = "timeout"
            break
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        elif p.returncode not in (0, 5) and status == "ok":  # 5: no tests collected
            status = "failed"
    results: Dict[str, str] = {}
    for log in logs:
        log.seek(0)
        for line in log:
            m = _RESULT.match(line)
            if m:
                name, out = m.group(1), m.group(2)
                if _RANK[out] >= _RANK.get(results.get(name, "SKIPPED"), 0):
                    results[name] = out
        log.close()
    if not results and status != "timeout":
        results[test + "::<collection>"] = "ERROR"
    return results, status, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torchcomms", required=True, help="a torchcomms checkout (or its git directory)")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--ranks", default="2", help="comma-separated rank counts (default 2)")
    ap.add_argument("--sweep", default="0", help="TEST_FULL_SWEEP values (default 0)")
    ap.add_argument("--set", default="core", choices=["core", "torch", "all"], help="which files (default core)")
    ap.add_argument("--files", default="", help="comma-separated files instead of --set")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per file and configuration")
    ap.add_argument("--jobs", type=int, default=1, help="files run at once (each with its own ranks; default 1)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--logs", default="", help="keep the rank logs here (default: a temporary directory)")
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="ftcomm-torchcomms-")
    pkg = package_dir(args.torchcomms, work)
    shims = write_shims(work)
    logdir = args.logs or os.path.join(work, "logs")
    os.makedirs(logdir, exist_ok=True)
    files = [f for f in args.files.split(",") if f] or {"core": CORE, "torch": TORCH, "all": CORE + TORCH}[args.set]

    report = {"backend": args.backend, "python": args.python, "torchcomms": args.torchcomms, "runs": []}
    configs = [(ranks, sweep, f) for ranks in [int(x) for x in args.ranks.split(",")]
               for sweep in [int(x) for x in args.sweep.split(",")] for f in files]

    def one(cfg):
        ranks, sweep, f = cfg
        return cfg, run_file(pkg, f, args.backend, ranks, sweep, args.timeout, shims, args.python, logdir)

    worst = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for (ranks, sweep, f), (res, status, secs) in pool.map(one, configs):
            counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0, "not_applicable": 0}
            bad = []
            for name, out in sorted(res.items()):
                if name in NOT_APPLICABLE:
                    counts["not_applicable"] += 1
                elif out in ("PASSED", "XFAIL"):
                    counts["passed"] += 1
                elif out == "SKIPPED":
                    counts["skipped"] += 1
                else:
                    counts["failed" if out in ("FAILED", "XPASS") else "error"] += 1
                    bad.append("%s %s" % (out, name))
            if status == "timeout":
                bad.append("TIMEOUT after %.0f s" % secs)
            if bad:
                worst = 1
            elif status == "failed":
                status = "ok"  # only tests that cannot apply failed
            report["runs"].append({"file": f, "ranks": ranks, "sweep": sweep, "status": status,
                                   "seconds": round(secs, 1), "counts": counts, "not_passed": bad})
            print("%-38s n=%d sweep=%d %-7s %6.1fs  pass %3d  fail %d  error %d  skip %d  n/a %d" % (
                f, ranks, sweep, status, secs, counts["passed"], counts["failed"], counts["error"],
                counts["skipped"], counts["not_applicable"]), flush=True)
            for b in bad:
                print("    " + b, flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    print("logs: %s" % logdir)
    return worst


if __name__ == "__main__":
    sys.exit(main())
