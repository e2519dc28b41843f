import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # the package, when not installed

from cluster import Cluster  # noqa: E402

import ftcomm  # noqa: E402

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
    HAVE_CUDA = torch.cuda.is_available() and torch.cuda.device_count() >= 2
except ImportError:
    HAVE_TORCH = HAVE_CUDA = False

needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not importable")
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs torch with 2 CUDA devices")


@pytest.fixture(scope="module")
def store():
    s = ftcomm.Store.listen("127.0.0.1:0")
    yield s
    s.close()


@pytest.fixture(scope="module")
def two(store):
    c = Cluster(2)
    yield c
    c.close()


@pytest.fixture(scope="module")
def three(store):
    c = Cluster(3)
    yield c
    c.close()


def child_env(**extra):
    """The environment for a Python subprocess: it imports this package."""
    pkg = os.path.dirname(HERE)
    path = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=pkg + (os.pathsep + path if path else ""), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


_names = iter(range(1 << 30))


@pytest.fixture
def name(request):
    """A comm name no other test uses (each comm has its own keys)."""
    return "%s-%d" % (request.node.name.replace("[", "-").replace("]", "").replace("/", "-")[:60], next(_names))
