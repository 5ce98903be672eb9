"""autoshard: Paddle-style auto-parallel for JAX.

    import autoshard as dist
    mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
    w = dist.shard_tensor(w, mesh, [dist.Replicate(), dist.Shard(1)])
"""
from .calibrate import calibrate_cost_model
from .compiler.jit import DistributedFunction, jit
from .compiler.constraints import IgnoredConstraintWarning
from .compiler.plan import FallbackWarning, Plan
from .uneven import UnevenShardingWarning
from .cost_model import CostModel, default_cost_model, set_default_cost_model
from .creation import (dtensor_from_fn, dtensor_from_local, dtensor_to_local, offload,
                       shard_tensor, unshard_dtensor)
from .display import placement_table
from .dtensor import DistTensor, StorageViewWarning
from . import eager  # noqa: F401  (importing it installs DistTensor's operators)
from .errors import (AutoshardError, CostModelError, DeviceNotFoundError, LocalDataError, MeshError,
                     MeshMismatchError, OperandError, PlacementError, PlacementTypeError,
                     ReshardError, ShardingError, SignatureError, TransformationError)
from .layout import Layout
from .local_map import LocalMapError, get_rank, local_map
from .ring_attention import ring_attention, ring_attention_fn, zigzag_indices
from .associative_scan import ScanBlocksError, associative_scan
from .mesh import ProcessMesh, get_mesh, set_mesh
from . import auto_parallel  # noqa: F401  (Paddle's dist.auto_parallel.set_mesh path)
from .placement import Partial, Placement, ReduceType, Replicate, Shard, parse_placement
from .reshard import PlannedStep, ReshardPlan, plan_reshard, reshard
from .rules import Rule, register_rule
from .training.checkpoint import CheckpointError, load_state_dict, save_state_dict
from .training.dataloader import BatchSplitError, DataloaderError, ShardDataloader, shard_dataloader
from .training.dist_model import DistModel, DistModelError, to_static
from .training.annotations import AnnotationError
from .training.layers import (ColWiseParallel, ContextParallel, ParallelizeError,
                              PrepareContextParallel, PrepareLayerInput,
                              PrepareLayerOutput, RowWiseParallel, SequenceParallelBegin,
                              SequenceParallelDisable, SequenceParallelEnable,
                              SequenceParallelEnd, parallelize, shard_layer)
from .training.local_layer import LocalLayer
from .training.optimizer import (OptimizerError, ShardedOptimizer, ShardingStage1, ShardingStage2,
                                 ShardingStage3, shard_optimizer)
from .parallel_env import ParallelEnvError, init_parallel_env
from .training.pipeline import PipelineRunner
from .training.pipeline_split import SplitPoint
from .training.schedule import Schedule, ScheduleError
from .training.stages import Stage, StageError, StageRunner
from .training.strategy import Strategy, StrategyError

__version__ = "0.1.0"

__all__ = [
    "set_mesh", "get_mesh", "auto_parallel",
    "local_map", "get_rank", "LocalMapError", "LocalLayer", "ring_attention", "ring_attention_fn", "zigzag_indices",
    "associative_scan", "ScanBlocksError",
    "ProcessMesh", "Placement", "Replicate", "Shard", "Partial", "ReduceType", "parse_placement",
    "DistTensor", "shard_tensor", "dtensor_from_fn", "dtensor_from_local", "dtensor_to_local", "offload", "unshard_dtensor",
    "reshard", "plan_reshard", "ReshardPlan", "PlannedStep", "CostModel", "default_cost_model",
    "set_default_cost_model", "calibrate_cost_model", "Layout", "placement_table", "jit",
    "DistributedFunction", "Plan",
    "SignatureError", "OperandError", "FallbackWarning", "UnevenShardingWarning", "StorageViewWarning", "IgnoredConstraintWarning", "register_rule", "Rule", "MeshMismatchError",
    "shard_dataloader", "ShardDataloader", "DataloaderError", "BatchSplitError",
    "to_static", "DistModel", "DistModelError", "shard_optimizer", "ShardedOptimizer",
    "ShardingStage1", "ShardingStage2", "ShardingStage3", "OptimizerError", "Strategy",
    "StrategyError", "Stage", "StageRunner", "StageError", "PipelineRunner", "Schedule", "init_parallel_env", "ParallelEnvError",
    "ScheduleError", "shard_layer", "parallelize", "SplitPoint",
    "ColWiseParallel", "RowWiseParallel",
    "SequenceParallelBegin", "SequenceParallelEnd", "ContextParallel", "PrepareContextParallel", "SequenceParallelEnable",
    "SequenceParallelDisable", "PrepareLayerInput", "PrepareLayerOutput",
    "ParallelizeError", "AnnotationError", "save_state_dict", "load_state_dict", "CheckpointError",
    "AutoshardError", "CostModelError", "MeshError", "DeviceNotFoundError", "PlacementError", "PlacementTypeError",
    "ShardingError", "ReshardError", "LocalDataError", "TransformationError",
]
