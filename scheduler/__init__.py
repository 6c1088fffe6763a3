"""Scheduling: requests, the step-time cost model, round policies and the scheduler."""
from scheduler.batch import Batch, Chunk, Executor, StepOutput
from scheduler.config import SchedulerConfig
from scheduler.cost import BatchShape, CostModel, Drift
from scheduler.policy import LinearSlo, SchedulingPolicy, policy_class, policy_names, register
from scheduler.request import Req, Status
from scheduler.scheduler import Scheduler

__all__ = ["Batch", "BatchShape", "Chunk", "CostModel", "Drift", "Executor", "LinearSlo", "Req", "Scheduler",
           "SchedulerConfig", "SchedulingPolicy", "Status", "StepOutput", "policy_class", "policy_names",
           "register"]
