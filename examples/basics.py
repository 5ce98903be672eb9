"""Seed 002 §2.2–2.3 and §3 in autoshard: distributed tensors and reshard, on 8 simulated CPU devices.

Run:  python examples/basics.py
"""
import os

# Simulated devices must be requested before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

import autoshard as dist  # noqa: E402


def main() -> None:
    # §2.2: a (4, 3) tensor on a 2×3 mesh with ids in any order; each device holds a (2, 1) block.
    mesh = dist.ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
    dense = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
    t = dist.shard_tensor(dense, mesh, [dist.Shard(0), dist.Shard(1)])
    print("§2.2 shard_tensor")
    print(dist.placement_table(t))
    for device in mesh.process_ids:
        print(f"  device {device} holds {t.local(device).tolist()}")

    # §2.3: Replicate on devices [0, 1] → Shard(0) on devices [2, 3].
    mesh0 = dist.ProcessMesh([0, 1], dim_names=["x"])
    mesh1 = dist.ProcessMesh([2, 3], dim_names=["x"])
    a = dist.shard_tensor(np.array([[1, 2, 3], [4, 5, 6]]), mesh0, [dist.Replicate()])
    print("\n§2.3 reshard across meshes")
    print(dist.plan_reshard(a, mesh1, [dist.Shard(0)]))
    b = dist.reshard(a, mesh1, [dist.Shard(0)])
    print(dist.placement_table(b))
    assert np.array_equal(b.numpy(), a.numpy())

    # Partial → Replicate: per-device partial sums, reduced by one all-reduce.
    mesh8 = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
    parts = dist.dtensor_from_local(lambda c: np.full((2, 16), c[0] + 1.0, np.float32), mesh8,
                                    [dist.Partial(), dist.Replicate()])
    print("\nPartial(sum) over 'dp' → Replicate")
    print("  device 0 holds", parts.local(0)[0, :4].tolist(), "... and device 4 holds",
          parts.local(4)[0, :4].tolist(), "...")
    print(dist.plan_reshard(parts, mesh8, [dist.Replicate(), dist.Replicate()]))
    full = dist.reshard(parts, mesh8, [dist.Replicate(), dist.Replicate()])
    print("  logical value row 0:", full.numpy()[0].tolist())
    assert np.array_equal(full.numpy(), np.full((2, 16), 3.0))

    # Partial → Shard is a single reduce-scatter, not an all-reduce and a slice.
    print("\nPartial(sum) → Shard(0)")
    print(dist.plan_reshard(parts, mesh8, [dist.Shard(0), dist.Replicate()]))

    # §3: C = A @ B with A replicated and B split by rows gives a Partial C on each device.
    mesh2 = dist.ProcessMesh([0, 1], dim_names=["x"])
    A = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    B = np.array([[5.0, 6.0], [7.0, 8.0]], np.float32)
    a_cols = dist.reshard(dist.shard_tensor(A, mesh2, [dist.Replicate()]), mesh2, [dist.Shard(1)])
    b_rows = dist.shard_tensor(B, mesh2, [dist.Shard(0)])
    c = dist.dtensor_from_local([a_cols.local(d) @ b_rows.local(d) for d in (0, 1)], mesh2,
                                [dist.Partial()])
    d = dist.reshard(c, mesh2, [dist.Replicate()])
    print("\n§3 matmul of R and S(0) → Partial, then relu needs Replicate:")
    print("  C partial on device 0:", c.local(0).tolist(), " relu(C) =", np.maximum(d.numpy(), 0).tolist())
    assert np.allclose(np.maximum(d.numpy(), 0), np.maximum(A @ B, 0))
    # The same through the compiler: dist.jit finds the Partial and where to reduce it.
    import jax

    step = dist.jit(lambda a, b: jax.nn.relu(a @ b))
    a_rep = dist.shard_tensor(A, mesh2, [dist.Replicate()])
    out = step(a_rep, b_rows)
    print("\n§3 with dist.jit:", out.numpy().tolist())
    print(step.explain(a_rep, b_rows))
    assert np.allclose(out.numpy(), np.maximum(A @ B, 0))
    print("\nall results equal the single-device values")


if __name__ == "__main__":
    main()
