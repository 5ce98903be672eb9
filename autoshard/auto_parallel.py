"""`dist.auto_parallel`: the names Paddle keeps in paddle.distributed.auto_parallel that its
users call through that path (`dist.auto_parallel.set_mesh(mesh)` before `parallelize`)."""
from .creation import dtensor_from_local
from .mesh import get_mesh, set_mesh

__all__ = ["set_mesh", "get_mesh", "dtensor_from_local"]
