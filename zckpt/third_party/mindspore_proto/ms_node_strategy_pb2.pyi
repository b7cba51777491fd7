from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ParallelStrategy(_message.Message):
    __slots__ = ("dim",)
    DIM_FIELD_NUMBER: _ClassVar[int]
    dim: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dim: _Optional[_Iterable[int]] = ...) -> None: ...

class ParallelStrategys(_message.Message):
    __slots__ = ("stage", "parallel_strategy")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    stage: int
    parallel_strategy: _containers.RepeatedCompositeFieldContainer[ParallelStrategy]
    def __init__(self, stage: _Optional[int] = ..., parallel_strategy: _Optional[_Iterable[_Union[ParallelStrategy, _Mapping]]] = ...) -> None: ...

class ParallelStrategyItem(_message.Message):
    __slots__ = ("node_name", "parallel_strategys")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_STRATEGYS_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    parallel_strategys: ParallelStrategys
    def __init__(self, node_name: _Optional[str] = ..., parallel_strategys: _Optional[_Union[ParallelStrategys, _Mapping]] = ...) -> None: ...

class DevMatrix(_message.Message):
    __slots__ = ("dim",)
    DIM_FIELD_NUMBER: _ClassVar[int]
    dim: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dim: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorMap(_message.Message):
    __slots__ = ("dim",)
    DIM_FIELD_NUMBER: _ClassVar[int]
    dim: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dim: _Optional[_Iterable[int]] = ...) -> None: ...

class ParamSplitShape(_message.Message):
    __slots__ = ("dim",)
    DIM_FIELD_NUMBER: _ClassVar[int]
    dim: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dim: _Optional[_Iterable[int]] = ...) -> None: ...

class IndicesOffset(_message.Message):
    __slots__ = ("dim",)
    DIM_FIELD_NUMBER: _ClassVar[int]
    dim: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dim: _Optional[_Iterable[int]] = ...) -> None: ...

class ParallelLayouts(_message.Message):
    __slots__ = ("dev_matrix", "tensor_map", "param_split_shape", "indices_offset", "field", "opt_weight_shard_step", "opt_weight_shard_size")
    DEV_MATRIX_FIELD_NUMBER: _ClassVar[int]
    TENSOR_MAP_FIELD_NUMBER: _ClassVar[int]
    PARAM_SPLIT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    INDICES_OFFSET_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    OPT_WEIGHT_SHARD_STEP_FIELD_NUMBER: _ClassVar[int]
    OPT_WEIGHT_SHARD_SIZE_FIELD_NUMBER: _ClassVar[int]
    dev_matrix: _containers.RepeatedCompositeFieldContainer[DevMatrix]
    tensor_map: _containers.RepeatedCompositeFieldContainer[TensorMap]
    param_split_shape: _containers.RepeatedCompositeFieldContainer[ParamSplitShape]
    indices_offset: _containers.RepeatedCompositeFieldContainer[IndicesOffset]
    field: int
    opt_weight_shard_step: int
    opt_weight_shard_size: int
    def __init__(self, dev_matrix: _Optional[_Iterable[_Union[DevMatrix, _Mapping]]] = ..., tensor_map: _Optional[_Iterable[_Union[TensorMap, _Mapping]]] = ..., param_split_shape: _Optional[_Iterable[_Union[ParamSplitShape, _Mapping]]] = ..., indices_offset: _Optional[_Iterable[_Union[IndicesOffset, _Mapping]]] = ..., field: _Optional[int] = ..., opt_weight_shard_step: _Optional[int] = ..., opt_weight_shard_size: _Optional[int] = ...) -> None: ...

class ParallelLayoutItem(_message.Message):
    __slots__ = ("param_name", "parallel_layouts")
    PARAM_NAME_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    param_name: str
    parallel_layouts: ParallelLayouts
    def __init__(self, param_name: _Optional[str] = ..., parallel_layouts: _Optional[_Union[ParallelLayouts, _Mapping]] = ...) -> None: ...

class ParallelGroupRanks(_message.Message):
    __slots__ = ("dim",)
    DIM_FIELD_NUMBER: _ClassVar[int]
    dim: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dim: _Optional[_Iterable[int]] = ...) -> None: ...

class ParallelGroupItem(_message.Message):
    __slots__ = ("group_name", "parallel_group_ranks")
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_GROUP_RANKS_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    parallel_group_ranks: ParallelGroupRanks
    def __init__(self, group_name: _Optional[str] = ..., parallel_group_ranks: _Optional[_Union[ParallelGroupRanks, _Mapping]] = ...) -> None: ...

class ParallelGroupMap(_message.Message):
    __slots__ = ("parallel_group_item", "ckpt_restore_rank_list")
    PARALLEL_GROUP_ITEM_FIELD_NUMBER: _ClassVar[int]
    CKPT_RESTORE_RANK_LIST_FIELD_NUMBER: _ClassVar[int]
    parallel_group_item: _containers.RepeatedCompositeFieldContainer[ParallelGroupItem]
    ckpt_restore_rank_list: ParallelGroupRanks
    def __init__(self, parallel_group_item: _Optional[_Iterable[_Union[ParallelGroupItem, _Mapping]]] = ..., ckpt_restore_rank_list: _Optional[_Union[ParallelGroupRanks, _Mapping]] = ...) -> None: ...

class ParallelStrategyMap(_message.Message):
    __slots__ = ("current_stage", "parallel_strategy_item", "parallel_layout_item")
    CURRENT_STAGE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_STRATEGY_ITEM_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_LAYOUT_ITEM_FIELD_NUMBER: _ClassVar[int]
    current_stage: int
    parallel_strategy_item: _containers.RepeatedCompositeFieldContainer[ParallelStrategyItem]
    parallel_layout_item: _containers.RepeatedCompositeFieldContainer[ParallelLayoutItem]
    def __init__(self, current_stage: _Optional[int] = ..., parallel_strategy_item: _Optional[_Iterable[_Union[ParallelStrategyItem, _Mapping]]] = ..., parallel_layout_item: _Optional[_Iterable[_Union[ParallelLayoutItem, _Mapping]]] = ...) -> None: ...
