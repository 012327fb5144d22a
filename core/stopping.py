"""Stopping, the core's: a request from any thread, hook or step, honoured at the loop's next
boundary (after a batch, at a stage's or an epoch's start and end). The first request wins and
cannot be unset, as pytest's ``session.shouldstop``; ``should_stop`` answers are one more way
to ask; with several processes an ``agree_stop`` implementation makes them stop together, and
the request they agreed on is the one the run keeps."""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING

from hookfit.payloads import StopRequest

if TYPE_CHECKING:  # pragma: no cover
    from hookfit.position import Position
    from hookfit.run import Run

__all__ = ["Budget", "Stop", "Stopping", "epoch_left", "nothing_left"]


class Stop(Exception):
    """The run stops at this boundary, as ``request`` asked (internal to the loop)."""

    def __init__(self, request: StopRequest) -> None:
        super().__init__(request.reason)
        self.request = request


class Budget(Exception):
    """``max_steps`` training batches are done, inside an epoch (internal to the loop)."""


def epoch_left(at: Position | None, max_steps: int | None, per_epoch: int | None) -> bool:
    """Whether a run resumed at ``at``, at its ``max_steps``, has the rest of that step's epoch left, as the run it
    continues had it: a validation due at that step (``val_due``: ``val_every_n_steps``), or the end of an epoch whose
    training batches are all done (a checkpoint of its last batch or of its validation: ``stage_end``, the epoch's
    validation when due, ``epoch_end``). ``per_epoch``: the training data's batches an epoch, ``None`` when unknown
    (then the loop draws one more batch to know, as the run it continues did)."""
    return at is not None and at.step == max_steps and (
        at.val_due or at.stage == "valid" or 0 < at.batch and (per_epoch is None or at.batch >= per_epoch))


def nothing_left(where: str, at: Position, max_steps: int | None, max_epochs: int | None,
                 per_epoch: int | None) -> str | None:
    """Why a run resumed from ``where`` at ``at`` has nothing left to train or validate (the run it continues
    reached its end, or the bounds given now are below it), or ``None``. ``max_epochs``: ``None`` where the
    epochs do not bound the run (``max_steps`` alone); ``per_epoch``: as for :func:`epoch_left`, whose rest of an
    epoch is something left."""
    step, epoch = at.step, at.epoch
    if max_steps is not None and step >= max_steps and not epoch_left(at, max_steps, per_epoch):
        reached, raise_ = f"it is at step {step}, and max_steps={max_steps}", "max_steps"
    elif max_epochs is not None and epoch >= max_epochs:
        reached, raise_ = f"its {epoch} epochs are done, and max_epochs={max_epochs}", "max_epochs"
    else:
        return None
    return (f"the run resumed from {where} had already finished and has nothing left to train ({reached}): this "
            f"fit trains nothing and ends at once, completed as before (a script of several runs started again "
            f"skips its finished ones so); to train on, raise {raise_}; to train it again from the start (a changed "
            f"loss, model or settings), give resume=None or a new run (Loop(name=...) or Loop(run_dir=...))")


HEARD = 30.0
"""How long the loop waits at a boundary for another thread's ``stop_requested`` listeners to return."""


class Stopping:
    """A run's stop request (:attr:`request`, ``None`` until one is asked) and its boundaries."""

    __slots__ = ("run", "request", "failure", "_lock", "_thread", "_heard")

    def __init__(self, run: Run) -> None:
        self.run = run
        self.request: StopRequest | None = None
        self.failure: BaseException | None = None
        """The first error of a ``stop_requested`` implementation that takes part in training,
        fired on another thread than the loop's: :meth:`boundary` raises it on the loop's."""
        self._thread = threading.get_ident()  # the loop's (a run is made by the fit() that runs it)
        # re-entrant: a signal handler (the interrupter's) runs on the main thread, possibly
        # while the step function itself is inside ask()
        self._lock = threading.RLock()
        self._heard = threading.Event()  # the request's stop_requested listeners have returned (set: none running)
        self._heard.set()

    def ask(self, reason: str, by: str | None, complete: bool, caller: FrameType | None,
            ends_process: bool = False) -> StopRequest:
        """Record a request (the first one wins) and fire ``stop_requested`` once for it, on
        the calling thread. ``by`` defaults to whoever called, found from ``caller`` up. On
        another thread than the loop's, the error of an implementation that takes part in
        training (an observer's switches it off, as always) is not the asker's: it is kept
        (:attr:`failure`) and fails the run at the loop's next boundary, which names the plugin."""
        new = StopRequest(reason, by if by is not None else self.asker(caller), bool(complete),
                          ends_process=bool(ends_process))
        with self._lock:
            if self.request is None:
                self.request = new
                self._heard.clear()
            request = self.request
        if request is not new:
            return request
        try:
            if (call := self.run.hooks.stop_requested) is not None:
                call(self.run, request)
        except Exception as error:
            if threading.get_ident() == self._thread:
                raise
            with self._lock:
                self.failure = self.failure or error
        finally:
            self._heard.set()
        return request

    def kept(self) -> BaseException | None:
        """The :attr:`failure` kept, taken once: raised at a boundary, or by the run's end; asked on the
        loop's thread, once the request's listeners on the asking thread have returned (at most
        :data:`HEARD` seconds: they must be quick)."""
        if threading.get_ident() == self._thread:
            self._heard.wait(HEARD)
        with self._lock:
            failure, self.failure = self.failure, None
        return failure

    def asker(self, frame: FrameType | None) -> str | None:
        """Who is asking: the innermost registered plugin (a method of it, or a function of a
        plugin module) or step function on the stack from ``frame`` outwards."""
        run = self.run
        steps = {getattr(s, "__code__", None): s for s in (run.train_step, run.val_step) if s is not None}
        pairs = [(n, p) for n, p in run.pm.list_name_plugin() if p is not None]
        names = {id(p): n for n, p in pairs}
        modules = {id(vars(p)): n for n, p in pairs if isinstance(p, type(sys))}
        while frame is not None:
            if frame.f_code in steps:
                return f"step function {qualname(steps[frame.f_code])!r}"
            owner = frame.f_locals.get("self") if frame.f_code.co_argcount else None
            if owner is not None and id(owner) in names:
                return names[id(owner)]
            if id(frame.f_globals) in modules:
                return modules[id(frame.f_globals)]
            frame = frame.f_back
        return None

    def after_batch(self) -> None:
        """Ask ``should_stop`` (when implemented), then stop here if a request is waiting."""
        if self.run.hooks.should_stop is not None:
            self.ask_should_stop()
        self.boundary("batch")

    def ask_should_stop(self) -> None:
        """Ask every ``should_stop`` implementation; true answers become a stop request."""
        run = self.run
        answers = [(name, answer) for name, answer in run.hooks.call_each("should_stop", run) if answer]
        if answers and self.request is None:  # a StopRequest answer is taken whole, any other as a reason or none
            asked = [answer if isinstance(answer, StopRequest) else StopRequest(answer if isinstance(answer, str) else "")
                     for _, answer in answers]
            self.ask("; ".join(r.reason for r in asked if r.reason) or "a plugin answered should_stop",
                     ", ".join(r.by or name for r, (name, _) in zip(asked, answers)),
                     all(r.complete for r in asked), None, any(r.ends_process for r in asked))

    def boundary(self, where: str) -> None:
        """Stop here (raise :class:`Stop`) if a stop was requested and, with several
        processes, agreed on. The agreed request (with the ``ranks`` that asked) becomes this
        run's :attr:`request`, on every process, for ``loop.stop_requested`` to tell."""
        request = self.request
        run = self.run
        agree = run.hooks.agree_stop
        if agree is not None:
            decision = agree(run, request, where)
            if isinstance(decision, StopRequest):
                request = decision
                with self._lock:
                    self.request = decision
            elif decision is False:
                return
            elif decision is not None:
                raise TypeError(
                    f"agree_stop must return a StopRequest, False or None, not {decision!r} "
                    f"(plugins: {', '.join(run.hooks.plugins('agree_stop'))})"
                )
        if request is not None:
            if (failure := self.kept()) is not None:  # (its listener failed on the thread that asked)
                raise failure
            raise Stop(request)


def qualname(function: object) -> str:
    """How messages name a step function or a plugin's callable: its qualified name, else (a callable
    object) its :func:`brief` repr."""
    return getattr(function, "__qualname__", None) or brief(function)


def brief(value: object, most: int = 80) -> str:
    """``repr(value)`` on one line, cut to ``most`` characters (a model's or a dataset's repr runs to
    lines, and pages)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= most else text[:most - 3] + "..."
