"""torchcomms.device_mesh is ftcomm.device_mesh."""

from ftcomm.device_mesh import *  # noqa: F401,F403
