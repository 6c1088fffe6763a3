"""Scheduling: requests, the step-time cost model, round policies and the scheduler."""
from scheduler.batch import Batch, Chunk, StepOutput
from scheduler.cost import BatchShape, CostModel
from scheduler.policy import POLICIES, LinearSlo, PolicyConfig
from scheduler.request import Req, Status
from scheduler.scheduler import Scheduler

__all__ = ["Batch", "BatchShape", "Chunk", "CostModel", "LinearSlo", "POLICIES", "PolicyConfig", "Req",
           "Scheduler", "Status", "StepOutput"]
