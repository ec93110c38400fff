"""The whole training step as CUDA graphs: :func:`graph_train_step`.

* :mod:`.step`: warmup, capture and replay of forward, backward, all-reduce, clipping
  and the optimizer step (its graphs captured by :mod:`.step_capture`, its options and
  statistics in :mod:`.records`).
* :mod:`.optimizers`: what makes an optimizer's step capturable, what the graph bakes
  in, and keeping the captured state across ``load_state_dict``.
* :mod:`.gradients`: the bucketed gradient all-reduce, captured or eager.

A thin layer beside the others: it captures through :mod:`cudagraphs.capture` and
stages batches through the program layer's fixed buffers.
"""

from .gradients import DEFAULT_BUCKET_MB, all_reduce_gradients, plan_buckets
from .optimizers import GroupPlan, compiled_optimizer_step, plan_optimizer, prepare_optimizer
from .records import TrainStepOptions, TrainStepStats
from .step import GraphedTrainStep, graph_train_step

__all__ = [
    "DEFAULT_BUCKET_MB",
    "GraphedTrainStep",
    "GroupPlan",
    "TrainStepOptions",
    "TrainStepStats",
    "all_reduce_gradients",
    "compiled_optimizer_step",
    "graph_train_step",
    "plan_buckets",
    "plan_optimizer",
    "prepare_optimizer",
]
