"""Builds libftcomm.so with Go (go build -buildmode=c-shared ./capi) into the
package while setuptools builds it; everything else is pyproject.toml.

    /usr/bin/python3 -m pip install --no-build-isolation ./python

Environment: FTCOMM_GO names the go binary (default: go on PATH);
FTCOMM_PREBUILT_LIB copies a library built elsewhere instead (a machine
without Go, say).
"""

import os
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def repo_root():
    root = os.environ.get("FTCOMM_SOURCE", os.path.dirname(HERE))
    if not os.path.exists(os.path.join(root, "go.mod")):
        raise SystemExit("ftcomm: cannot find the Go module (go.mod) at %s; set FTCOMM_SOURCE to the repository" % root)
    return root


class BuildWithGo(build_py):
    def run(self):
        super().run()
        out_dir = os.path.abspath(os.path.join(self.build_lib, "ftcomm"))
        os.makedirs(out_dir, exist_ok=True)
        out = os.path.join(out_dir, "libftcomm.so")
        prebuilt = os.environ.get("FTCOMM_PREBUILT_LIB")
        if prebuilt:
            shutil.copyfile(prebuilt, out)
            return
        go = os.environ.get("FTCOMM_GO") or shutil.which("go")
        if not go:
            raise SystemExit("ftcomm: building libftcomm.so needs Go 1.26 on PATH (or FTCOMM_GO, or FTCOMM_PREBUILT_LIB)")
        env = dict(os.environ, CGO_ENABLED="1")
        cmd = [go, "build", "-buildmode=c-shared", "-ldflags=-s -w", "-o", out, "./capi"]
        self.announce("ftcomm: " + " ".join(cmd), level=2)
        subprocess.check_call(cmd, cwd=repo_root(), env=env)


class BinaryDistribution(Distribution):
    """The package carries a native library: its wheel is platform-specific."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithGo}, distclass=BinaryDistribution)
