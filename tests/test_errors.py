"""Bad input gives a typed error that names the tensor, placement, mesh dim and the user's line."""
import numpy as np
import pytest

import autoshard as dist

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])


def _raises(error, match, fn):
    with pytest.raises(error, match=match) as info:
        fn()
    assert isinstance(info.value, dist.AutoshardError)
    assert "test_errors.py:" in str(info.value), str(info.value)
    return str(info.value)


def test_wrong_number_of_placements():
    msg = _raises(dist.PlacementError, r"got 1 placements \[S\(0\)\] for a 2-d mesh",
                  lambda: dist.shard_tensor(np.zeros((4, 4)), MESH, [dist.Shard(0)]))
    assert "'dp', 'mp'" in msg and "one placement per mesh dim" in msg


def test_shard_dim_out_of_range_and_negative_dims():
    msg = _raises(dist.PlacementError, r"S\(2\) on mesh dim 'mp'.*valid dims are -2..1",
                  lambda: dist.shard_tensor(np.zeros((4, 4)), MESH, [dist.Replicate(), dist.Shard(2)]))
    assert "float32[4, 4]" in msg
    x = dist.shard_tensor(np.zeros((4, 8)), MESH, [dist.Replicate(), dist.Shard(-1)])
    assert x.placements == [dist.Replicate(), dist.Shard(1)] and x.local_shape == (4, 2)


def test_not_divisible_is_stored_and_the_warning_on_use_names_dim_size_and_axis():
    x = dist.shard_tensor(np.zeros((6, 4), np.float32), MESH, [dist.Replicate(), dist.Shard(0)])
    with pytest.warns(dist.UnevenShardingWarning,
                      match=r"argument 0 \(shape \(6, 4\)\): dim 0 of size 6 does not split "
                            r"evenly over mesh dim 'mp' \(4\).*pad dim 0 to 8 \(a multiple of 4\)"):
        dist.jit(lambda a: a + 1)(x)
    with pytest.warns(dist.UnevenShardingWarning, match=r"'dp' \(2\) × 'mp' \(4\) = 8 devices"):
        dist.jit(lambda a: a + 1)(dist.shard_tensor(np.zeros((4, 4)), MESH,
                                                    [dist.Shard(0), dist.Shard(0)]))


def test_non_placement_objects():
    msg = _raises(dist.PlacementTypeError, r"placements\[1\] \(for mesh dim 'mp'\) is 0 of type int",
                  lambda: dist.shard_tensor(np.zeros((4, 4)), MESH, [dist.Replicate(), 0]))
    assert "dist.Shard(0)" in msg
    _raises(dist.PlacementTypeError, "one placement per mesh dim",
            lambda: dist.shard_tensor(np.zeros((4, 4)), MESH, dist.Shard(0)))


def test_reshard_errors():
    x = dist.shard_tensor(np.zeros((4, 4)), MESH, ["S(0)", "R"])
    _raises(dist.PlacementTypeError, "needs a DistTensor",
            lambda: dist.reshard(np.zeros(4), MESH, ["R", "R"]))
    _raises(dist.DeviceNotFoundError, r"uses device ids \[8, 9, 10, 11\]",
            lambda: dist.reshard(x, dist.ProcessMesh([8, 9, 10, 11]), ["S(0)"]))


def test_errors_are_value_or_type_errors_too():
    assert issubclass(dist.PlacementError, ValueError)
    assert issubclass(dist.PlacementTypeError, TypeError)
    assert issubclass(dist.MeshError, ValueError)


def test_the_users_line_is_never_a_frame_of_pythons_own_library():
    """A mesh naming a device this process lacks is found inside functools' cached_property:
    the error names the line of the user's code that used the mesh, not functools.py."""
    mesh = dist.ProcessMesh([[0, 1], [2, 99]], dim_names=["a", "b"])
    msg = _raises(dist.DeviceNotFoundError, r"uses device ids \[99\]",
                  lambda: dist.shard_tensor(np.zeros((4, 4)), mesh, ["S(0)", "R"]))
    assert "functools.py" not in msg


def test_a_static_argument_number_past_the_parameters_and_a_non_array_result():
    x = dist.shard_tensor(np.ones((8, 4), np.float32), MESH, [dist.Shard(0), dist.Replicate()])

    def scale(a):
        return a * 2

    msg = _raises(dist.SignatureError, r"argument number 3 is named static.*takes 1 positional",
                  lambda: dist.jit(scale, static_argnums=3))
    assert "dist.jit(scale)" in msg

    def summary(a):
        return {"loss": a.sum(), "name": "run-1"}

    msg = _raises(dist.SignatureError, r"summary returned str 'run-1' at output\['name'\]",
                  lambda: dist.jit(summary)(x))
    assert "returns arrays" in msg
    assert dist.jit(lambda a, *rest: a * 2, static_argnums=3)(x).shape == (8, 4)  # *args: fine
    _raises(dist.SignatureError, r"argument 0 is both static and donated",
            lambda: dist.jit(scale, static_argnums=0, donate_argnums=0))

    def scaled(a, factor=2):
        return a * factor

    msg = _raises(dist.SignatureError, r"'factr' is named static.*did you mean 'factor'",
                  lambda: dist.jit(scaled, static_argnames="factr"))
    _raises(dist.SignatureError, r"'b' is named static", lambda: dist.jit(scaled, donate_argnames=["b"]))
    np.testing.assert_array_equal(  # a function taking **kwargs takes any name
        dist.jit(lambda a, **kw: a * kw.get("k", 1), static_argnames="k")(x, k=3).numpy(),
        np.full((8, 4), 3, np.float32))


def test_python_control_flow_on_a_traced_argument_names_the_users_function_and_argument():
    """jax's own error (its type kept, as jax.jit raises it), naming the function and the
    argument as jax.jit does, not dist.jit's flat wrapper (`flat at jit.py`, `flat_args[1]`)."""
    import jax

    x = dist.shard_tensor(np.ones((8, 4), np.float32), MESH, [dist.Shard(0), dist.Replicate()])

    def step(params, flag):
        return params["w"] * 2 if flag else params["w"]

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        dist.jit(step)({"w": x}, True)
    msg = str(info.value)
    assert "the function step at " + __file__ in msg and "the argument flag." in msg, msg
    assert "static_argnames" in msg and "jit.py" not in msg and "flat" not in msg
    with pytest.raises(jax.errors.ConcretizationTypeError, match=r"argument params\['w'\]"):
        dist.jit(lambda params: params["w"] if params["w"].sum() > 0 else 0)({"w": x})
    assert dist.jit(step, static_argnames="flag")({"w": x}, True).shape == (8, 4)


def test_a_donated_tensor_read_again_or_passed_twice_is_an_error_not_a_crash():
    x = np.ones((8, 4), np.float32)
    f = dist.jit(lambda a: a * 2.0, donate_argnums=0)
    a = dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Replicate()])
    np.testing.assert_array_equal(f(a).numpy(), x * 2)
    # named as the user passed it, not by its flat position (a probe: "input 6")
    _raises(dist.SignatureError, r"argument 0, a DistTensor of shape \(8, 4\).*was donated",
            lambda: f(a))
    h = dist.jit(lambda p, c: c * p["w"].sum(), donate_argnums=1)
    c, w = (dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Replicate()]) for _ in range(2))
    h({"w": w}, c)
    _raises(dist.SignatureError, r"<lambda>: argument 1, a DistTensor .*was donated",
            lambda: h({"w": w}, c))
    _raises(dist.SignatureError, r"another \(argument 1 and argument 0\['w'\]\)",
            lambda: h({"w": w}, w))
    _raises(dist.ReshardError, r"was donated to a dist.jit call", lambda: a.numpy())
    g = dist.jit(lambda a, b: a + b, donate_argnums=0)
    b = dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Replicate()])
    _raises(dist.SignatureError, r"passed as a donated argument and again as another "
            r"\(argument 0 and argument 1\)", lambda: g(b, b))
    np.testing.assert_array_equal(g(b, b + 0).numpy(), x * 2)


@pytest.mark.parametrize("call, match", [
    (lambda: dist.parse_placement(3), r"parse_placement reads a short form string, got 3"),
    (lambda: dist.shard_tensor("abc", MESH, ["R", "R"]), r"from str 'abc' \(numpy dtype <U3\)"),
    (lambda: dist.shard_tensor(np.array(["a", "b"]), MESH, ["S(0)", "R"]), r"numpy dtype <U1"),
    (lambda: dist.shard_tensor([[1, 2], [3]], MESH, ["R", "R"]), r"from list \[\[1, 2\], \[3\]\]"),
    (lambda: dist.shard_tensor(np.zeros(4), MESH, ["R", "R"], dtype="floaty"),
     r"dtype='floaty' is not a dtype"),
    (lambda: dist.dtensor_from_local("abc", MESH, ["R", "R"]), r"from str 'abc'"),
    (lambda: dist.dtensor_from_fn(3, MESH, ["R", "R"]), r"dtensor_from_fn needs a function"),
    (lambda: dist.placement_table(np.zeros(4)), r"placement_table needs a DistTensor, got ndarray"),
])
def test_what_is_not_a_tensor_placement_or_function_is_a_typed_error(call, match):
    _raises(dist.PlacementTypeError, match, call)


def test_the_blocks_of_a_donated_tensor_are_an_error_not_a_runtime_error():
    f = dist.jit(lambda a: a * 2.0, donate_argnums=0)
    a = dist.shard_tensor(np.ones((8, 4), np.float32), MESH, ["S(0)", "R"])
    f(a)
    _raises(dist.ReshardError, r"dtensor_to_local: a DistTensor float32\[8, 4\] placed "
                               r"\[S\(0\), R\] was donated", lambda: dist.dtensor_to_local(a))


@pytest.mark.parametrize("call, match", [
    (lambda: dist.CostModel(bandwidth={"dp": -1}), r"bandwidth\['dp'\] = -1 is not a number"),
    (lambda: dist.CostModel(bandwidth="fast"), r"bandwidth='fast' is not a dict of mesh dim"),
    (lambda: dist.CostModel(latency={"mp": "x"}), r"latency\['mp'\] = 'x' is not a number"),
    (lambda: dist.CostModel(default_bandwidth=0), r"default_bandwidth = 0 is not a number"),
    (lambda: dist.reshard(dist.shard_tensor(np.ones(4), MESH, ["R", "R"]), MESH, ["R", "R"],
                          cost_model="fast"), r"dist.reshard: cost_model='fast' of type str"),
    (lambda: dist.plan_reshard(dist.shard_tensor(np.ones(4), MESH, ["R", "R"]), MESH,
                               ["R", "R"], cost_model=3), r"dist.plan_reshard: cost_model=3"),
    (lambda: dist.jit(lambda a: a, cost_model="fast"), r"dist.jit\(<lambda>\): cost_model="),
])
def test_a_cost_model_that_is_not_one_is_an_error_where_it_is_given(call, match):
    _raises(dist.CostModelError, match, call)


@pytest.mark.parametrize("call, error, match", [
    (lambda: dist.jit(3), dist.SignatureError, r"dist.jit needs a function to partition, got int"),
    (lambda: dist.jit(lambda a: a, in_placements=[["R"]]), dist.SignatureError,
     r"dist.jit takes no option 'in_placements': in_placements is local_map's.*in_shardings="),
    (lambda: dist.jit(out_placement="keep"), dist.SignatureError,
     r"no option 'out_placement' \(did you mean 'out_placements'\?\)"),
    (lambda: dist.jit(lambda a: a, static_argnums="a"), dist.SignatureError,
     r"take argument numbers, got 'a': name it with static_argnames='a'"),
    (lambda: dist.jit(lambda a: a, donate_argnums=1.0), dist.SignatureError,
     r"take argument numbers, got 1.0"),
    (lambda: dist.jit(lambda a: a, static_argnames=[0]), dist.SignatureError,
     r"take parameter names, got \[0\]"),
    (lambda: dist.jit(lambda a: a, out_memory_kinds=3), dist.PlacementTypeError,
     r"out_memory_kinds=3 is not a memory kind"),
])
def test_dist_jit_arguments_of_the_wrong_kind(call, error, match):
    _raises(error, match, call)
    x = dist.shard_tensor(np.ones((8, 4), np.float32), MESH, ["S(0)", "R"])
    assert dist.jit(lambda a, n: a * n, static_argnums=None, static_argnames=None)(x, 2).shape == (8, 4)


@pytest.mark.parametrize("rule, lower, match", [
    (3, None, r"register_rule\(sin\): the rule is 3 of type int, not a function"),
    (None, None, r"the rule is None of type NoneType"),
    (lambda ins, outs, **params: None, 5, r"lower is 5 of type int.*lower=None or a function"),
    (lambda ins: None, None, r"the rule takes 1 positional argument\(s\), but it is called as "
                             r"rule\(in_avals, out_avals, \*\*params\)"),
])
def test_a_rule_that_is_no_function_of_in_and_out_avals_is_refused_when_registered(rule, lower, match):
    # (one that failed when called would be read as 'no rule here': the primitive replicated)
    from autoshard.rules.registry import lookup_rule
    import jax

    before = lookup_rule(jax.lax.sin_p)
    _raises(dist.PlacementTypeError, match, lambda: dist.register_rule(jax.lax.sin_p, rule, lower))
    assert lookup_rule(jax.lax.sin_p) is before


def _set_section(value):
    strategy = dist.Strategy()
    strategy.sharding = value


@pytest.mark.parametrize("call, match", [
    (lambda: dist.Strategy({"gradient_merge": {"k_steps": True}}),
     r"k_steps must be a positive int, got True"),
    (lambda: dist.Strategy({"amp": {"custom_white_list": "dot_general"}}),  # not d, o, t, ...
     r"custom_white_list is a list of jax primitive names.*got 'dot_general'"),
    (lambda: dist.Strategy({"amp": {"custom_black_list": 3}}), r"custom_black_list is a list"),
    (lambda: dist.Strategy({"sharding": {"mesh_dim": ["dp"]}}),
     r"mesh_dim names the mesh dim.*got \['dp'\]"),
    (lambda: _set_section(3), r"strategy.sharding must be a dict of its settings.*got 3"),
])
def test_strategy_values_of_the_wrong_type(call, match):
    _raises(dist.StrategyError, match, call)


@pytest.mark.parametrize("call, match", [
    (lambda: dist.ShardingStage1("zz", MESH), r"ShardingStage1\(mesh_dim='zz'\).*dims \['dp', 'mp'\]"),
    (lambda: dist.ShardingStage2(5, MESH), r"ShardingStage2\(mesh_dim=5\)"),
    (lambda: dist.ShardingStage3("dp", "mesh"), r"ShardingStage3\(mesh='mesh'\): mesh is a str"),
    (lambda: dist.ShardingStage1(["dp"]), r"mesh_dim is the mesh dim the states are split over"),
    (lambda: dist.shard_optimizer(__import__("optax").sgd(0.1), offload="False"),
     r"offload is a switch: write True or False, not 'False'"),
    (lambda: dist.shard_optimizer(__import__("optax").sgd(0.1), None, "2"),
     r"gradient_accumulation_steps must be an int >= 1, got '2'"),
])
def test_sharding_stages_and_optimizer_switches_are_checked_where_written(call, match):
    _raises(dist.OptimizerError, match, call)


def _local_map(out_placements, traced=False, **kw):
    x = dist.shard_tensor(np.ones((8, 8), np.float32), MESH, [dist.Shard(0), dist.Replicate()])
    f = dist.local_map(lambda a: a * 2, out_placements=out_placements, **kw)
    return dist.jit(f)(x) if traced else f(x)


_IN = {"in_placements": [[dist.Shard(0), dist.Replicate()]], "process_mesh": MESH}


@pytest.mark.parametrize("call, error, match", [
    (lambda: _local_map([[7, dist.Replicate()]]), dist.PlacementTypeError,
     r"out_placements\[0\]\[0\] \(for output 0, mesh dim 'dp'\) is 7 of type int, not a "
     r"placement: write dist.Shard\(d\)"),
    (lambda: _local_map([[7, dist.Replicate()]], True, **_IN), dist.PlacementTypeError,
     r"out_placements\[0\]\[0\] \(for output 0, mesh dim 'dp'\) is 7"),
    (lambda: _local_map([["S(0)", "X"]]), dist.PlacementError,
     r"out_placements\[0\]\[1\] \(for output 0, mesh dim 'mp'\): cannot read placement 'X'"),
    (lambda: _local_map([dist.Shard(0), dist.Replicate()]), dist.PlacementTypeError,
     r"out_placements = \[S\(0\), R\] is one flat list of placements, but it has one "
     r"placements list per output.*write out_placements=\[\[dist.Shard\(0\), "
     r"dist.Replicate\(\)\]\]"),
    (lambda: _local_map([dist.Shard(0), dist.Replicate()], True, **_IN), dist.PlacementTypeError,
     r"is one flat list of placements"),
    (lambda: _local_map(3), dist.PlacementTypeError,
     r"out_placements is a list with one placements list per output, got 3 of type int"),
    (lambda: _local_map([[dist.Shard(0), dist.Replicate()]], in_placements=[dist.Shard(0), "R"]),
     dist.PlacementTypeError, r"in_placements = \[S\(0\), 'R'\] is one flat list.*one "
                              r"placements list per positional argument"),
    (lambda: _local_map([None]), dist.LocalMapError, r"output 0 is an array; give it placements"),
    (lambda: _local_map([None], True, **_IN), dist.LocalMapError, r"output 0 is an array"),
])
def test_local_map_placements_that_are_not_one_placements_list_per_output(call, error, match):
    _raises(error, match, call)
    np.testing.assert_array_equal(_local_map([["S(0)", "R"]]).numpy(), np.full((8, 8), 2.0))


@pytest.mark.parametrize("call, error, match", [
    (lambda: dist.save_state_dict({"w": np.ones(4)}, 3), dist.CheckpointError,
     r"save_state_dict: path is 3 of type int, not a directory name: pass a str or pathlib.Path"),
    (lambda: dist.load_state_dict({"w": np.ones(4)}, None), dist.CheckpointError,
     r"load_state_dict: path is None of type NoneType"),
    (lambda: dist.shard_layer({"w": np.ones((8, 4))}, MESH, 3), dist.ParallelizeError,
     r"shard_layer: shard_fn is 3 of type int, not a function: pass None or a function "
     r"shard_fn\(name, sublayer, mesh\)"),
    (lambda: dist.shard_layer({"w": np.ones((8, 4))}, MESH, None, "shard"), dist.ParallelizeError,
     r"shard_layer: input_fn is 'shard' of type str.*input_fn\(inputs, mesh\)"),
    (lambda: dist.ProcessMesh([0, 1], dim_names=[""]), dist.MeshError,
     r"dim_names \[''\] has an empty name"),
    (lambda: dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", " "]), dist.MeshError,
     r"has an empty name"),
    (lambda: dist.ProcessMesh(3), dist.MeshError,
     r"the mesh 3 is a single number, not a list of device ids: write dist.ProcessMesh\(\[0, 1, "
     r"2\]\) for 3 devices"),
    (lambda: dist.ProcessMesh(np.int64(2), ["x"]), dist.MeshError, r"is a single number"),
])
def test_checkpoint_paths_shard_layer_functions_and_meshes_of_the_wrong_kind(call, error, match):
    _raises(error, match, call)


def _apply(params, x):
    return x @ params["w"]


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _dist_model(loss_fn=_mse, strategy=None):
    import optax

    params = {"w": dist.shard_tensor(np.ones((8, 4), np.float32), MESH, ["R", "R"])}
    return dist.to_static((_apply, params), None, loss_fn, optax.sgd(0.1), strategy)


_BATCH = (np.ones((8, 8), np.float32), np.zeros((8, 4), np.float32))


@pytest.mark.parametrize("call, error, match", [
    (lambda: _dist_model(strategy="dp"), dist.StrategyError,
     r"to_static: strategy is 'dp' of type str: pass dist.Strategy\(\{'sharding'"),
    (lambda: _dist_model(strategy={"shardin": {}}), dist.StrategyError,
     r"unknown strategy sections \['shardin'\]"),
    (lambda: _dist_model("mse"), dist.DistModelError,
     r"to_static: loss_fn is 'mse' of type str, not a function: pass a function "
     r"loss_fn\(output, label\)"),
    (lambda: _dist_model(lambda out: out.mean())(*_BATCH), dist.DistModelError,
     r"loss_fn <lambda>\(out\) cannot be called as loss_fn\(output, label\).*the batch has 2 "
     r"elements, the model's input\(s\) and then the label"),
    (lambda: _dist_model(lambda out, y, mask: out.mean())(*_BATCH), dist.DistModelError,
     r"loss_fn <lambda>\(out, y, mask\) cannot be called.*passes one label"),
    (lambda: _dist_model()(_BATCH[0]), dist.DistModelError,
     r"loss_fn _mse\(out, y\) cannot be called as loss_fn\(output\) \(missing a required "
     r"argument: 'y'\): loss_fn needs a label.*call dist_model\(inputs, label\)"),
    (lambda: _dist_model().eval()(_BATCH[0]), dist.DistModelError, r"loss_fn needs a label"),
    (lambda: _dist_model().program_args("trainn", *_BATCH), dist.DistModelError,
     r"program_args\('trainn'\): there is no program 'trainn' \(did you mean 'train'\?\); the "
     r"programs are \['train', 'accumulate', 'merge', 'eval', 'predict'\]"),
    (lambda: _dist_model().set_state_dict(3), dist.DistModelError,
     r"set_state_dict takes a dict of name -> value.*got 3 of type int"),
])
def test_to_static_arguments_of_the_wrong_kind(call, error, match):
    _raises(error, match, call)


def test_set_state_dict_refuses_values_the_model_cannot_hold_and_clashing_names():
    """numpy's cast set adam's count from 2**32 + 10 to 10 (its bias correction restarted) and
    from 2.7 to 2, silently; two params both named 'param.a.b' lost one from the state dict."""
    import optax

    params = {"w": dist.shard_tensor(np.ones((8, 4), np.float32), MESH, ["R", "R"])}
    dm = dist.to_static((_apply, params), None, _mse, optax.adam(0.1))
    count = next(k for k in dm.state_dict() if k.endswith("count"))
    for value in (np.int64(2**32 + 10), 2.7, float("nan"), None, "3"):
        _raises(dist.DistModelError, rf"set_state_dict: '{count}' is .* which int32 cannot hold "
                                     rf"exactly", lambda: dm.set_state_dict({count: value}))
    for value in (5, np.int64(6), 7.0):
        dm.set_state_dict({count: value})
        assert int(dm.state_dict()[count].numpy()) == int(value)
    w = np.ones((8, 4), np.float32)
    clash = {"a": {"b": dist.shard_tensor(w, MESH, ["R", "R"])},
             "a.b": dist.shard_tensor(w, MESH, ["R", "R"])}
    model = dist.to_static((lambda p, x: x @ p["a"]["b"] + x @ p["a.b"], clash), None, _mse,
                           optax.sgd(0.1))
    _raises(dist.DistModelError, r"both named 'param.a.b' in the state dict.*rename the key",
            model.state_dict)


def test_to_static_takes_a_strategy_dict_and_trains_as_with_a_strategy():
    losses = []
    for strategy in ({"gradient_merge": {"enable": True, "k_steps": 2}},
                     dist.Strategy({"gradient_merge": {"enable": True, "k_steps": 2}})):
        dm = _dist_model(strategy=strategy)
        assert dm.k_steps == 2
        losses.append([float(dm(*_BATCH).numpy()) for _ in range(3)])
    assert losses[0] == losses[1]
