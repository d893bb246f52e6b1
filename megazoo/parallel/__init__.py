"""Parallel layout: sizes (`ParallelConfig`), process groups (`ParallelState`), rank math."""
from .config import ParallelConfig
from .mpu import DeepSpeedMPU
from .ranks import coordinates, embedding_groups, rank_groups
from .state import GroupInfo, ParallelState

__all__ = ["ParallelConfig", "ParallelState", "GroupInfo", "DeepSpeedMPU",
           "rank_groups", "coordinates", "embedding_groups"]
