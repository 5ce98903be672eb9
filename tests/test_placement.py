"""Placements: equality, hashing, short forms, reduce types, Paddle's query methods."""
import pytest

import autoshard as dist


def test_equality_hash_and_short_forms():
    assert dist.Shard(0) == dist.Shard(0) != dist.Shard(1)
    assert dist.Replicate() == dist.Replicate() != dist.Shard(0)
    assert dist.Partial() == dist.Partial("sum") == dist.Partial(dist.ReduceType.kRedSum)
    assert dist.Partial("max") != dist.Partial("sum")
    assert len({dist.Shard(0), dist.Shard(0), dist.Replicate(), dist.Partial()}) == 3
    assert [repr(p) for p in (dist.Replicate(), dist.Shard(-1), dist.Partial("avg"))] == ["R", "S(-1)", "P(avg)"]
    for text in ["R", "S(0)", "S(-2)", "P(sum)", "P(max)", "P(min)", "P(avg)"]:
        assert repr(dist.parse_placement(text)) == text
    assert dist.parse_placement("P") == dist.Partial()


def test_reduce_types_and_paddle_aliases():
    assert {t.value for t in dist.ReduceType} == {"sum", "avg", "max", "min"}
    assert dist.ReduceType.kRedMax is dist.ReduceType.MAX
    assert dist.Partial("mean").reduce_type is dist.ReduceType.AVG


def test_queries():
    assert dist.Shard(1).is_shard() and dist.Shard(1).is_shard(1) and not dist.Shard(1).is_shard(0)
    assert dist.Shard(1).get_dim() == 1
    assert dist.Replicate().is_replicated() and dist.Partial().is_partial()
    assert not dist.Replicate().is_partial()


def test_bad_placements():
    with pytest.raises(dist.PlacementError, match="unknown reduce type 'prod'"):
        dist.Partial("prod")
    with pytest.raises(dist.PlacementTypeError, match="needs an int"):
        dist.Shard("0")
    with pytest.raises(dist.PlacementError, match="cannot read placement"):
        dist.parse_placement("Q(1)")


def test_layouts_are_interned():
    """Equal layouts are one object (the planner compares and hashes them by identity), also
    when built from lists, with partial axes in another order, copied, pickled, or made by
    several threads at once; invalid ones still raise."""
    import copy
    import pickle
    from concurrent.futures import ThreadPoolExecutor

    from autoshard.errors import PlacementError
    from autoshard.layout import Layout
    from autoshard.placement import ReduceType

    a = Layout((("x",), ()), (("y", ReduceType.SUM), ("z", ReduceType.AVG)))
    b = Layout([["x"], []], [("z", ReduceType.AVG), ("y", ReduceType.SUM)])
    assert a is b and a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != Layout((("x",), ()))
    assert copy.copy(a) is a and copy.deepcopy(a) is a and pickle.loads(pickle.dumps(a)) is a
    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda i: Layout(((f"t{i % 3}",), ("u",))), range(64)))
    assert all(m is Layout(((f"t{i % 3}",), ("u",))) for i, m in enumerate(made))
    with pytest.raises(AttributeError):
        a.dims = ()
    with pytest.raises(PlacementError):
        Layout((("x",), ("x",)))
