"""The partitioner's memo of one shape's cut lists: estimates, or bounds where they suffice.

The AutoPipe partitioner (:mod:`~.partition`) walks cut lists of one layout and one step
(:class:`~.step.StepShape`) and compares each with the best so far. :class:`Scorer`
remembers every cut list looked at (their count is the walk's evaluation budget), prices
batches of candidates together, and replays a candidate only when its lower bound
(:func:`~.bound.bound_batch`) could beat the best: the walk takes the same steps as with every
candidate replayed (see :mod:`~.bound` for the one exception past the extrapolation point).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_autopipe.planner.costmodel import Estimate
from lightning_autopipe.planner.slicer import cannot_beat

__all__ = ["Scorer"]

#: a bound costs about a third of a replay: after this many, bounding goes on only while at
#: least this share of them spared a replay (where the bound is loose, as on steps whose
#: extrapolation has not settled, every candidate is replayed as before)
_TRIAL, _PAYS = 12, 0.4


@dataclass(frozen=True)
class _Bounded:
    """A cut list the search looked at without replaying it: its lower bound (``low``) could
    not beat the best step at the time, so it could not have been taken."""

    low: float
    fits: bool


class Scorer:
    """Memoised fast-model evaluation of cut lists for one layout and one step.

    ``cache`` holds the cut lists the search has looked at (its size is the search's
    evaluation count): their estimates, or for those :meth:`unless_worse` showed could not
    beat the best step without a replay, their bound (:class:`_Bounded`). :meth:`prefetch`
    prices candidates the search is about to look at in one batch and keeps them aside until
    it does, so batching and bounding change no step of the search: it takes the same moves
    as if every cut list were replayed.
    """

    def __init__(
        self, fn: Callable[[list[int]], Estimate], max_steps: int,
        many: Callable[[list[list[int]]], list[Estimate]] | None = None,
        bound: Callable[[list[list[int]]], list[tuple[float, bool]]] | None = None,
    ) -> None:
        self._fn = fn
        self._many = many
        self._bound = bound
        self.cache: dict[tuple[int, ...], Estimate | _Bounded] = {}
        self._ahead: dict[tuple[int, ...], Estimate] = {}
        self._low: dict[tuple[int, ...], tuple[float, bool]] = {}
        self.steps = 0
        self.max_steps = max_steps
        self.replays = 0  # cut lists replayed (the rest of the cache was bounded)
        self._tried = self._spared = 0  # bounds computed, and those that spared a replay

    def prefetch(
        self, cands: Sequence[Sequence[int]], room: int, best: Estimate | None = None
    ) -> None:
        """Price together the first ``room`` of ``cands`` not looked at yet (with ``best``,
        only those whose bound may beat it: the best only gets better)."""
        todo: dict[tuple[int, ...], None] = {}
        for c in cands:
            if len(todo) >= room:
                break
            key = tuple(c)
            if key not in self.cache and key not in self._ahead:
                todo[key] = None
        if best is not None and self._bounding() and todo:
            fresh = [k for k in todo if k not in self._low]
            if fresh:
                self._low.update(zip(fresh, self._bound([list(k) for k in fresh])))
            kept = {k: None for k in todo if not cannot_beat(*self._low[k], best)}
            self._tried += len(fresh)
            self._spared += sum(k not in kept for k in fresh)
            todo = kept
        if self._many is not None and len(todo) > 1:
            self._ahead.update(zip(todo, self._many([list(k) for k in todo])))
            self.replays += len(todo)

    def step(self) -> bool:
        """Count one descent pass; False once the step budget is spent."""
        self.steps += 1
        return self.steps <= self.max_steps

    def __call__(self, cuts: Sequence[int]) -> Estimate:
        key = tuple(cuts)
        hit = self.cache.get(key)
        if not isinstance(hit, Estimate):
            hit = self._ahead.pop(key, None)
            if hit is None:
                hit = self._fn(list(key))
                self.replays += 1
            self.cache[key] = hit
        return hit

    def unless_worse(self, cuts: Sequence[int], best: Estimate) -> Estimate | None:
        """The estimate of ``cuts``, or None when its bound shows it cannot be
        :func:`~.slicer.better` than ``best`` (it then counts as looked at, unreplayed)."""
        key = tuple(cuts)
        hit = self.cache.get(key)
        if isinstance(hit, Estimate) or key in self._ahead or not self._bounding():
            return self(key)
        low = (hit.low, hit.fits) if hit is not None else self._low.pop(key, None)
        fresh = low is None
        if fresh:
            low = self._bound([list(key)])[0]  # type: ignore[misc]
            self._tried += 1
        if cannot_beat(*low, best):
            self._spared += fresh
            self.cache[key] = _Bounded(*low)
            return None
        return self(key)

    def _bounding(self) -> bool:
        """Whether bounds are still worth computing (see :data:`_TRIAL`)."""
        return self._bound is not None and (
            self._tried < _TRIAL or self._spared >= _PAYS * self._tried)

    def runners_up(self, cur: list[int], count: int) -> list[tuple[list[int], Estimate]]:
        """The ``count`` best cut lists looked at other than ``cur`` (those that fit memory
        first, then the shortest step), replaying the bounded ones that could rank among
        them: the same list as if every one had been replayed."""
        def rank(kv: tuple) -> tuple[bool, float]:
            v = kv[1]
            return (not v.fits, v.iteration_ms if isinstance(v, Estimate) else v.low)

        while True:
            ranked = sorted(((k, v) for k, v in self.cache.items() if list(k) != cur),
                            key=rank)
            top = ranked[:count]
            if not top:
                return []
            edge = rank(top[-1])
            todo = [k for k, v in ranked if isinstance(v, _Bounded) and rank((k, v)) <= edge]
            if not todo:
                return [(list(k), v) for k, v in top]  # type: ignore[misc]
            if self._many is not None and len(todo) > 1:
                self.cache.update(zip(todo, self._many([list(k) for k in todo])))
                self.replays += len(todo)
            else:
                for k in todo:
                    self(k)
