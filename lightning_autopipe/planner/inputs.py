"""The checks :func:`~.search.make_plan` runs on a request before any search: bad input is
refused at the boundary with an error that names the fix, not found later as a failed
search or an impossible plan."""

from __future__ import annotations

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import ClusterError, PlanError
from lightning_autopipe.profile import Profile

__all__ = ["check_inputs"]


def check_inputs(
    profile: Profile,
    cluster: Cluster,
    batch: int,
    devices: list[str] | None,
    num_stages: int | None,
    replicas: int | None,
    m: int | None,
    k: int | None,
    use_all: bool,
    j: int | None = None,
) -> list[str]:
    """The device names to plan for (``devices`` or every device of ``cluster``), once the
    request is one that a plan can answer; otherwise the error naming what to change."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PlanError(f"global_batch_size must be a positive integer, got {batch!r}")
    for name, v in (("num_stages", num_stages), ("replicas", replicas),
                    ("num_microbatches", m), ("startup_slices", k), ("drain_slices", j)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise PlanError(f"{name} must be a positive integer or None, got {v!r}")
    devs = [d.name for d in cluster.devices] if devices is None else list(devices)
    for d in devs:
        cluster.device(d)  # ClusterError naming the bad device
    if len(set(devs)) != len(devs):
        raise ClusterError(f"device list {devs} names a device twice")
    if not devs:
        raise ClusterError("no devices to plan for; pass at least one device name")
    n, nd = len(profile.blocks), len(devs)
    if num_stages is not None and num_stages > n:
        raise PlanError(
            f"cannot split {n} blocks of {profile.model!r} into {num_stages} stages; use at most "
            f"{n} stages (or profile the model at a finer block granularity)"
        )
    need = (num_stages or 1) * (replicas or 1)
    if need > nd:
        raise ClusterError(
            f"{num_stages or 1} stages x {replicas or 1} replicas need {need} devices but only "
            f"{nd} are available ({cluster.name!r}); use fewer stages or replicas, or add devices"
        )
    if use_all and num_stages and replicas and need != nd:
        raise PlanError(
            f"use_all_devices needs stages x replicas == {nd} devices, but {num_stages} x "
            f"{replicas} = {need}; pin a shape whose product is {nd}"
        )
    r = replicas or 1
    if batch % r:
        raise PlanError(
            f"global batch {batch} is not divisible into {r} replicas; use a multiple of {r}"
        )
    if m is not None and batch % (r * m):
        ok = [x for x in range(1, batch // r + 1) if (batch // r) % x == 0]
        raise PlanError(
            f"global batch {batch} is not divisible into {r} replicas x {m} micro-batches "
            f"= {r * m}; use a batch that is a multiple of {r * m}, or num_microbatches in "
            f"{ok[:12]}"
        )
    if k is not None and m is not None and k > batch // (r * m):
        raise PlanError(
            f"cannot split a micro-batch of {batch // (r * m)} samples into {k} startup slices;"
            f" use startup_slices <= {batch // (r * m)} or fewer micro-batches"
        )
    if j is not None and m is not None and m >= 2 and j > batch // (r * m):
        raise PlanError(
            f"cannot split a micro-batch of {batch // (r * m)} samples into {j} drain slices;"
            f" use drain_slices <= {batch // (r * m)} or fewer micro-batches"
        )
    return devs
