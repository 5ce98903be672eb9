"""ProcessMesh: any id order, named dims, sub-meshes, jax conversion, and its errors."""
import numpy as np
import pytest
from jax.sharding import AxisType

import autoshard as dist


def test_seed_mesh_in_any_order():
    mesh = dist.ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
    assert mesh.shape == [2, 3] and mesh.ndim == 2 and mesh.dim_names == ["x", "y"]
    assert mesh.process_ids == [2, 4, 5, 0, 1, 3]
    assert mesh.get_dim_size("y") == 3 and mesh.get_dim_size(0) == 2
    jm = mesh.to_jax()
    assert [d.id for d in jm.devices.flat] == [2, 4, 5, 0, 1, 3]
    assert jm.axis_names == ("x", "y") and all(t == AxisType.Auto for t in jm.axis_types)
    assert mesh.coords_of(0) == (1, 0)


def test_default_dim_names_equality_hash_repr():
    a = dist.ProcessMesh(np.arange(8).reshape(2, 2, 2))
    assert a.dim_names == ["d0", "d1", "d2"]
    b = dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["d0", "d1", "d2"])
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), ["a", "b", "c"])
    assert repr(dist.ProcessMesh([0, 1], ["x"])) == "ProcessMesh([0, 1], dim_names=['x'])"


def test_sub_meshes_for_pipeline_stages():
    mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["pp", "mp"])
    assert mesh.get_mesh_with_dim("pp", 1) == dist.ProcessMesh([4, 5, 6, 7], ["mp"])
    assert mesh["pp", 0] == dist.ProcessMesh([0, 1, 2, 3], ["mp"])
    assert mesh["mp", 2] == dist.ProcessMesh([2, 6], ["pp"])
    assert mesh.get_mesh_with_dim("mp") == dist.ProcessMesh([[0, 4], [1, 5], [2, 6], [3, 7]], ["mp", "pp"])
    assert mesh[1] == dist.ProcessMesh([4, 5, 6, 7], ["mp"])
    assert mesh[:, 1:3] == dist.ProcessMesh([[1, 2], [5, 6]], ["pp", "mp"])


def test_from_jax_mesh():
    import jax

    jm = jax.make_mesh((2, 4), ("a", "b"))
    pm = dist.ProcessMesh([[d.id for d in row] for row in jm.devices], ["a", "b"])
    from autoshard.mesh import as_process_mesh

    assert as_process_mesh(jm) == pm


@pytest.mark.parametrize("ids,names,match", [
    ([0, 1, 1, 2], None, r"device ids \[1\] appear more than once"),
    ([[0, 1], [2]], None, "ragged"),
    ([[0, 1], [2, 3]], ["x"], "has 1 names but the mesh has 2 dims"),
    ([[0, 1], [2, 3]], ["x", "x"], r"repeats \['x'\]"),
    ([0.5, 1.0], None, "integer device ids"),
    ([-1, 0], None, ">= 0"),
    ([], None, "empty"),
])
def test_bad_meshes(ids, names, match):
    with pytest.raises(dist.MeshError, match=match) as info:
        dist.ProcessMesh(ids, names)
    assert isinstance(info.value, dist.AutoshardError)
    assert "test_mesh.py:" in str(info.value)  # names the user's line


def test_unknown_devices_are_reported_where_the_mesh_is_used():
    mesh = dist.ProcessMesh([6, 7, 8, 9], ["x"])  # building it needs no device
    with pytest.raises(dist.DeviceNotFoundError, match=r"device ids \[8, 9\].*xla_force_host_platform"):
        dist.shard_tensor(np.zeros(4), mesh, [dist.Replicate()])
    x = dist.shard_tensor(np.zeros(4), dist.ProcessMesh([0, 1], ["x"]), [dist.Shard(0)])
    with pytest.raises(dist.DeviceNotFoundError, match=r"\[8, 9\]") as info:
        dist.reshard(x, mesh, [dist.Shard(0)])
    assert "test_mesh.py:" in str(info.value)


def test_unknown_devices_under_the_launcher_name_its_flags(monkeypatch):
    """autoshard.launch sets XLA_FLAGS itself (from --devices): the hint to set it was wrong."""
    from autoshard.parallel_env import ENV_COORDINATOR, ENV_NPROC

    monkeypatch.setenv(ENV_COORDINATOR, "127.0.0.1:1")
    monkeypatch.setenv(ENV_NPROC, "2")
    with pytest.raises(dist.DeviceNotFoundError, match=r"device ids \[8, 9\].*autoshard.launch "
                       r"--nproc N --devices K` gives N \* K devices \(now 2 processes") as info:
        dist.ProcessMesh([6, 7, 8, 9], ["x"]).devices()
    assert "XLA_FLAGS" not in str(info.value)
