"""How one training step is cut: the one value every price of a candidate is taken under.

The fast model (:func:`~.costmodel.evaluate`), its lower bound (:func:`~.bound.bound_batch`),
the chunked model (:func:`~.vcost.evaluate_chunked`) and the memory limits of the balanced
partition (:func:`~.partition.stage_limits`) price a candidate's cuts and layout under the
same six figures: the global batch, the micro-batches per replica, the slices of the first
and of the last micro-batch, the schedule and the optimizer's memory factor. The mapper, the
partitioner, the slicers and the search hand them down unchanged (a slicer varies one slice
count), so they travel as one frozen value: each signature names it once, each caller builds
it once, and the fast model's memo (:mod:`~.memo`) keys on it.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

__all__ = ["StepShape"]


@dataclass(frozen=True, slots=True)
class StepShape:
    """How one training step is cut (module docstring).

    ``batch`` samples per step over every replica; ``num_microbatches`` micro-batches per
    replica; micro-batch 0 runs in ``startup_slices`` even slices and, with two or more
    micro-batches, the last one in ``drain_slices`` (1 = whole); ``schedule`` names the
    generator (:mod:`~.generators`); ``optimizer_factor`` is the optimizer state's bytes per
    parameter byte (:func:`~.pricing.param_state_factor`). The user's values are checked where
    the user gives them (:func:`~.search.make_plan`), not here: the searches build many.
    """

    batch: int
    num_microbatches: int
    startup_slices: int = 1
    _: KW_ONLY
    drain_slices: int = 1
    schedule: str = "1f1b"
    optimizer_factor: float = 2.0

    def microbatch_size(self, replicas: int) -> int:
        """Samples of one micro-batch on each of ``replicas`` data-parallel replicas (rounded
        down: 0 when the batch cannot give every micro-batch a sample)."""
        return self.batch // (self.num_microbatches * replicas)
