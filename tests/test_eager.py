"""Eager mode: DistTensor operators run op by op through the engine and equal numpy."""
import operator
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import autoshard as dist
from autoshard import eager
from autoshard.errors import OperandIndexError
from autoshard.testing import make_tensor

R, S, P = dist.Replicate, dist.Shard, dist.Partial
MESH8 = dist.ProcessMesh(list(range(8)), ["x"])
MESH24 = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])

# (mesh, placements of a, placements of b): replicated, split either dim, co-split, pending sums
CASES = [
    (MESH8, [R()], [S(0)]),
    (MESH8, [S(0)], [S(0)]),
    (MESH8, [S(1)], [R()]),
    (MESH8, [P()], [S(1)]),
    (MESH24, [S(0), S(1)], [R(), S(1)]),
    (MESH24, [P(), S(1)], [S(0), P()]),
    (MESH24, [S(1), S(1)], [R(), R()]),
]
IDS = [f"{'x'.join(map(str, m.shape))}-{''.join(map(repr, pa))}-{''.join(map(repr, pb))}"
       for m, pa, pb in CASES]

_rng = np.random.default_rng(0)
# Integer-valued floats: comparisons see ties, // and % are exact; B is never zero.
A = _rng.integers(-4, 5, (8, 8)).astype(np.float32)
B = _rng.choice(np.array([-3, -2, -1, 1, 2, 3], np.float32), (8, 8))


@pytest.fixture(params=CASES, ids=IDS)
def ab(request):
    mesh, pa, pb = request.param
    return dist.shard_tensor(A, mesh, pa), dist.shard_tensor(B, mesh, pb)


def check(out, expected, rtol=1e-6, dtype=None):
    assert isinstance(out, dist.DistTensor), type(out)
    expected = np.asarray(expected)
    assert out.shape == expected.shape
    if dtype is not None:
        assert out.dtype == dtype, (out.dtype, dtype)
    np.testing.assert_allclose(out.numpy(), expected, rtol=rtol, atol=1e-6)


def no_partial(x) -> bool:
    return not any(isinstance(p, P) for p in x.placements)


# -- operators ----------------------------------------------------------------------------------

def test_arithmetic_comparisons_and_matmul_match_numpy(ab):
    a, b = ab
    check(a + b, A + B)
    check(a - b, A - B)
    check(a * b, A * B)
    check(a / b, A / B)
    check(a // b, A // B)
    check(a % b, A % B)
    for out, expected in zip(divmod(a, b), divmod(A, B)):
        check(out, expected)
    check(b ** a, B ** A, rtol=1e-5)
    check(a ** 2, A ** 2)
    check(-a, -A)
    check(+a, A)
    check(abs(a), np.abs(A))
    check(a @ b, A @ B, rtol=1e-5)
    for out, expected in [(a < b, A < B), (a <= b, A <= B), (a > b, A > B), (a >= b, A >= B),
                          (a == b, A == B), (a != b, A != B)]:
        check(out, expected, dtype=np.bool_)
        assert no_partial(out)  # a comparison is not linear: a pending sum is reduced first


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[5]], ids=[IDS[0], IDS[3], IDS[5]])
def test_python_scalars_and_numpy_on_either_side(case):
    mesh, pa, pb = case
    a, b = dist.shard_tensor(A, mesh, pa), dist.shard_tensor(B, mesh, pb)
    check(a + 1, A + 1)
    check(2.0 - a, 2.0 - A)
    check(3 * a, 3 * A)
    check(1.0 / b, 1.0 / B)
    check(7 // b, 7 // B)
    check(5 % b, 5 % B)
    check(divmod(7, b)[0], 7 // B)
    check(2.0 ** a, 2.0 ** A)
    check(a ** 3, A ** 3)
    check(abs(a) ** 0.5, np.abs(A) ** 0.5)
    check(a < 1, A < 1, dtype=np.bool_)
    check(0 >= a, 0 >= A, dtype=np.bool_)
    check(A + b, A + B)             # ndarray.__add__ steps aside: the DistTensor's __radd__ runs
    check(A @ b, A @ B, rtol=1e-5)
    check(A < b, A < B, dtype=np.bool_)
    check(np.float32(2) * a, 2 * A)
    check(a - B[0], A - B[0])       # broadcasting a host row
    check(a * jnp.asarray(B), A * B)


def test_scalar_operands_keep_jnp_weak_typing():
    mesh = MESH8
    i = dist.shard_tensor(np.arange(16, dtype=np.int32).reshape(8, 2), mesh, [S(0)])
    check(i * 2, np.arange(16).reshape(8, 2) * 2, dtype=np.int32)
    check(i // 3, np.arange(16).reshape(8, 2) // 3, dtype=np.int32)
    check(i * 2.5, np.arange(16).reshape(8, 2) * 2.5, dtype=np.float32)
    check(i & 6, np.arange(16).reshape(8, 2) & 6, dtype=np.int32)
    check(~i, ~np.arange(16).reshape(8, 2), dtype=np.int32)
    check(i << 1, np.arange(16).reshape(8, 2) << 1, dtype=np.int32)
    h = dist.shard_tensor(np.ones((8, 2), ml_dtypes.bfloat16), mesh, [S(0)])
    assert (h * 2.0).dtype == ml_dtypes.bfloat16  # a Python float does not widen bf16
    assert (h * np.float32(2)).dtype == np.float32  # a numpy scalar does, as in jnp
    f = dist.shard_tensor(A, mesh, [S(1)])
    check(f + 2**40, A + np.float32(2**40), dtype=np.float32)  # too big for int32, fine as f32
    check(f * True, A, dtype=np.float32)


def test_unsupported_operands_fall_back_to_python():
    a = dist.shard_tensor(A, MESH8, [S(0)])
    with pytest.raises(TypeError):
        a + "1"
    assert (a == None) is False  # noqa: E711 — NotImplemented, then identity
    assert (a != "x") is True
    with pytest.raises(ValueError, match="ambiguous"):
        bool(a == a)


# -- the seed example: a pending Partial the user can print, then reshard ----------------------

def test_seed_matmul_is_partial_then_resharded_and_relu():
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    A2 = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    B2 = np.array([[5.0, 6.0], [7.0, 8.0]], np.float32)
    a = dist.shard_tensor(A2, mesh, [dist.Replicate()])
    b = dist.shard_tensor(B2, mesh, [dist.Shard(0)])
    c = a @ b
    assert c.placements == [dist.Partial()]
    assert "P(sum)" in repr(c)
    np.testing.assert_array_equal(c.numpy(), A2 @ B2)
    np.testing.assert_array_equal(np.asarray(c.local(0)) + np.asarray(c.local(1)), A2 @ B2)  # each holds a partial sum
    r = dist.reshard(c, mesh, [dist.Replicate()])
    assert r.placements == [dist.Replicate()]
    np.testing.assert_array_equal(dist.jit(jax.nn.relu)(r).numpy(), np.maximum(A2 @ B2, 0))
    np.testing.assert_array_equal((r * (r > 0)).numpy(), np.maximum(A2 @ B2, 0))


def test_partial_stays_pending_through_linear_ops_op_by_op():
    a = dist.shard_tensor(A, MESH8, [S(1)])
    b = dist.shard_tensor(B, MESH8, [S(0)])
    c = a @ b
    assert c.placements == [P()]
    for out, expected in [(c * 2.0, 2 * (A @ B)), (c + c, 2 * (A @ B)), (-c, -(A @ B)),
                          (c.T, (A @ B).T), (c.reshape(64), (A @ B).reshape(64)),
                          (c.sum(0), (A @ B).sum(0)), (c + 1.0, A @ B + 1.0)]:
        assert out.placements == [P()], out
        check(out, expected, rtol=1e-5)
    assert no_partial(c > 0) and no_partial(abs(c)) and no_partial(c.max())
    cc = c * c  # one factor is reduced, the other may stay pending: R * P(sum) is P(sum)
    check(cc, (A @ B) ** 2, rtol=1e-5)


MESH2 = dist.ProcessMesh([0, 1], ["x"])
_BOOL_PARTS = [np.array([True, False, True, True]), np.array([True, True, False, True])]
_INT_PARTS = [np.array([1, 0, 3, -1], np.int32), np.array([0, 1, 0, 0], np.int32)]


@pytest.mark.parametrize("parts, reduce, ops", [
    # a bool's pending "sum" is an or of its parts: no linear step may run on the parts
    (_BOOL_PARTS, "sum", [lambda t: t @ np.arange(1.0, 5.0, dtype=np.float32),
                          lambda t: t.astype(np.float32) * 2.0, lambda t: t.sum()]),
    # an integer's pending mean is truncated: (p0 + p1) // 2 * 2 is not (2 p0 + 2 p1) // 2
    (_INT_PARTS, "avg", [lambda t: t * 2, lambda t: t + t, lambda t: t - np.arange(4, dtype=np.int32),
                         lambda t: t.sum(), lambda t: t @ np.arange(1, 5, dtype=np.int32)]),
], ids=["bool sum", "int mean"])
@pytest.mark.parametrize("where", ["eager", "dist.jit"])
def test_pending_or_and_truncated_mean_are_reduced_before_linear_steps(parts, reduce, ops, where):
    t = dist.dtensor_from_local(parts, MESH2, [dist.Partial(reduce)])
    value = jnp.asarray(t.numpy())  # the tensor's value: the or / the truncated mean
    for op in ops:
        got = op(t) if where == "eager" else dist.jit(op)(t)
        np.testing.assert_array_equal(got.numpy(), np.asarray(op(value)))


@pytest.mark.parametrize("dtype", [np.uint32, np.int32])
@pytest.mark.parametrize("where", ["eager", "dist.jit"])
def test_integer_division_of_a_pending_sum_divides_the_sum(dtype, where):
    """An integer quotient truncates: (p0 + p1) // 2 is not p0 // 2 + p1 // 2 — the sum is
    reduced first (a split sum's // 2, and mean(dtype=int), were computed per part)."""
    x = np.array([[1, 3], [0, 0], [1, 3], [0, 0]], dtype)  # each half sums to [1, 3]
    t = dist.shard_tensor(x, MESH2, [dist.Shard(0)])
    ops = [lambda a: a.sum(axis=0) // 2, lambda a: a.mean(axis=0, dtype=dtype)]
    if where == "dist.jit":  # (jax.lax functions take no DistTensor eagerly)
        ops.append(lambda a: jax.lax.div(a.sum(axis=0), dtype(4)))
    for op in ops:
        got = op(t) if where == "eager" else dist.jit(op)(t)
        np.testing.assert_array_equal(got.numpy(), np.asarray(op(jnp.asarray(x))))


# -- indexing, shapes, reductions, casts --------------------------------------------------------

@pytest.fixture(params=[CASES[1], CASES[5]], ids=[IDS[1], IDS[5]])
def a(request):
    mesh, pa, _ = request.param
    return dist.shard_tensor(A, mesh, pa)


def test_indexing_and_slicing(a):
    for key in [np.s_[1:3], np.s_[:, 0], np.s_[..., None], np.s_[-1], np.s_[::-1],
                np.s_[1:7:2, 2], np.s_[None, 2:, ...], np.s_[3, 5], np.s_[..., -2:],
                np.s_[np.int64(2)], np.s_[True]]:
        check(a[key], A[key])
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)  # gather has its rules
        check(a[np.array([0, 3, 5])], A[[0, 3, 5]])
        check(a[[1, 2], 4:], A[[1, 2], 4:])
        check(a[:, np.array([[0, 1], [7, -1]])], A[:, np.array([[0, 1], [7, -1]])])
        check(a[A > 0], A[A > 0])          # a host mask: concrete, as numpy sees it
        check(a[a > 0], A[A > 0])          # a DistTensor mask is fetched first (eager)
        idx = dist.shard_tensor(np.array([7, 0, 3, 3, 1, 2, 5, 6], np.int32), a.mesh,
                                [R()] * a.mesh.ndim)
        check(a[idx], A[[7, 0, 3, 3, 1, 2, 5, 6]])
    with pytest.raises(IndexError, match="out of bounds for axis 1 with size 8"):
        a[0, 8]
    with pytest.raises(IndexError, match="out of bounds"):
        a[np.array([0, 9])]
    with pytest.raises(IndexError, match="valid indices"):
        a["x"]
    rows = list(a)
    assert len(rows) == 8
    check(rows[5], A[5])


_ROWS, _COLS = np.arange(8) % 3 == 0, np.arange(32) % 5 == 1


@pytest.mark.parametrize("key", [
    np.s_[_ROWS], np.s_[:, _ROWS], np.s_[..., _COLS], np.s_[1, _ROWS], np.s_[:, _ROWS, 4:],
    np.s_[np.arange(4) > 1], np.s_[None, :, _ROWS], np.s_[np.ones((4, 8), bool)],
    np.s_[:, np.eye(8, 32, dtype=bool)]], ids=[
    "rows of dim 0", "dim 1", "... dim 2", "int then mask", "mask then slice", "dim 0 (4)",
    "new axis first", "2-d over dims 0-1", "2-d over dims 1-2"])
def test_boolean_masks_of_the_indexed_dims_read_and_write_like_numpy(key):
    x3 = np.arange(4 * 8 * 32, dtype=np.float32).reshape(4, 8, 32)
    try:
        want = x3[key]
    except IndexError:
        want = None
    x = dist.shard_tensor(x3, MESH24, [S(1), S(2)])
    if want is None:  # (numpy refuses: a mask of other sizes than its dims)
        with pytest.raises(IndexError, match="boolean mask of shape"):
            x[key]
        return
    check(x[key], want)
    written = x3.copy()
    written[key] = -1.0
    x[key] = -1.0
    check(x, written)


@pytest.mark.parametrize("key", [np.s_[[]], np.s_[:, []], np.s_[..., []], np.s_[[], 1]],
                         ids=["dim 0", "dim 1", "last dim", "then an int"])
def test_an_empty_list_index_is_an_empty_integer_index_as_in_numpy(key):
    """numpy reads `[]` as an integer index array of no elements (not a float array)."""
    x3 = np.arange(4 * 8 * 32, dtype=np.float32).reshape(4, 8, 32)
    x = dist.shard_tensor(x3, MESH24, [S(1), S(2)])
    check(x[key], x3[key])
    x[key] = -1.0
    check(x, x3)  # nothing written


@pytest.mark.parametrize("key", [
    np.s_[np.array([True, False])], np.s_[np.ones((2, 2), bool)], np.s_[:, np.ones(4, bool)],
    np.s_[..., np.ones(8, bool)], np.s_[0, np.ones((8, 8), bool)]], ids=[
    "short dim 0", "2-d of other sizes", "dim 1 too short", "last dim too short",
    "2-d past an int"])
def test_a_boolean_mask_of_other_sizes_than_its_dims_is_an_index_error(key):
    """numpy and jax refuse a mask that does not match the dims it indexes; its nonzero
    indices picked (and wrote) other elements, silently."""
    x3 = np.arange(4 * 8 * 32, dtype=np.float32).reshape(4, 8, 32)
    with pytest.raises(IndexError):
        x3[key]
    x = dist.shard_tensor(x3, MESH24, [S(1), S(2)])
    with pytest.raises(OperandIndexError, match=r"boolean mask of shape .* indexes dims"):
        x[key]
    with pytest.raises(OperandIndexError, match=r"boolean mask of shape"):
        x[key] = -1.0
    check(x, x3)  # nothing written


@pytest.mark.parametrize("idx", [[1, 9], [0, 16], [-20, 3], [15, 16, 17], [2, 4, 6]],
                         ids=["one past", "progression past", "below", "tail past", "inside"])
@pytest.mark.parametrize("placements", [[S(0)], [R()]])
def test_at_with_jaxs_modes_treats_out_of_range_indices_as_jax_does(idx, placements):
    """x.at[idx].get(mode="fill", fill_value=...), .get(mode="clip"), .set(v, mode="drop" /
    "clip") equal jax's for indices past either end (an out-of-range index was refused before
    the mode was read); without a mode such an index is an IndexError, as numpy's."""
    x = np.arange(16, dtype=np.float32)
    t = dist.shard_tensor(x, MESH8, placements)
    idx = np.array(idx)
    j = jnp.asarray(x)
    check(t.at[idx].get(mode="fill", fill_value=-1.0), np.asarray(j.at[idx].get(
        mode="fill", fill_value=-1.0)))
    check(t.at[idx].get(mode="clip"), np.asarray(j.at[idx].get(mode="clip")))
    for mode in ("drop", "clip"):
        check(t.at[idx].set(-5.0, mode=mode), np.asarray(j.at[idx].set(-5.0, mode=mode)))
        check(t.at[idx].add(2.0, mode=mode), np.asarray(j.at[idx].add(2.0, mode=mode)))
    if ((idx < -16) | (idx >= 16)).any():
        with pytest.raises(IndexError, match="out of bounds"):
            t.at[idx].get()
        with pytest.raises(IndexError, match="out of bounds"):
            t.at[idx].set(0.0)


@pytest.mark.parametrize("op", ["x + 300", "300 - x", "x < 1000", "x == -1", "x >= -5",
                                "x * 1000", "x // 300"])
@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_python_ints_past_a_small_dtypes_range_operate_as_in_jnp(op, dtype):
    """uint8 + 300, x < 1000, x == -1: a Python int outside the dtype's range is taken as jnp
    takes it, weakly typed — wrapping, or compared by value (it was numpy's bare
    OverflowError); item assignment of one wraps as jnp's .at[].set does."""
    x = np.arange(8).astype(dtype)
    t = dist.shard_tensor(x, MESH8, [S(0)])
    fn = eval(f"lambda x: {op}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (jax may warn of the wrap)
        want = np.asarray(fn(jnp.asarray(x)))
        got = fn(t)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got.numpy()), want)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t[0] = 300
        want = np.asarray(jnp.asarray(x).at[0].set(300))
    np.testing.assert_array_equal(np.asarray(t.numpy()), want)


@pytest.mark.parametrize("op", ["ravel", "reshape", "prod", "sum", "add", "T", "v.T @ v",
                                "sums of two"])
@pytest.mark.parametrize("mesh", [MESH8, dist.ProcessMesh([0, 1, 2], ["x"])], ids=["8", "3"])
def test_ops_on_an_empty_split_tensor_give_jnps_results(op, mesh):
    """A (0, 4) tensor split on its empty dim: ops whose plan would gather it give jnp's
    results (XLA's verifier refused the all-gather of a zero-sized dim, inside jax), and so do
    programs whose every operand is empty (`v.T @ v`: two empty inputs; `e.sum() * (e + 1)
    .sum()`: an input and an empty constant — XLA's Shardy verifier refused the shard_map)."""
    x = np.zeros((0, 4), np.float32)
    t = dist.shard_tensor(x, mesh, [S(0)])
    fn = {"ravel": lambda v: v.ravel(), "reshape": lambda v: v.reshape(-1),
          "prod": lambda v: v.prod(), "sum": lambda v: v.sum(axis=0),
          "add": lambda v: v + v.sum(axis=0), "T": lambda v: v.T, "v.T @ v": lambda v: v.T @ v,
          "sums of two": lambda v: v.sum() * (v + 1).sum()}[op]
    want = np.asarray(fn(jnp.asarray(x)))
    got = dist.jit(fn)(t) if op == "sums of two" else fn(t)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got.numpy()), want)


X3 = np.arange(4 * 8 * 32, dtype=np.float32).reshape(4, 8, 32)


@pytest.mark.parametrize("key", [
    np.s_[:, :, np.arange(0, 32, 2)], np.s_[..., np.arange(1, 32, 4)], np.s_[:, [1, 3, 5, 7]],
    np.s_[:, np.arange(8) % 2 == 1], np.s_[..., np.arange(-32, 0, 2)],
    np.s_[None, :, np.arange(0, 8, 4)],
], ids=["even cols", "... every 4th", "odd rows list", "odd rows mask", "negative evens",
        "new axis, every 4th row"])
def test_an_evenly_stepping_host_index_is_a_strided_slice_that_stays_split(key):
    # the index array a notebook user writes for every other row keeps the split, as the
    # slice it equals does; an index operand would make the result a pending sum
    x = dist.shard_tensor(X3, MESH24, [S(1), S(2)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        got = x[key]
    check(got, X3[key])
    assert not any(isinstance(p, P) for p in got.placements), got.placements
    check(x.at[key].set(-1.0), np.asarray(jnp.asarray(X3).at[key].set(-1.0)))


@pytest.mark.parametrize("key", [np.s_[:, [5, 3, 1]], np.s_[:, [0, 0, 2]], np.s_[:, :, [3]],
                                 np.s_[:, [1, 2], [0, 4]], np.s_[[0, 2], True],
                                 # an integer and an evenly stepping array split by a slice:
                                 # numpy moves their dim to the front
                                 np.s_[0, :, np.array([0, 2])], np.s_[np.arange(0, 4, 2), :, 3]])
def test_other_host_indices_still_gather_like_jax(key):
    x = dist.shard_tensor(X3, MESH24, [S(1), S(2)])
    check(x[key], np.asarray(jnp.asarray(X3)[key]))


def test_shapes_reductions_and_casts(a):
    check(a.T, A.T)
    check(a.reshape(4, 16), A.reshape(4, 16))
    check(a.reshape((64,)), A.reshape(64))
    check(a.reshape(-1, 2), A.reshape(-1, 2))
    check(a.transpose(1, 0), A.T)
    check(a.transpose((1, 0)), A.T)
    check(a.reshape(2, 4, 8).transpose(2, 0, 1), A.reshape(2, 4, 8).transpose(2, 0, 1))
    check(a.reshape(2, 4, 8).T, A.reshape(2, 4, 8).T)
    for axis in [None, 0, 1, (0, 1)]:
        check(a.sum(axis), A.sum(axis))
        check(a.max(axis=axis), A.max(axis))
    check(a.sum(-1, keepdims=True), A.sum(-1, keepdims=True))
    check(a.mean(), A.mean(), rtol=1e-5)
    check(a.mean(0, keepdims=True), A.mean(0, keepdims=True), rtol=1e-5)
    check(a.min(1), A.min(1))
    check(a.prod(0), A.prod(0))
    check((a > 0).any(1), (A > 0).any(1), dtype=np.bool_)
    check((a > -5).all(), True, dtype=np.bool_)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)  # argmax has its rules
        check(a.argmax(), A.argmax())
        check(a.argmax(0), A.argmax(0))
        check(a.argmin(axis=1, keepdims=True), A.argmin(1, keepdims=True))
    with pytest.raises(np.exceptions.AxisError):
        a.sum(2)
    check(a.astype(np.int32), A.astype(np.int32), dtype=np.int32)
    check(a.astype("bool"), A.astype(bool), dtype=np.bool_)
    check((a > 0).astype(np.float32).sum(), (A > 0).sum())
    assert a.astype(jnp.bfloat16).dtype == jnp.bfloat16


def test_reductions_take_jnps_where_initial_and_argument_order(a):
    """x.mean(where=mask) with the mask a DistTensor or an array, max / min with `initial`,
    and positional arguments in jnp's order (max has no dtype: x.max(0, None, True) keeps
    dims); an argument the eager op does not take is named."""
    check(a.mean(where=a > 0), A.mean(where=A > 0), rtol=1e-5)
    check(a.sum(1, where=A > 0), A.sum(1, where=A > 0), rtol=1e-5)
    check(a.max(axis=0, initial=-5.0, where=a < 0), A.max(axis=0, initial=-5.0, where=A < 0))
    check(a.min(1, None, True), A.min(1, keepdims=True))
    check(a.prod(0, np.float32, None, False, 2.0), A.prod(0, initial=2.0), rtol=1e-5)
    check((a > 0).any(where=a > 1), (A > 0).any(where=A > 1), dtype=np.bool_)
    with pytest.raises(TypeError, match="promote_integers is not supported"):
        a.sum(promote_integers=False)


def test_at_updates_match_jax(a):
    ref = jnp.asarray(A)
    rows = np.array([0, 3, 3, 7])
    check(a.at[rows].add(1.5), ref.at[rows].add(1.5))          # repeated rows add twice
    check(a.at[:, 2].set(-1.0), ref.at[:, 2].set(-1.0))
    check(a.at[1:3, ::2].multiply(2.0), ref.at[1:3, ::2].multiply(2.0))
    check(a.at[5].max(0.5), ref.at[5].max(0.5))
    check(a.at[5].min(0.5), ref.at[5].min(0.5))
    check(a.at[2:6].get(), A[2:6])
    row = dist.shard_tensor(B[0], a.mesh, [R()] * a.mesh.ndim)
    check(a.at[4].set(row), ref.at[4].set(B[0]))                # a DistTensor update
    check(a.at[rows].subtract(B[:4]), ref.at[rows].subtract(B[:4]))  # a host array update
    flags = dist.shard_tensor(A > 0, a.mesh, a.placements)     # on truth values: or, and
    ored, anded = A > 0, A > 0
    ored[rows], anded[1:3] = True, False
    check(flags.at[rows].add(2), ored)           # (jax warns that its scatter will refuse it)
    check(flags.at[1:3].multiply(0), anded)
    with pytest.raises(IndexError, match="out of bounds"):
        a.at[0, 9].set(7.0)                                     # numpy's rule: say so
    with pytest.raises(TypeError, match="scalar"):
        a.at[0].set("x")


def test_array_methods_match_jax(a):
    for name, args, kwargs in [("flatten", (), {}), ("ravel", (), {}), ("swapaxes", (0, 1), {}),
                               ("clip", (-1, 2), {}), ("round", (), {}),
                               ("cumsum", (), {"axis": 1}), ("cumprod", (), {"axis": 0}),
                               ("var", (), {"axis": 0}), ("std", (), {}),
                               ("sort", (), {"axis": 1}), ("argsort", (), {"axis": 0}),
                               ("repeat", (2,), {"axis": 0}), ("trace", (), {}),
                               # array repeats set the shape: read on the host, as jax does
                               ("repeat", (np.array([1, 2, 0, 1, 3, 0, 1, 2]),), {"axis": 0}),
                               ("repeat", (), {"repeats": jnp.arange(8) % 3, "axis": 1}),
                               ("diagonal", (), {"offset": 1}),
                               ("take", (np.array([1, 5]),), {"axis": 1})]:
        expected = getattr(jnp.asarray(A), name)(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("error", dist.FallbackWarning)  # every one has its rules
            check(getattr(a, name)(*args, **kwargs), expected, rtol=1e-5)
    b = dist.shard_tensor(B, a.mesh, [R()] * a.mesh.ndim)
    check(a.dot(b), A @ B, rtol=1e-5)
    check(a[None].squeeze(0), A)
    with pytest.raises(TypeError, match="hashable"):
        a.clip(np.int32(0), {"max": 1})


def test_vmap_over_a_dtensor_says_to_vmap_inside():
    a = dist.shard_tensor(A, MESH24, [S(0), S(1)])
    with pytest.raises(dist.PlacementTypeError, match=r"dist.jit\(jax.vmap\(f\)\)") as info:
        jax.vmap(lambda r: r.sum())(a)
    assert "[S(0), S(1)]" in str(info.value) and "test_eager.py:" in str(info.value)
    check(dist.jit(jax.vmap(lambda r: r.sum()))(a), A.sum(1))


@pytest.mark.parametrize("transform", [jax.jacfwd, jax.jacrev,
                                       lambda f: jax.hessian(lambda x: f(x).sum())],
                         ids=["jacfwd", "jacrev", "hessian"])
def test_a_jacobian_at_a_dtensor_says_to_take_it_inside(transform):
    a = dist.shard_tensor(A, MESH24, [S(0), S(1)])
    f = lambda x: jnp.sin(x).sum(1)
    with pytest.raises(dist.PlacementTypeError, match=r"dist.jit\(jax.jacfwd\(f\)\)") as info:
        transform(f)(a)
    assert "[S(0), S(1)]" in str(info.value) and "test_eager.py:" in str(info.value)
    # what it says to write instead: inside dist.jit, or of the global array
    expected = transform(f)(jnp.asarray(A))
    check(dist.jit(transform(f))(a), expected, rtol=1e-5)
    np.testing.assert_allclose(transform(f)(a.numpy()), expected, rtol=1e-5)


def test_equal_static_arguments_of_other_types_are_other_programs():
    # True == 1 == 1.0 as cache keys; as indices and arguments they differ (jax's results)
    a = dist.shard_tensor(A, MESH8, [S(0)])
    ints = dist.shard_tensor(A.astype(np.int32), MESH8, [S(0)])
    J = jnp.asarray(A)
    for first, second in [(lambda: a[True], lambda: a[1]), (lambda: a[0], lambda: a[False]),
                          (lambda: a[1:3], lambda: a[True:3]),
                          (lambda: a.at[1].set(-1.0), lambda: a.at[True].set(-1.0))]:
        for make in (first, second):
            out = make()
            assert isinstance(out, dist.DistTensor)
    check(a[True], J[True])
    check(a[1], J[1])
    check(a[False], J[False])
    check(a.at[True].set(-1.0), J.at[True].set(-1.0))
    check(a.at[1].set(-1.0), J.at[1].set(-1.0))
    Ji = jnp.asarray(A.astype(np.int32))
    check(ints.clip(1), Ji.clip(1), dtype=Ji.clip(1).dtype)
    check(ints.clip(1.0), Ji.clip(1.0), dtype=Ji.clip(1.0).dtype)
    assert Ji.clip(1).dtype != Ji.clip(1.0).dtype


def test_argmax_over_a_sharded_dim_runs_by_its_rule():
    a = dist.shard_tensor(A, MESH8, [S(0)])
    check(a.argmax(0), A.argmax(0))
    # its own rule (a local arg + value, then a cross-shard combine: test_cumulative.py)
    assert not eager.PROGRAMS[("argmax", 0, False)].plan(a).fallbacks


def test_python_conversions():
    a = dist.shard_tensor(A, MESH24, [S(0), S(1)])
    assert float(a.sum()) == float(A.sum())
    assert int(a[2, 3]) == int(A[2, 3])
    assert bool(a.max() > 0) is True
    assert complex(a[0, 0]) == complex(A[0, 0])
    assert bool(a[1:2, 1:2]) == bool(A[1, 1])   # one element: like numpy
    with pytest.raises(TypeError, match="0-d"):
        float(a)
    with pytest.raises(ValueError, match="ambiguous"):
        bool(a > 0)
    assert a.astype(np.int32).sum().numpy().item() == int(A.sum())
    assert a[2, 3].item() == A[2, 3].item() and a.sum().item() == A.sum().item()
    assert a.tolist() == A.tolist()
    with pytest.raises(ValueError, match="one element"):
        a.item()
    with pytest.raises(TypeError, match="0-d"):
        iter(a.sum())
    # a training loop's print(f"loss {loss:.4f}") and round(loss, 2), as for a jax array
    assert f"{a.sum():.3f}" == f"{A.sum():.3f}" and f"{a[2, 3]:>6}" == f"{A[2, 3]:>6}"
    assert f"{a}" == str(a) and "placements=[S(0), S(1)]" in f"{a}"
    with pytest.raises(TypeError, match="one-element"):
        f"{a:.2f}"
    check(round(a.mean(), 2), np.round(A.mean(), 2))
    # `v in x`: any element equal, as for a jax or numpy array
    assert (A[1, 2] in a, -1234.5 in a, A[3, 0] in a[2:]) == (True, False, A[3, 0] in A[2:])


@pytest.mark.parametrize("placements", [[R()], [P()], ["P(max)"]], ids=["replicated", "pending sum",
                                                                         "pending max"])
@pytest.mark.parametrize("value", [np.float32(2.567), np.float32(-2.5), np.int32(7)],
                         ids=["float", "half", "int"])
@pytest.mark.parametrize("ndigits", [None, 0, 2])
def test_round_of_a_0d_tensor_is_jaxs_round(placements, value, ndigits):
    # Python's round(x) is an integer, as round() of a 0-d jax array (or a numpy scalar) is;
    # it kept the float dtype. round(x, n) keeps the dtype, as jax's does.
    x = dist.shard_tensor(value, MESH8, placements)
    out, want = round(x, ndigits), round(jnp.asarray(value), ndigits)
    assert isinstance(out, dist.DistTensor) and out.dtype == want.dtype, (out.dtype, want.dtype)
    np.testing.assert_array_equal(out.numpy(), np.asarray(want))
    if ndigits is None:  # an index, as the jax array's is
        assert operator.index(out) == operator.index(want) == round(value)

def test_numpy_functions_and_jax_array_properties():
    """np.sum(x) / np.mean(x) / np.argmax(x) call x.sum(axis, dtype, out): they run through
    the engine and keep placements; jax.Array's properties and methods a user reaches for."""
    a = dist.shard_tensor(A, MESH24, [S(0), S(1)])
    for f in (np.sum, np.mean, np.max, np.min, np.prod, np.argmax, np.argmin, np.any, np.all):
        check(f(a), f(A), rtol=1e-5)
        check(f(a, axis=1), f(A, axis=1), rtol=1e-5)
    check(np.sum(a, dtype=np.int32), np.sum(A, dtype=np.int32), dtype=np.int32)
    with pytest.raises(TypeError, match="out= is not supported"):
        np.sum(a, out=np.zeros(()))
    c = dist.shard_tensor((A + 1j * B).astype(np.complex64), MESH24, [S(0), R()])
    check(c.real, A)
    check(c.imag, B)
    check(a.mT, A.T)
    copied = a.copy()
    check(copied, A)
    assert copied is not a and copied.placements == a.placements
    assert a.block_until_ready() is a
    assert a.nbytes == A.nbytes and a.itemsize == 4
    assert a.devices() == set(jax.devices()) and not a.is_fully_replicated
    assert dist.shard_tensor(A, MESH24, [R(), R()]).is_fully_replicated
    # nonzero: its shape depends on the values, so (as jax outside a jit) computed on the host;
    # with size= one program, DistTensors out
    for got, want in zip((a > 0).nonzero(), np.nonzero(A > 0)):
        np.testing.assert_array_equal(np.asarray(got), want)
    with warnings.catch_warnings():
        # jax 0.12 makes it a hijax primitive: expanded to its lojax form, by the rules
        warnings.simplefilter("error", dist.FallbackWarning)
        for got, want in zip((a > 0).nonzero(size=70, fill_value=-1),
                             jnp.nonzero(A > 0, size=70, fill_value=-1)):
            check(got, want)
    check(a.ptp(axis=1), np.ptp(A, axis=1))
    check(a.conjugate(), A)
    assert a.is_fully_addressable and not a.weak_type
    assert a.committed and a.block_until_ready().is_ready()
    a.copy_to_host_async()
    assert a.tobytes() == A.tobytes()
    # every device's block counted, as jax counts a sharded array's
    assert a.on_device_size_in_bytes() == A.nbytes
    assert dist.shard_tensor(A, MESH24, [R(), R()]).on_device_size_in_bytes() == 8 * A.nbytes
    bits = a.view(np.uint32)  # a bitcast, per block: placements kept, nothing moved
    assert bits.placements == a.placements
    np.testing.assert_array_equal(bits.numpy(), A.view(np.uint32))
    halves = a.view(np.uint16)  # the last dim twice as long, still split
    assert halves.shape == (A.shape[0], 2 * A.shape[1]) and halves.placements == a.placements
    np.testing.assert_array_equal(halves.numpy(), A.view(np.uint16))
    scratch = a.copy()
    assert not scratch.is_deleted()
    scratch.delete()
    assert scratch.is_deleted() and not a.is_deleted()


def test_more_jax_array_members():
    """clone / byteswap / compress / choose run through the engine; aval, device, to_device and
    flat answer as a sharded jax.Array's."""
    a = dist.shard_tensor(A, MESH24, [S(0), S(1)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        cloned = a.clone()
        check(cloned, A)
        assert cloned is not a and cloned.placements == a.placements
        check(a.byteswap(), A.byteswap())
        # the condition sets the shape: read on the host (as jax outside a jit), data moved
        # on the devices
        keep = (np.arange(A.shape[0]) % 3) != 1
        check(a.compress(keep, axis=0), np.compress(keep, A, axis=0))
        check(a.compress(jnp.asarray(A[0] > 0), axis=1), np.compress(A[0] > 0, A, axis=1))
        check(a.compress(A.ravel() > 2), np.compress(A.ravel() > 2, A))
        check(a.compress(keep, axis=0, size=4, fill_value=-9),
              jnp.compress(keep, jnp.asarray(A), axis=0, size=4, fill_value=-9))
        picks = dist.shard_tensor((np.arange(A.size).reshape(A.shape) % 3).astype(np.int32),
                                  MESH24, [S(0), R()])
        b = dist.shard_tensor(B, MESH24, [R(), S(1)])
        check(picks.choose([a, b, A * 2]), np.choose(picks.numpy(), [A, B, A * 2]))
        check((picks + 2).choose([a, b], mode="wrap"),
              np.choose(picks.numpy() + 2, [A, B], mode="wrap"))
    with pytest.raises(ValueError, match="invalid entry"):
        (picks + 1).choose([a, b, A])
    assert a.aval == jax.core.ShapedArray(A.shape, A.dtype)
    assert a.device == a.sharding
    one = a.to_device(jax.devices()[3])
    assert isinstance(one, jax.Array) and one.devices() == {jax.devices()[3]}
    np.testing.assert_array_equal(np.asarray(one), A)
    with pytest.raises(NotImplementedError, match="flatten"):
        a.flat
    with pytest.raises(dist.AutoshardError, match="out= is not supported"):
        picks.choose([a, b], out=a)


# -- caching, meshes, pytrees -------------------------------------------------------------------

def test_second_call_with_same_layouts_does_not_retrace():
    a = dist.shard_tensor(A, MESH8, [S(0)])
    b = dist.shard_tensor(B, MESH8, [S(1)])
    a @ b
    a * 2.0
    a[1:5, 3]
    a.sum(1)
    traced = {k: eager.PROGRAMS[k].trace_count for k in [
        ("matmul",), ("mul",), ("getitem", (("slice", 1, 5, None), 3)),
        ("sum", (1,), False)]}
    a2 = dist.shard_tensor(B, MESH8, [S(0)])  # other values, same layout
    check(a2 @ b, B @ B, rtol=1e-5)
    check(a * 3.0, A * 3.0)                   # another scalar is an argument, not a new program
    check(a2[1:5, 3], B[1:5, 3])
    check(a2.sum(1), B.sum(1))
    assert {k: eager.PROGRAMS[k].trace_count for k in traced} == traced
    a[2:6, 7]  # another static parameter is another program
    assert eager.PROGRAMS[("getitem", (("slice", 2, 6, None), 7))].trace_count == 1


def test_operands_on_different_meshes_raise_mesh_mismatch():
    a = dist.shard_tensor(A, MESH8, [S(0)])
    other = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    b = dist.shard_tensor(B, other, [S(0)])
    with pytest.raises(dist.MeshMismatchError, match=r"values on .* and on .* meet in `add`") as info:
        a + b
    assert "test_eager.py:" in str(info.value)
    with pytest.raises(dist.MeshMismatchError):
        a[dist.shard_tensor(np.array([0, 1], np.int32), other, [R()])]


@pytest.mark.parametrize("fn", [jnp.add, lambda a, b: jnp.where(a > 0, a, b),
                                lambda a, b: jnp.matmul(a, b.mT),
                                lambda a, b: jax.nn.dot_product_attention(a, a, b)
                                ], ids=["jnp.add", "jnp.where", "jnp.matmul", "jax.nn"])
def test_a_jax_function_of_operands_on_two_meshes_is_a_mesh_mismatch(fn):
    # as `a + b` is: the operands reach jnp through __jax_array__ one by one, and jax's own
    # "incompatible devices" ValueError named neither mesh
    other = dist.ProcessMesh([0, 1, 2, 3], dim_names=["y"])
    a = dist.shard_tensor(A[None, :, None], MESH8, [S(1)])
    b = dist.shard_tensor(B[None, :, None], other, [S(1)])
    with pytest.raises(dist.MeshMismatchError) as info:
        fn(a, b)
    text = str(info.value)
    assert f"placed [S(1)] on {MESH8!r}" in text and f"on {other!r}" in text, text
    assert "dist.reshard(b, a.process_mesh, a.placements)" in text and "test_eager.py:" in text
    fixed = fn(a, dist.reshard(b, a.process_mesh, a.placements))
    np.testing.assert_allclose(np.asarray(fixed), fn(A[None, :, None], B[None, :, None]),
                               rtol=1e-5, atol=1e-5)


def test_jax_functions_of_tensors_on_one_device_set_or_mapped_per_mesh_run():
    """Not a mismatch: two meshes of the same devices (jax takes both layouts), and a
    jax.tree.map pairing tensors mesh by mesh (pipeline stages' params)."""
    a = dist.shard_tensor(A, MESH24, [S(0), S(1)])
    b = dist.shard_tensor(B, MESH8, [S(1)])
    np.testing.assert_allclose(np.asarray(jnp.add(a, b)), A + B, rtol=1e-6)
    stage1 = dist.ProcessMesh([4, 5, 6, 7], ["x"])
    pairs = jax.tree.map(jnp.add, [a, dist.shard_tensor(A, stage1, [S(0)])],
                         [b, dist.shard_tensor(B, stage1, [R()])],
                         is_leaf=lambda t: isinstance(t, dist.DistTensor))
    for out in pairs:
        np.testing.assert_allclose(np.asarray(out), A + B, rtol=1e-6)


def test_plans_and_warnings_point_at_the_users_line():
    # Shapes no other test uses: fresh traces, so the first caller's line is recorded.
    a = dist.shard_tensor(A[:4], MESH8, [S(1)])
    b = dist.shard_tensor(B[:, :4], MESH8, [S(0)])
    c = a @ b
    check(c * c, (A[:4] @ B[:, :4]) ** 2, rtol=1e-5)
    text = str(eager.PROGRAMS[("mul",)].explain(c, c))  # the plan of the call above, cached
    assert "all-reduce" in text and "test_eager.py:" in text and "eager.py:" not in text.replace(
        "test_eager.py:", "")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a.argmax(1)
    msgs = [str(w.message) for w in caught if issubclass(w.category, dist.FallbackWarning)]
    assert all("test_eager.py:" in m for m in msgs), msgs


def test_dtensors_stay_pytrees_and_hashable():
    d = {"a": dist.shard_tensor(A, MESH24, [S(0), S(1)]),
         "b": dist.shard_tensor(B, MESH24, [R(), S(0)])}
    doubled = jax.tree.map(lambda x: x * 2, d)
    assert all(isinstance(v, dist.DistTensor) for v in doubled.values())
    check(doubled["a"], 2 * A)
    assert doubled["b"].placements == d["b"].placements
    summed = jax.tree.map(lambda x, y: x + y, d, d, is_leaf=lambda x: isinstance(x, dist.DistTensor))
    check(summed["b"], 2 * B)   # the leaves are DistTensors: their own + runs
    assert len(jax.tree.leaves(d)) == 2
    assert jax.jit(lambda t: jax.tree.map(jnp.negative, t))(d)["a"].placements == [S(0), S(1)]
    out = dist.jit(lambda t: t["a"] @ t["b"])(d)
    check(out, A @ B, rtol=1e-5)
    a = d["a"]
    assert hash(a) == hash(a) and {a: 1}[a] == 1 and len({a, d["b"]}) == 2
    assert a in [a] and a in {a}


# -- random sequences of eager operations -------------------------------------------------------

_STEPS = {  # name: the same operation on DistTensors and on numpy arrays
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "matmul": lambda a, b: a @ b,
    "rsub": lambda a, b: 2.0 - a,
    "T": lambda a, b: a.T,
    "sum0": lambda a, b: a.sum(0, keepdims=True) + b,
    "rowmax": lambda a, b: a - a.max(1, keepdims=True),
    "mean": lambda a, b: a * a.mean(),
    "reversed": lambda a, b: a[::-1, :] * b,
    "rows": lambda a, b: a[np.array([3, 1, 4, 1, 5, 7, 2, 6])],
    "reshape": lambda a, b: a.reshape(4, 16).reshape(8, 8),
    "compare": lambda a, b: (a > b).astype(np.float32) + a,
    "cumsum": lambda a, b: a.cumsum(axis=1),
    "clip": lambda a, b: a.clip(-1, 1) * b,
    "var": lambda a, b: a - a.var(axis=0),
    "abs": lambda a, b: abs(a) + b,
}


@st.composite
def _eager_cases(draw):
    mesh = draw(st.sampled_from([MESH8, MESH24]))
    one_kind = lambda p: not ("P(sum)" in p and "P(max)" in p)  # noqa: E731
    placements = st.lists(st.sampled_from(["R", "S(0)", "S(1)", "P(sum)", "P(max)"]),
                          min_size=mesh.ndim, max_size=mesh.ndim).filter(one_kind)
    steps = draw(st.lists(st.sampled_from(sorted(_STEPS)), min_size=1, max_size=5))
    return mesh, steps, draw(placements), draw(placements), draw(st.integers(0, 99))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_eager_cases())
def test_random_eager_sequences_equal_numpy_at_every_step(case):
    mesh, steps, pa, pb, seed = case
    rng = np.random.default_rng(seed)
    a = make_tensor(A + rng.permutation(64).reshape(8, 8).astype(np.float32) * 1e-2, mesh, pa,
                    seed=seed)
    b = make_tensor(B + rng.permutation(64).reshape(8, 8).astype(np.float32) * 1e-2, mesh, pb,
                    seed=seed + 1)
    x, y = a.numpy(), b.numpy()  # the logical values (random Partial parts round)
    for name in steps:
        a, x = _STEPS[name](a, b), np.asarray(_STEPS[name](x, y), np.float32)
        assert isinstance(a, dist.DistTensor) and a.shape == x.shape, name
        np.testing.assert_allclose(a.numpy(), x, rtol=1e-4, atol=1e-3 * (1 + np.abs(x).max()))


def test_an_empty_partial_result_keeps_one_slot_per_device():
    from autoshard.testing import logical_value, make_tensor

    mesh = dist.ProcessMesh([0, 1, 2, 3], ["x"])
    a = make_tensor(np.ones((4, 8), np.float32), mesh, ["P(sum)"], 1)
    r = a[4:]  # shape (0, 8), still Partial
    assert r.placements == [dist.Partial()] and r.physical.sharding.spec == r.sharding.spec
    assert logical_value(r).shape == (0, 8)


@pytest.mark.parametrize("mesh,placements", [
    (MESH24, [S(0), S(1)]),
    (MESH24, [P(), S(1)]),
    (MESH24, ["P(max)", "P(max)"]),
    (MESH24, ["P(avg)", "P(sum)"]),
    (MESH8, [S(0)]),
    (dist.ProcessMesh(list(range(3)), ["x"]), [S(0)]),  # 8 rows over 3: stored uneven
], ids=["split", "pending sum", "pending max", "pending mean and sum", "1-d", "uneven"])
@pytest.mark.filterwarnings("ignore::autoshard.UnevenShardingWarning")  # `t > 0` says it
def test_jax_functions_take_a_dtensor_as_a_sharded_array(mesh, placements):
    # jnp / jax.nn functions read a DistTensor as its logical global array (__jax_array__),
    # split as the tensor is where jax can say so, and return a jax.Array as for any array
    value = np.random.default_rng(4).normal(size=(8, 4)).astype(np.float32)
    x = make_tensor(value, mesh, placements)
    for fn in (jnp.exp, jax.nn.relu, lambda t: jnp.sum(t, axis=0),
               lambda t: jnp.where(t > 0, t, 0.0), lambda t: jnp.concatenate([t, t])):
        out = fn(x)
        assert isinstance(out, jax.Array)
        np.testing.assert_allclose(np.asarray(out), fn(value), rtol=1e-6, atol=1e-6)
    whole = jnp.asarray(x)
    if not x.layout.partial and mesh.shape != [3]:
        assert whole is x.physical  # no copy: the stored array is the global one
        assert whole.sharding.spec == x.sharding.spec
    np.testing.assert_allclose(np.asarray(whole), value, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mesh,placements", [
    (MESH24, [S(0), S(1)]),
    (MESH8, [S(0)]),
    (dist.ProcessMesh([[0, 1], [2, 3]], ["a", "b"]), [S(0), S(1)]),   # 4 columns... of 3
    (dist.ProcessMesh(list(range(3)), ["x"]), [S(0)]),                # 8 rows over 3
], ids=["split", "1-d", "uneven 2-d", "uneven"])
@pytest.mark.filterwarnings("ignore::autoshard.UnevenShardingWarning")
def test_an_eager_gradient_through_jnp_is_stored_as_its_placements_say(mesh, placements):
    # jax hands the cotangent back laid out as XLA chose (on one device when it is made of
    # unsharded jnp values, or a padded storage split otherwise): every device's block must
    # still be the block its placements give it
    value = np.random.default_rng(5).normal(size=(8, 3)).astype(np.float32)
    weights = np.arange(24, dtype=np.float32).reshape(8, 3)
    x = make_tensor(value, mesh, placements)
    g = jax.grad(lambda t: (jnp.asarray(t) * jnp.asarray(weights) + jnp.sin(t)).sum())(x)
    expected = weights + np.cos(value)
    assert g.placements == placements
    np.testing.assert_allclose(g.numpy(), expected, rtol=1e-6)
    blocks = dist.dtensor_to_local(g)
    for d in range(mesh.size):
        rows = tuple(slice(*b) for b in g.block_bounds(d))
        np.testing.assert_allclose(np.asarray(g.local(d)), expected[rows], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(blocks[d]), expected[rows], rtol=1e-6)


def test_jax_device_put_of_a_dtensor_stays_on_its_mesh():
    from jax.sharding import NamedSharding, PartitionSpec
    x = make_tensor(A, MESH24, [S(0), S(1)])
    # onto its own mesh, laid out otherwise: the placements follow the stored array
    r = jax.device_put(x, NamedSharding(MESH24.to_jax(), PartitionSpec(None, "mp")))
    assert r.placements == [R(), S(1)]
    np.testing.assert_array_equal(r.numpy(), A)
    # onto other devices: a DistTensor cannot claim a mesh its array left
    other = dist.ProcessMesh([[4, 5], [6, 7]], ["dp", "mp"])
    for where in (jax.devices()[0], NamedSharding(other.to_jax(), PartitionSpec("dp"))):
        with pytest.raises(dist.PlacementTypeError, match=r"dist.reshard\(x, other_mesh") as info:
            jax.device_put(x, where)
        assert "[S(0), S(1)]" in str(info.value) and "test_eager.py:" in str(info.value)


@pytest.mark.parametrize("kind", ["sum", "avg", "max"])
def test_an_eager_gradient_at_a_partial_tensor_is_the_gradient_of_its_value(kind):
    # the cotangent of each pending part is not a part of the gradient (P(sum): each the whole
    # of it): jax flattens the tensor to its value, reduced, and differentiates that — through
    # jnp and through the operators alike; the gradient is placed without the Partial
    x = make_tensor(A, MESH24, [P(kind), S(1)])
    for f, want in ((lambda t: jnp.sum(jnp.sin(t)), np.cos(A)), (lambda t: (t * t).sum(), 2 * A)):
        g = jax.grad(f)(x)
        assert g.placements == [R(), S(1)]
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-5, atol=1e-6)
    # reduced by the user first: the same
    y = dist.reshard(x, MESH24, [R(), S(1)])
    np.testing.assert_allclose(jax.grad(lambda t: jnp.sum(jnp.sin(t)))(y).numpy(), np.cos(A),
                               rtol=1e-6)
    # an eager reshard inside the differentiated function says to use dist.jit (it asked the
    # traced value whether its buffers were donated: jax's ConcretizationTypeError)
    w = make_tensor(A, MESH24, [S(0), S(1)])
    with pytest.raises(dist.ReshardError, match="use dist.jit"):
        jax.grad(lambda t: jnp.sum(dist.reshard(t, MESH24, [R(), S(1)])))(w)
    check(dist.jit(jax.grad(lambda t: jnp.sum(jnp.sin(dist.reshard(t, MESH24, [R(), S(1)])))))(
        w), np.cos(A))


@pytest.mark.parametrize("placements", [[S(0), R()], [R(), S(1)], [S(0), S(1)]])
def test_item_assignment_updates_in_place_and_keeps_placements(placements):
    """`x[idx] = v` as numpy and Paddle take it (flax writes Variables holding a DistTensor
    this way: `metric.total[...] = 0`)."""
    a = dist.shard_tensor(A, MESH24, placements)
    alias = a
    want = np.array(A)
    a[1:3] = 5.0
    want[1:3] = 5.0
    a[..., 0] = np.arange(A.shape[0], dtype=A.dtype)
    want[..., 0] = np.arange(A.shape[0])
    a[np.array([0, 5])] = -1.0   # an array index
    want[np.array([0, 5])] = -1.0
    check(alias, want)   # the same object, updated
    assert a.placements == placements
    a[...] = 7           # the whole tensor (a broadcast, the dtype kept)
    check(alias, np.full_like(A, 7.0))
    assert a.placements == placements and a.dtype == A.dtype


_BAD_A = dist.shard_tensor(np.ones((4, 4), np.float32), MESH24, [S(0), R()])
_BAD_B = dist.shard_tensor(np.ones((4, 3), np.float32), MESH24, [R(), R()])


@pytest.mark.parametrize("op, kind, match", [
    (lambda: _BAD_A + _BAD_B, TypeError,
     r"add of float32\[4, 4\] \[S\(0\), R\], float32\[4, 3\] \[R, R\]: add got "
     r"incompatible shapes for broadcasting"),
    (lambda: _BAD_B @ _BAD_B, TypeError, r"matmul of .*contracting dimensions"),
    (lambda: _BAD_A.reshape(5, 3), TypeError, r"reshape of float32\[4, 4\] \[S\(0\), R\]: "
                                              r"cannot reshape"),
    (lambda: _BAD_A.mean(axis=(0, 0)), ValueError, r"mean of .*duplicate value in 'axis'"),
    (lambda: _BAD_A.transpose(0, 0), TypeError, r"transpose of .*permutation"),
    (lambda: _BAD_A.sum(axis=3), np.exceptions.AxisError,
     r"axis 3 is out of bounds for a DistTensor of 2 dims: name an axis from -2 to 1"),
    (lambda: _BAD_A[7], IndexError, r"index 7 is out of bounds for axis 0 with size 4 \(of a "
                                    r"DistTensor of shape \(4, 4\)\)"),
    (lambda: _BAD_A.astype("floaty"), TypeError, r"astype\('floaty'\): .*name a numpy or jax "
                                                 r"dtype"),
])
def test_an_op_its_operands_do_not_fit_names_them_and_the_line(op, kind, match):
    """What numpy / jax refuse on one device (shapes that do not broadcast, an axis or index
    out of range, an unknown dtype) is a dist.OperandError that is also numpy's builtin error,
    naming the operands' shapes and placements and the user's line (jax's message alone named
    neither)."""
    with pytest.raises(dist.OperandError, match=match) as info:
        op()
    assert isinstance(info.value, kind) and "test_eager.py:" in str(info.value), str(info.value)


MESH4 = dist.ProcessMesh([0, 1, 2, 3], ["x"])


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.bool_])
@pytest.mark.parametrize("reduce", [jax.lax.reduce_and, jax.lax.reduce_or], ids=["and", "or"])
def test_bitwise_and_or_reductions_over_a_split_dim(dtype, reduce):
    """and / or of integers are bitwise: across devices they are not the min / max of the
    devices' results (that holds for bools only: an int32 and gave 1 where one device gives 0);
    and the rows a nearly whole slice leaves out are masked with every bit set before an and
    (they were set to 1, and 6 & 1 is 0)."""
    rng = np.random.default_rng(0)
    x = (rng.integers(0, 16, (2, 8)) | 6).astype(dtype)  # every value has the bits of 6
    if dtype == np.bool_:
        x = rng.integers(0, 2, (2, 8)).astype(bool)
    t = dist.shard_tensor(x, MESH4, [dist.Shard(1)])
    for op in (lambda a: reduce(a, (1,)), lambda a: reduce(a[:, :-1], (1,)),
               lambda a: reduce(a[:, 1:], (1,))):
        np.testing.assert_array_equal(dist.jit(op)(t).numpy(), np.asarray(op(jnp.asarray(x))))


@pytest.mark.parametrize("dtype, acc", [(np.int8, np.int32), (np.uint8, np.float32),
                                        (np.float16, np.float32)])
def test_a_pending_sum_is_reduced_before_a_matmul_that_widens_it(dtype, acc):
    """A matmul or convolution with a wider preferred_element_type casts its operands first:
    a pending int8 sum of 100 and 100 is -56 on one device (float16's 40000 + 40000 is inf),
    but its parts widened and multiplied apart summed to 200 (80000). The sum is reduced in
    its own type first, as one device computes it."""
    # parts whose sum wraps (int8 100 + 100, uint8 200 + 200) or overflows (float16)
    part = np.full((4, 2), {np.int8: 100, np.uint8: 200, np.float16: 40000}[dtype], dtype)
    t = dist.dtensor_from_local([part, part], MESH2, [dist.Partial()])
    w = jnp.ones((2, 3), dtype)
    kernel = jnp.ones((3, 2, 2), dtype)
    ops = [lambda a: jax.lax.dot(a, w, preferred_element_type=acc),
           lambda a: jnp.einsum("ij,jk->ik", a, w, preferred_element_type=acc),
           lambda a: jax.lax.conv_general_dilated(
               a[None], kernel, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"),
               preferred_element_type=acc)]
    for op in ops:
        np.testing.assert_array_equal(dist.jit(op)(t).numpy(),
                                      np.asarray(op(jnp.asarray(t.numpy()))))
