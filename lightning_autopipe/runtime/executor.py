"""Runs one rank's lowered action list for a training or validation step.

The executor is the runtime half of the schedule IR: it performs exactly the actions the planner
produced for this rank (``lower_communication(build_schedule(plan))[stage]``), which the
simulator replays too, and records them in :attr:`PipelineExecutor.trace` (and their
``perf_counter`` start and end in :attr:`PipelineExecutor.timeline`). Each action is run by the
:class:`~lightning_autopipe.runtime.stage_runner.StageRunner` method its kind maps to
(:func:`~lightning_autopipe.runtime.stage_runner.action_table`); how a backward is split into
``B`` and ``W`` is :mod:`~lightning_autopipe.runtime.backward`'s.

A rank may hold several chunks of the model (interleaved or V placement): ``stage`` is then a
mapping chunk -> module, each chunk runs in its own runner, an action goes to the runner of the
chunk it names, and tensors between two chunks of this rank pass without a message. The
data-parallel gradient sync covers every chunk's parameters; a parameter two local chunks
share (a tied embedding and head in V placement) is one Parameter and one gradient.

Numerics: each unit's loss on the last stage is weighted by ``unit_samples / B``, so the
gradients summed over units are those of the replica's mean loss. Averaging over the
data-parallel group then gives the gradients of the global-batch mean loss, and summing tied
copies across their stages gives what a single process would compute for the shared weight.
Under uneven replica batches a replica first takes its share of the replicas' joined batches
(:mod:`~lightning_autopipe.runtime.replica_share`) and weights its units over the even share,
the batch it loaded.

The module runs a little past ~400 lines: a step's phases (the sample exchange, units, the
action loop, the loss gather, the gradient sync) share the runners' per-step state.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_autopipe.errors import InputError, PipelineRuntimeError
from lightning_autopipe.planner.schedule import Action, Kind
from lightning_autopipe.runtime.backward import splits_backward_at
from lightning_autopipe.runtime.checks import batch_digest, check_batch_sizes, check_same_batch
from lightning_autopipe.runtime.chunks import chunk_modules
from lightning_autopipe.runtime.failure import FailureBoard, pipeline_failure
from lightning_autopipe.runtime.gradsync import GradientSync, step_gradients_only
from lightning_autopipe.runtime.groups import ProcessGroups, RankLayout, gather_by_rank
from lightning_autopipe.runtime.modes import ModeFollower
from lightning_autopipe.runtime.outbox import Outbox
from lightning_autopipe.runtime.replica_share import take_share
from lightning_autopipe.runtime.stage_runner import StageRunner, action_table, check_action
from lightning_autopipe.runtime.units import fit_units, unit_bounds

__all__ = ["PipelineExecutor", "TiedParameter"]

_COMPUTE_KINDS = (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)
_FULL = (torch.float32, torch.float64)  # gradients normed as they are (half ones in float32)


@dataclass(frozen=True)
class TiedParameter:
    """A local copy of a parameter shared with other stages (e.g. GPT's embedding / LM head).

    ``tie`` indexes the tie sets given to :func:`~lightning_autopipe.runtime.groups.build_groups`;
    ``counted`` is True on exactly one stage of the set, so the global norm counts it once.
    """

    tie: int
    param: nn.Parameter
    counted: bool


class PipelineExecutor:
    """Executes this rank's schedule for one stage of one data-parallel replica.

    Args:
        stage: the local stage module; ``stage(*tensors)`` returns a tuple of tensors. With
            several chunks per rank (``layout.chunks``): chunk index -> its module.
        layout: this rank's place in the grid.
        groups: process groups from :func:`build_groups` (None only for a 1-rank world).
        num_microbatches: micro-batches per replica and step (the plan's ``m``).
        startup_slices: slices of micro-batch 0 (the plan's ``k``).
        train_schedule: ``(m, k, j) -> lowered action list`` of this stage for a training step.
        eval_schedule: ``m -> lowered action list`` of this stage for a forward-only step.
        inputs_fn: batch -> model inputs (positional tuple or keyword dict).
        flatten_inputs: model inputs -> tuple of tensors (the first stage's inputs).
        unflatten_outputs: last stage outputs -> model-shaped output for ``loss_fn``.
        loss_fn: ``(model outputs, batch slice) -> mean loss of that slice``.
        device: where this stage runs and where received tensors are put.
        tied: local copies of parameters tied across stages.
        bucket_bytes: size of the flat buffers gradients are all-reduced in.
        failures: where this rank posts its failure and reads a peer's (see ``failure.py``).
        check_batch: every tensor of a batch must hold the inputs' sample count.
        timeout_s: the process groups' timeout (quoted in failure messages).
        drain_slices: slices of the last micro-batch (the plan's ``j``).
        memory: measures this rank's peak memory in a training step
            (:class:`~lightning_autopipe.runtime.memory.MemoryMeter`); None measures nothing.
        modes: runs each step's ``stage.train()`` / ``eval()`` keeping the user's modules'
            own modes (:class:`~lightning_autopipe.runtime.modes.ModeFollower`).

    Attributes:
        loss_scale: None, or ``loss -> scaled loss`` applied to each unit's weighted loss on
            the last stage before its backward (fp16 loss scaling: ``scaler.scale`` of a
            :class:`~lightning_autopipe.runtime.scaler.PipelineGradScaler`); every gradient
            of the step then carries the scale. The returned loss stays unscaled.
    """

    def __init__(
        self,
        stage: nn.Module | Mapping[int, nn.Module],
        layout: RankLayout,
        groups: ProcessGroups | None,
        *,
        num_microbatches: int,
        startup_slices: int,
        train_schedule: Callable[[int, int, int], list[Action]],
        eval_schedule: Callable[[int], list[Action]],
        inputs_fn: Callable[[Any], Any],
        flatten_inputs: Callable[[Any], Sequence[Tensor]],
        unflatten_outputs: Callable[[tuple[Tensor, ...]], Any],
        loss_fn: Callable[[Any, Any], Tensor],
        device: torch.device,
        tied: Sequence[TiedParameter] = (),
        bucket_bytes: int = 25 * 2**20,
        failures: FailureBoard | None = None,
        check_batch: bool = True,
        timeout_s: float | None = None,
        drain_slices: int = 1,
        memory: Any = None,
        replica_batches: Sequence[int] = (),
        modes: ModeFollower | None = None,
    ) -> None:
        if layout.world_size > 1 and groups is None:
            raise PipelineRuntimeError("a multi-rank pipeline needs its process groups")
        self.chunks = chunk_modules(stage, layout)
        self.stage = stage if isinstance(stage, nn.Module) else nn.ModuleDict(
            {str(c): mod for c, mod in self.chunks.items()})
        self.layout = layout
        self.groups = groups
        self.num_microbatches = num_microbatches
        self.startup_slices = startup_slices
        self.drain_slices = drain_slices
        self.replica_batches = list(replica_batches)  # uneven shares (:mod:`.replica_share`)
        self._train_schedule = train_schedule
        self._eval_schedule = eval_schedule
        self._inputs_fn = inputs_fn
        self._flatten = flatten_inputs
        self.device = device
        self.tied = sorted(tied, key=lambda t: t.tie)  # same all-reduce order on every rank
        self.bucket_bytes = bucket_bytes
        self.failures = failures
        self.check_batch = check_batch
        self.timeout_s = timeout_s
        self.step: int | None = None  # the caller's step number, quoted in failure messages
        self.samples = 0  # samples of the last step (its share, under uneven replica batches)
        self.replica_weight = 1.0  # those samples over the even share (the loaded batch's)
        self._training = True
        #: numbers of the caller's that every rank reports with a step's loss (:attr:`notes`):
        #: the strategy's stop request and, in training, its optimizer groups' facts
        self.report: Callable[[], Sequence[float]] | None = None
        self.notes: dict[int, tuple[float, ...]] = {}
        self._closed = False
        self.trace: list[Action] = []
        self.timeline: list[tuple[Action, float, float]] = []
        self._schedules: dict[tuple[bool, int, int, int], list[Action]] = {}
        self._params: list[nn.Parameter] = []  # trainable ones (:meth:`_follow_trainable`)
        self.memory = memory
        self.modes = modes  # the user's modules' modes onto the stage (:mod:`.modes`)
        self._runners = {
            c: StageRunner(mod, layout.chunk(c), (), loss_fn, unflatten_outputs, device, memory)
            for c, mod in self.chunks.items()
        }
        for c, runner in self._runners.items():  # neighbour chunks on this rank
            runner.local_prev = self._runners.get(c - 1) if runner.layout.prev_local else None
            runner.local_next = self._runners.get(c + 1) if runner.layout.next_local else None
        self.loss_scale: Callable[[Tensor], Tensor] | None = None
        self._dp_sync: GradientSync | None = None
        self._follow_trainable()  # the lists above and the replicas' buckets

    # ------------------------------------------------------------------------- public steps
    @property
    def parameters(self) -> list[nn.Parameter]:
        """The stage's trainable parameters (what this rank's optimizer must hold), as they
        are now (:meth:`_follow_trainable`)."""
        self._follow_trainable()
        return list(self._params)

    def _follow_trainable(self) -> None:
        """Take the stage's trainable parameters anew where ``requires_grad`` changed since.

        Fine-tuning unfreezes layers during a run (Lightning's ``BackboneFinetuning``, a
        hook's ``requires_grad_(True)``): the lists kept from the build (what a split ``W``
        accumulates into, what the replicas' buckets all-reduce, what the strategy hands back
        to Lightning's backward) would leave the new ones without a gradient, and the run
        would differ from one process with no error. Every replica of a stage holds the same
        parameters, so all rebuild their buckets alike at the same step.
        """
        now = [p for p in self.stage.parameters() if p.requires_grad]
        if len(now) == len(self._params) and all(a is b for a, b in zip(now, self._params,
                                                                        strict=True)):
            return
        self._params = now
        for c, runner in self._runners.items():
            runner.take_params([p for p in self.chunks[c].parameters() if p.requires_grad])
        if self._dp_sync is not None:
            self._dp_sync.remove()
            self._dp_sync = None
        if self.layout.num_replicas > 1 and now:
            assert self.groups is not None
            self._dp_sync = GradientSync(now, self.groups.dp, self.layout.num_replicas,
                                         self.bucket_bytes)

    def train_step(self, batch: Any, step: int | None = None) -> Tensor:
        """Forward and backward of every unit, then gradient sync; returns the global mean loss.

        Gradients accumulate into ``.grad`` (the caller zeroes them, as Lightning's closure does).
        ``step`` only labels failure messages. Afterwards :attr:`notes` holds what :attr:`report`
        said on every rank of the replica's pipeline, by global rank, each value averaged over
        the replicas (those of one stage report alike, or a nonzero value shows as nonzero):
        learnt in the collectives that carry the loss, so agreeing on them costs no
        synchronisation of its own. An evaluation step does the same.
        """
        self.step, self._training = step, True
        self._follow_trainable()
        if self.modes is not None:
            self.modes(self.stage.train)
        else:
            self.stage.train()
        if self.memory is not None:
            self.memory.begin_step()
        with step_gradients_only(t.param for t in self.tied):  # ties sum this step's alone
            loss = self._run(batch, train=True)
            with self._watch("gradient all-reduce", None, communication=True):
                self._sync_gradients()
        if self.memory is not None:
            self.memory.end_step()
        return loss

    @torch.no_grad()
    def eval_step(self, batch: Any, step: int | None = None, *, replicas: bool = True) -> Tensor:
        """Forward-only pipeline; the global mean loss (``replicas=False``: the replica's own,
        for prediction, where replicas may run different numbers of batches)."""
        self.step, self._training = step, False
        if self.modes is None:
            self.stage.eval()
            return self._run(batch, train=False, replicas=replicas)
        with self.modes.evaluating(self.stage.eval):
            return self._run(batch, train=False, replicas=replicas)

    def close(self) -> None:
        """Remove the gradient hooks this executor put on the stage's parameters.

        Call before the process groups are destroyed: a hook keeps the all-reduce group alive
        through the parameters, and a gloo group that outlives ``destroy_process_group`` can
        abort the process at interpreter exit ("terminate called without an active exception").
        """
        if self._dp_sync is not None:
            self._dp_sync.remove()
            self._dp_sync = None
        self._closed = True

    def nonfinite_origin(self) -> tuple[int, list[int]]:
        """After a step with a non-finite loss: the first stage whose outputs were non-finite.

        Collective over the world (call it on every rank). Returns ``(stage, ranks of that stage
        that saw it)``; the last stage when every stage's outputs were finite (the loss itself).
        """
        lay = self.layout
        mine = torch.zeros(lay.num_chunks, device=self.device)  # 1: that chunk's outputs were
        for c, runner in self._runners.items():  # non-finite on this rank
            mine[c] = float(not bool(torch.isfinite(runner.output_sum)))
        rows = [mine]
        if dist.is_available() and dist.is_initialized() and lay.world_size > 1:
            rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, mine)
        flags = [(c, rank) for rank, r in enumerate(rows) for c in range(len(r)) if r[c] > 0]
        last = lay.num_chunks - 1
        if not flags:
            return last, list(lay.grid[lay.position(last)])
        first = min(s for s, _ in flags)
        return first, [rank for s, rank in flags if s == first]

    def global_grad_norm(self, norm_type: float = 2.0) -> Tensor:
        """The whole model's gradient norm (tied copies counted once)."""
        skip = {id(t.param) for t in self.tied if not t.counted}
        norms = [(g if g.dtype in _FULL else g.float()).detach().norm(norm_type).double()
                 for p in self.parameters if (g := p.grad) is not None and id(p) not in skip]
        inf, local = math.isinf(norm_type), torch.zeros((), device=self.device, dtype=torch.float64)
        if norms:  # each in its own precision (no float64 copy of a gradient), summed in float64
            local = (torch.stack(norms).max() if inf else torch.stack(norms).pow(norm_type).sum())
        if self.layout.num_stages > 1:
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            dist.all_reduce(local, op=op, group=self.groups.pipeline)
        return local if inf else local.pow(1.0 / norm_type)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole pipeline (same formula and eps)."""
        total = self.global_grad_norm(norm_type)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for p in self.parameters:
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
        return total

    # ---------------------------------------------------------------------------- internals
    def _actions(self, train: bool, m: int, k: int, j: int) -> list[Action]:
        key = (train, m, k, j)
        if key not in self._schedules:
            acts = self._train_schedule(m, k, j) if train else self._eval_schedule(m)
            wrong = [a for a in acts if a.stage not in self._runners]
            if wrong:
                held = list(self._runners)
                what = f"stage {held[0]}" if len(held) == 1 else f"chunks {held}"
                raise PipelineRuntimeError(
                    f"rank {self.layout.rank} runs {what} but its schedule holds actions of "
                    f"other stages: {[str(a) for a in wrong[:4]]}"
                )
            self._schedules[key] = acts
        return self._schedules[key]

    @contextmanager
    def _watch(self, what: str, peer: int | None, communication: bool,
               passes: tuple[type[Exception], ...] = (PipelineRuntimeError,)) -> Iterator[None]:
        """Turn any failure but ``passes`` into a PipelineRuntimeError naming this rank (or the
        first failure)."""
        try:
            yield
        except passes:
            raise
        except Exception as exc:
            lay = self.layout
            kind = "training" if self._training else "validation"
            held = lay.chunks
            stage = f"stage {lay.stage}" if len(held) == 1 else f"chunks {list(held)}"
            raise pipeline_failure(
                self.failures,
                exc,
                where=f"rank {lay.rank} ({stage}, replica {lay.replica})",
                what=what,
                when=f"{kind} step {self.step}" if self.step is not None else f"a {kind} step",
                peer=peer,
                communication=communication,
                timeout_s=self.timeout_s,
            ) from exc

    def _run(self, batch: Any, train: bool, replicas: bool = True) -> Tensor:
        if self._closed:  # its replicas would no longer average gradients
            raise PipelineRuntimeError("this PipelineExecutor was closed; build a new one")
        flat = tuple(self._flatten(self._inputs_fn(batch)))
        if not flat:
            raise PipelineRuntimeError("the model's flattened inputs hold no tensor")
        size = int(flat[0].shape[0]) if flat[0].dim() else 0
        per = float(size)  # what a unit's samples are weighted over
        if train and self.replica_batches:
            lay = self.layout
            with self._watch("exchange of samples between replicas", None, True,
                             passes=(PipelineRuntimeError, InputError)):  # alike on every rank
                batch, per = take_share(batch, size, self.replica_batches, lay.replica,
                                        lay.grid[lay.stage], self.groups.dp)
            flat = tuple(self._flatten(self._inputs_fn(batch)))
            size = int(flat[0].shape[0])
        self.samples = size  # what this replica's last step ran on
        self.replica_weight = size / per if per else 1.0
        if self.check_batch:
            check_batch_sizes(batch, flat, size)
        if train:
            m, k, j = fit_units(size, self.num_microbatches, self.startup_slices, self.drain_slices)
        else:
            m, k, j = min(self.num_microbatches, size), 1, 1
        bounds = unit_bounds(size, m, k, j)
        actions = self._actions(train, m, k, j)
        split = any(a.kind is Kind.WEIGHT for a in actions)
        table = action_table(split)
        arm_at = self._arm_index(actions, split) if train else -1
        if train and self._dp_sync is not None:
            self._dp_sync.prepare()  # gradients accumulate straight into the all-reduce buffers
        runners = self._runners
        order = {u: i for i, u in enumerate(bounds)}
        for c, runner in runners.items():
            runner.begin(batch, flat, size, bounds, train=train, loss_scale=self.loss_scale,
                         outbox=Outbox.for_actions([a for a in actions if a.stage == c], order),
                         per=per)
        trace: list[Action] = []
        timeline: list[tuple[Action, float, float]] = []
        for idx, a in enumerate(actions):
            t0 = time.perf_counter()
            check_action(a, table, bounds)
            runner = runners[a.stage]
            peer = (runner.layout.prev_rank if a.kind in (Kind.RECV_F, Kind.SEND_B)
                    else runner.layout.next_rank)
            with self._watch(_action_name(a), peer, a.kind not in _COMPUTE_KINDS):
                if idx == arm_at:  # gradients become final during this action
                    self._arm(a.stage)
                table[a.kind](runner, a)
            trace.append(a)
            timeline.append((a, t0, time.perf_counter()))
        with self._watch("waiting for sends", None, communication=True):
            for runner in runners.values():
                runner.outbox.wait_all()
        self.trace = trace
        self.timeline = timeline
        loss_sum = runners[max(runners)].loss_sum  # the last chunk's (zero unless the model's)
        loss = self._global_loss(loss_sum, replicas, batch)  # float64, alike on every rank
        return loss if any(p.dtype == torch.float64 for p in self.parameters) else loss.float()

    def _arm(self, chunk: int) -> None:
        """Arm the data-parallel sync for the backward of ``chunk`` that makes every gradient
        of this rank final: the other chunks' gradients already are."""
        assert self._dp_sync is not None
        mine = {id(p) for p in self._runners[chunk].params}
        self._dp_sync.arm(done=[p for p in self._params if id(p) not in mine])

    def _arm_index(self, actions: Sequence[Action], split: bool) -> int:
        """The action during which this rank's gradients become final (-1: none to sync).

        The data-parallel buckets launch as the gradients fill them in a whole autograd
        backward: the last ``B`` of an unsplit schedule, or the last ``W`` of a stage whose
        ``W`` is a whole backward (the first stage under a split schedule). A split ``W``
        accumulates its gradients outside the hooks; those are launched by ``finish``. With
        several chunks it is the rank's last gradient-accumulating action over all of them,
        when that one is a whole backward.
        """
        if self._dp_sync is None:
            return -1
        final = Kind.WEIGHT if split else Kind.BACKWARD
        last = max((i for i, a in enumerate(actions) if a.kind is final), default=-1)
        if last < 0 or splits_backward_at(actions[last].stage, split):
            return -1
        return last

    def _global_loss(self, loss_sum: Tensor, replicas: bool, batch: Any) -> Tensor:
        """Replica mean from the last stage to the replica, then (``replicas``) over replicas."""
        layout = self.layout
        with self._watch("its report", None, False):  # a failure is posted, not waited on
            said = tuple(self.report()) if self.report is not None else ()
        reported = torch.tensor([list(said)], dtype=loss_sum.dtype, device=loss_sum.device)
        ranks = [layout.rank]
        if layout.num_stages > 1:
            reported = reported[0]
            last = layout.last_stage_rank  # its loss, and every rank's batch digest
            digest = batch_digest(batch if self.check_batch else None).to(loss_sum.device)
            mine = torch.cat([torch.stack([loss_sum, digest]), reported])
            with self._watch("loss gather", None if last == layout.rank else last, True):
                got = gather_by_rank(mine, self.groups.pipeline)
            check_same_batch({r: t[1] for r, t in got.items()}, layout)  # every rank, at once
            loss_sum = got[last][0]
            ranks, reported = list(got), torch.stack([t[2:] for t in got.values()])
        if replicas and layout.num_replicas > 1:  # the silent peer is known if there is one
            others = [r for r in layout.dp_ranks if r != layout.rank]
            both = torch.cat([loss_sum.view(1), reported.flatten()])
            with self._watch("loss all-reduce", others[0] if len(others) == 1 else None, True):
                dist.all_reduce(both, group=self.groups.dp)
            both /= layout.num_replicas
            loss_sum, reported = both[0], both[1:].view(reported.shape)
        values = reported.tolist() if said else [()] * len(ranks)  # no sync without a report
        self.notes = dict(zip(ranks, map(tuple, values), strict=True))
        return loss_sum

    def _sync_gradients(self) -> None:
        """Average gradients over the stage's replicas (overlapped, bucketed), sum tied copies."""
        if self._dp_sync is not None:
            self._dp_sync.finish()
        for t in self.tied:
            group = self.groups.ties.get(t.tie) if self.groups is not None else None
            if group is None:
                continue
            if t.param.grad is None:
                t.param.grad = torch.zeros_like(t.param)
            dist.all_reduce(t.param.grad, group=group)


def _action_name(a: Action) -> str:
    """``forward 1F0.1`` style label of an action for failure messages."""
    words = {Kind.FORWARD: "forward", Kind.BACKWARD: "backward", Kind.WEIGHT: "weight backward",
             Kind.SEND_F: "send of activations", Kind.RECV_F: "receive of activations",
             Kind.SEND_B: "send of gradients", Kind.RECV_B: "receive of gradients"}
    return f"{words.get(a.kind, 'action')} {a}"
