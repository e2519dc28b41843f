"""torchcomms' module name for ftcomm, so that torchcomms' own integration
tests run against ftcomm with their imports unchanged. Only the conformance
runner (../run_torchcomms_tests.py) puts this directory on sys.path.

Every name comes from ftcomm (its submodules: objcol.py, device_mesh.py
here); the one addition is the torchcomms checkout's package directory, where
``torchcomms.tests`` (the tests and their helpers: torchcomms' code, not
copied here) is found.
"""

import os

from ftcomm import *  # noqa: F401,F403

__path__.append(os.environ["FTCOMM_TORCHCOMMS_PACKAGE"])  # noqa: F821 - the package's own __path__
