"""``AutoPipeOptions``: every option of ``AutoPipeStrategy``, its default and its check, once.

The strategy takes these fields as keyword arguments (or a ready object), the Hydra schema
``config.AutoPipeStrategyConfig`` is generated from them, and the runtime reads them, so adding
an option is one field here. Plain data: no Lightning, and torch only to check a
granularity other than the default.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import OptionError, PlanError
from lightning_autopipe.planner.compiled import splits_backward
from lightning_autopipe.planner.generators import AUTO_SCHEDULES, GENERATORS, SCHEDULES
from lightning_autopipe.planner.plan import Plan

__all__ = ["AutoPipeOptions", "CHECKPOINT_FORMATS", "NONFINITE_LOSS", "REPLAN", "SPLIT_BACKENDS",
           "START_METHODS"]

START_METHODS = ("popen", "spawn", "fork", "forkserver")
CHECKPOINT_FORMATS = ("consolidated", "sharded")
NONFINITE_LOSS = ("raise", "skip")
REPLAN = ("auto", "off")
SPLIT_BACKENDS = ("inductor", "aot_eager")
"""``torch.compile`` backends whose backward the runtime can split for zero-bubble schedules
(:mod:`~lightning_autopipe.runtime.compiled_split`)."""
_PINS = ("num_stages", "num_microbatches", "startup_slices", "drain_slices")


@dataclass(frozen=True)
class AutoPipeOptions:
    """What ``AutoPipeStrategy`` is asked to do; checked when built (the errors name the fix).

    Fields keep the values given (``"auto"`` stays ``"auto"``), except that ``timeout`` becomes
    seconds, ``profile_repeats`` an int, ``bucket_mb`` a float and the two flags bools;
    :attr:`pins`, :attr:`timeout_delta` and :attr:`bucket_bytes` are the forms the planner and
    the runtime take.
    """

    cluster: Cluster | str | Path | None = None
    """A ``Cluster``, a cluster YAML path, or None: discover it from the launched ranks
    (hosts, devices, each rank's measured profile and links; written to the run directory as
    ``autopipe/cluster.yaml``)."""

    planner: str = "autopipe"
    """Planner name handed to ``make_plan`` (``"autopipe"`` or a yardstick: ``"dapple"``...)."""

    num_stages: int | str | None = "auto"
    """Pipeline depth, or ``"auto"``: every depth dividing the world is planned and the one
    with the most samples/s wins."""

    num_microbatches: int | str | None = "auto"
    """Micro-batches per replica and step, or ``"auto"``."""

    startup_slices: int | str | None = "auto"
    """Slices micro-batch 0 is cut into (a shorter fill), or ``"auto"``."""

    drain_slices: int | str | None = "auto"
    """Slices the last micro-batch is cut into (a shorter cool-down), or ``"auto"``."""

    schedule: str = "auto"
    """``"auto"`` (the planner picks among 1F1B, zero-bubble ZB-H1 and, with several stage
    chunks per rank when ``replan="off"`` (:attr:`schedules` says why), interleaved 1F1B and
    ZB-V, whichever it predicts fastest within memory, the runtime's measured cost per action
    included) or one schedule: ``"1f1b"``, ``"zb-h1"``, ``"gpipe"``, ``"interleaved-1f1b"``
    or ``"zbv"``."""

    granularity: str = "sub-block"
    """Block granularity of ``split_model`` (``"sub-block"`` or ``"layer"``)."""

    plan: Plan | str | Path | None = None
    """A ``Plan`` or the path of one saved with ``Plan.save``: no profiling, no planning."""

    timeout: float | timedelta = 120.0
    """Seconds (or a ``timedelta``) for the process group and every sub-group, so a failed
    peer ends the run instead of hanging it."""

    start_method: str = "popen"
    """``"popen"`` (Lightning re-runs the script per rank) or ``"spawn"`` / ``"fork"`` /
    ``"forkserver"`` (multiprocessing)."""

    profile_repeats: int = 3
    """Timed repeats per block when profiling (the median is kept)."""

    val_loss_name: str = "val_loss"
    """Name the validation pipeline's loss is logged under."""

    test_loss_name: str = "test_loss"
    """Name the test pipeline's loss is logged under."""

    bucket_mb: float = 25.0
    """Size of the flat buffers gradients are all-reduced in, in MiB."""

    process_group_backend: str | None = None
    """``torch.distributed`` backend; None picks gloo on the CPU, NCCL on CUDA."""

    checkpoint_format: str = "consolidated"
    """``"consolidated"`` (one file, rank 0 gathers every stage) or ``"sharded"`` (a
    ``torch.distributed.checkpoint`` directory, one shard per stage, for large models)."""

    nonfinite_loss: str = "raise"
    """``"raise"`` (stop, naming the step and the stage where values first became
    non-finite) or ``"skip"`` (warn and drop that step's gradients on every rank; the
    optimizer and LR scheduler still step, moving no parameter)."""

    exact_cluster: bool = False
    """The cluster file must describe exactly the launched devices (not more)."""

    check_batch: bool = True
    """Every tensor of a batch must hold as many samples as the inputs, and every stage of a
    replica the same labels / ids (a digest compared each step); False hands a non-per-sample
    tensor (e.g. class weights) to ``pipeline_loss`` whole and skips both checks."""

    balance_replicas: bool = True
    """Data-parallel replicas of unlike speed train uneven shares of the global batch (a slow
    replica fewer samples) when the planner predicts it faster; the runtime all-gathers the
    replicas' per-sample tensors each step to deal them (:mod:`~lightning_autopipe.runtime.
    replica_share`), so batches must have one shape on every replica. False: even shares."""

    compile: bool | str = False
    """``torch.compile`` each local stage once, its batch dimension dynamic, so slices and
    short batches reuse the one graph (:mod:`~lightning_autopipe.runtime.compiled_stage`):
    True compiles with inductor, a string names another backend (``"aot_eager"``...). The
    profile is corrected to the compiled speed. Zero-bubble schedules need the compiled
    backward cut into input- and weight-gradient graphs, which the backends in
    ``SPLIT_BACKENDS`` allow; with another backend ``schedule="auto"`` plans 1F1B or
    interleaved 1F1B and ``"zb-h1"`` and ``"zbv"`` are refused."""

    replan: str = "auto"
    """``"auto"``: every rank's speed is measured from its training steps and the run may
    switch to a plan made for the measured speeds when one is predicted faster by more than
    ``replan_threshold``, the switch's cost counted; ``"off"``: the plan made at the start
    stays (the speeds are still measured and logged)."""

    replan_threshold: float = 0.1
    """The gain a new plan must be predicted to bring, as a fraction of the measured step
    (0.1: at least 10% faster per sample), after its switch cost spread over the remaining
    steps."""

    replan_window: int = 10
    """Training steps each rank's measured speed is taken over (their median, so one slow step
    does not trigger a switch), and the steps between two checks; a plan's first step is kept
    out of the window (see ``runtime.monitor.WARMUP_STEPS``)."""

    replan_min_steps: int = 50
    """Training steps at least between two switches (and before the first)."""

    optimizer_state: float | str = "auto"
    """Bytes of optimizer state per parameter byte that the planner counts in each stage's
    memory (Adam 2, SGD with momentum 1, plain SGD 0), or ``"auto"``: measured from the
    module's ``configure_optimizers`` before planning (each optimizer made again on a probe
    tensor and stepped once), 2 where that cannot be done."""

    def __post_init__(self) -> None:
        if self.start_method not in START_METHODS:
            raise OptionError(
                f"start_method must be 'popen', 'spawn', 'fork' or 'forkserver', not "
                f"{self.start_method!r}"
            )
        for name in _PINS:
            _auto_or_positive(name, getattr(self, name))
        if self.schedule != "auto" and self.schedule not in GENERATORS:
            raise OptionError(
                f"schedule must be 'auto' or one of {sorted(GENERATORS)}, not {self.schedule!r}"
            )
        timeout = self.timeout
        try:
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        except (TypeError, ValueError):
            seconds = float("nan")
        if not seconds > 0:
            raise OptionError(f"timeout must be positive seconds, got {timeout!r}")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise OptionError(
                f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, not "
                f"{self.checkpoint_format!r}"
            )
        if self.nonfinite_loss not in NONFINITE_LOSS:
            raise OptionError(
                f"nonfinite_loss must be one of {NONFINITE_LOSS}, not {self.nonfinite_loss!r}"
            )
        if isinstance(self.compile, str) and not self.compile.strip():
            raise OptionError("compile must be True, False or a torch.compile backend name, "
                             "not an empty string")
        if not isinstance(self.compile, bool | str):
            raise OptionError(f"compile must be True, False or a torch.compile backend name "
                             f"(e.g. 'inductor'), not {self.compile!r}")
        if (self.compile and self.schedule != "auto" and splits_backward(self.schedule)
                and self.compile_backend not in SPLIT_BACKENDS):
            raise OptionError(
                f"compile={self.compile!r} with schedule={self.schedule!r}: a stage compiled "
                f"with {self.compile_backend!r} computes input and weight gradients in one "
                "graph, so its backward cannot be split as zero-bubble schedules need; compile "
                f"with one of {SPLIT_BACKENDS}, use schedule='auto' (plans 1F1B or "
                "interleaved 1F1B for this backend), '1f1b' or 'interleaved-1f1b', or "
                "compile=False"
            )
        _check_replan(self)
        _check_optimizer_state(self.optimizer_state)
        _check_choices(self)
        for name, value in (
            ("replan_threshold", float(self.replan_threshold)),
            ("timeout", seconds),
            ("profile_repeats", int(self.profile_repeats)),
            ("bucket_mb", float(self.bucket_mb)),
            ("exact_cluster", bool(self.exact_cluster)),
            ("check_batch", bool(self.check_batch)),
            ("balance_replicas", bool(self.balance_replicas)),
        ):
            object.__setattr__(self, name, value)

    @classmethod
    def build(
        cls, options: AutoPipeOptions | None = None, overrides: Mapping[str, Any] | None = None
    ) -> AutoPipeOptions:
        """``options`` (default: the defaults) with the keyword ``overrides`` applied, checked.

        Raises:
            TypeError: an override names no option (the message lists the close ones).
        """
        base = cls() if options is None else options
        if not isinstance(base, AutoPipeOptions):
            raise TypeError(
                f"options must be an AutoPipeOptions, got {type(base).__name__}; pass the "
                "strategy's options as keyword arguments (AutoPipeStrategy(num_stages=2, ...)) "
                "or as AutoPipeStrategy(AutoPipeOptions(...))"
            )
        overrides = dict(overrides or {})
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            hints = {u: difflib.get_close_matches(u, names, n=1) for u in unknown}
            close = ", ".join(f"{u!r} -> {h[0]!r}" for u, h in hints.items() if h)
            raise TypeError(
                f"AutoPipeStrategy got unknown options {unknown}"
                + (f" (did you mean {close}?)" if close else "")
                + f"; the options are {names}"
            )
        return replace(base, **overrides) if overrides else base

    def given_plan(self) -> Plan | None:
        """The ``plan`` option as a :class:`Plan` (read from its file), or None: plan at start."""
        if self.plan is None or isinstance(self.plan, Plan):
            return self.plan
        if not Path(self.plan).is_file():
            raise OptionError(
                f"plan={str(self.plan)!r}: no such file; give a plan.json a run or the plan "
                "CLI wrote (python -m lightning_autopipe plan ... --out plan.json), or drop "
                "`plan` to plan at start"
            )
        return Plan.load(self.plan)

    @property
    def optimizer_factor(self) -> float:
        """``optimizer_state`` as the planner counts it: the number, or 2 (Adam) while it is
        still ``"auto"`` (nothing measured it)."""
        return 2.0 if self.optimizer_state == "auto" else float(self.optimizer_state)

    @property
    def pins(self) -> dict[str, int | None]:
        """The four plan counts as the planner takes them: an int, or None for ``"auto"``."""
        return {name: _auto_or_positive(name, getattr(self, name)) for name in _PINS}

    @property
    def schedules(self) -> tuple[str, ...]:
        """The schedules the planner may choose among: the pinned one, or for ``"auto"``
        :data:`~lightning_autopipe.planner.generators.AUTO_SCHEDULES` (a compile backend whose
        backward cannot be split: those that do not split it, 1F1B and interleaved 1F1B).

        With ``replan="auto"`` (the default), ``"auto"`` keeps to one stage chunk per rank,
        and re-planning with it: a switch expects the measured step times the two plans'
        predicted ratio, which cancels the prediction error the two plans share, and on CPU
        ranks a chunked plan's many messages wait longer than the measured link prices
        (docs/limits.md), an error a one-chunk plan does not share: such a loop would switch to
        a chunked plan on its prediction and never measure its way back. With a chunked
        schedule named, the plan and every re-plan are chunked (live re-planning moves one
        chunked layout to another); with ``replan="off"``, ``"auto"`` plans chunks too."""
        if self.schedule != "auto":
            return (self.schedule,)
        backend = self.compile_backend
        schedules = AUTO_SCHEDULES
        if backend and backend not in SPLIT_BACKENDS:
            schedules = tuple(s for s in schedules if not splits_backward(s))
        if self.replan != "off":
            schedules = tuple(s for s in schedules if s in SCHEDULES)
        return schedules

    @property
    def compile_backend(self) -> str | None:
        """The ``torch.compile`` backend of ``compile`` (None: stages run eagerly)."""
        if self.compile is False:
            return None
        return "inductor" if self.compile is True else str(self.compile)

    @property
    def timeout_delta(self) -> timedelta:
        """``timeout`` as the ``timedelta`` torch.distributed takes."""
        return timedelta(seconds=float(self.timeout))

    @property
    def bucket_bytes(self) -> int:
        """``bucket_mb`` in bytes."""
        return int(self.bucket_mb * 2**20)


def _check_choices(options: AutoPipeOptions) -> None:
    """The planner, the granularity, the repeats and the bucket size, checked when the options
    are made: a run found them only after profiling on every rank (and a negative bucket size
    silently all-reduced each parameter on its own). The compile backend's name needs torch:
    :func:`~lightning_autopipe.runtime.compiled_stage.check_backend`."""
    from lightning_autopipe.planner.search import PLANNERS

    checks = [("planner", options.planner, PLANNERS)]
    if options.granularity != "sub-block":  # the default: no torch import to know it
        from lightning_autopipe.graph.cuts import GRANULARITIES

        checks.append(("granularity", options.granularity, GRANULARITIES))
    for name, value, known in checks:
        if value not in known:
            close = difflib.get_close_matches(str(value), known, n=1)
            raise OptionError(f"{name} must be one of {list(known)}, not {value!r}"
                              + (f" (did you mean {close[0]!r}?)" if close else ""))
    repeats = options.profile_repeats
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise OptionError(f"profile_repeats must be a positive integer, got {repeats!r}")
    try:
        bucket = float(options.bucket_mb)
    except (TypeError, ValueError):
        bucket = float("nan")
    if not bucket > 0 or bucket == float("inf"):
        raise OptionError(f"bucket_mb must be a positive number of MiB, got {options.bucket_mb!r}")


def _check_optimizer_state(value: Any) -> None:
    if value == "auto":
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
    if not ok:  # NaN fails ``value >= 0`` too
        raise OptionError(
            f"optimizer_state must be 'auto' or the bytes of optimizer state per parameter byte "
            f"(Adam 2, SGD with momentum 1, plain SGD 0), not {value!r}")


def _check_replan(o: AutoPipeOptions) -> None:
    if o.replan not in REPLAN:
        raise OptionError(f"replan must be one of {REPLAN}, not {o.replan!r}")
    t = o.replan_threshold
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < 1:
        raise OptionError(
            f"replan_threshold must be a fraction in [0, 1) of the measured step (0.1: a new "
            f"plan must be predicted 10% faster), not {t!r}"
        )
    for name in ("replan_window", "replan_min_steps"):
        value = getattr(o, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OptionError(f"{name} must be a positive number of training steps, not "
                             f"{value!r}")


def _auto_or_positive(name: str, value: Any) -> int | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name} must be 'auto' or a positive int, got {value!r}")
    return value
