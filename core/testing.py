"""A pytest plugin for testing hookfit plugins: ``-p hookfit.testing`` or, in a conftest,
``pytest_plugins = ["hookfit.testing"]``.

Fixtures:

* ``hookfit_recorder``: a :class:`Recorder` plugin that implements every event (the core's
  and those the discovered plugins declare) and records what it saw: ``recorder.events``, a
  list of ``(event, {argument: value})`` without ``loop`` (an ``error`` is recorded as its
  type's name); ``recorder.names()``, the events in the order they fired;
  ``recorder.seen``, ``(event, loop.state.stage, loop.training)`` per call.
  ``Recorder(stop_after=N)`` answers ``should_stop`` from global step N on;
  ``Recorder(agree=True)`` implements ``agree_stop`` too (always "no opinion"), and
  ``Recorder(results=True)`` ``results`` (answering nothing).
* ``hookfit_run``: ``hookfit_run(*plugins, step=..., data=..., **loop_kwargs)`` runs a real
  :class:`hookfit.Loop` with exactly the given plugins (discovered ones are not loaded: no
  ``optim``, no ``metrics``) and returns the loop; ``train_step=``/``train_data=`` (the ``Loop``'s
  own names) work as ``step=``/``data=``. By default the step trains a tiny linear model on a few
  random batches, through ``loop.backward`` and ``loop.optimizers`` when a given plugin implements
  ``backward`` (``Optim()`` or a replacement), else by itself: then no optimizer event fires
  (``before_optimizer_step``...), and without ``Metrics()`` no ``metrics_values`` is asked, so a
  plugin on those is tested with them given: ``hookfit_run(plugin, Optim(), Metrics())``. A plugin
  switched off during the run (an observer that raised: in a run, one warning) fails the test,
  naming it and its error, unless ``expect_silenced=True``.
* ``hookfit_isolated``: discovered plugins are not loaded in this test (``HOOKFIT_PLUGINS`` is
  set to an empty value, ``HOOKFIT_CONFIG`` unset), so a test sees only the plugins it gives,
  as it gives them (the events the discovered plugins declare stay declared); and the test
  runs in its
  own temporary folder, so the run folders its loops write (``runs/<name>/...``) never land in
  the project that runs the suite.

Loading this module imports neither torch nor the loop; the fixtures import them when used.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator

import pytest

from hookfit import hookimpl, hookspecs
from hookfit.discovery import ENV_DISABLE, ENV_ONLY


def _specs(module: Any) -> dict[str, Callable[..., Any]]:
    """Every event declared in ``module`` (a module or a class of specs), in declaration order."""
    return {name: fn for name, fn in vars(module).items() if hasattr(fn, "hookfit_spec")}


def _arguments(spec: Callable[..., Any]) -> list[str]:
    """A spec's argument names (a spec class's ``self`` left out, as pluggy does)."""
    args = list(inspect.signature(spec).parameters)
    return args[1:] if args[:1] == ["self"] else args


def spec_arguments(module: Any = hookspecs) -> dict[str, list[str]]:
    """Every event declared in ``module`` (a module or a class of specs) with its argument
    names, in declaration order (a class's ``self`` left out, as pluggy does)."""
    return {name: _arguments(fn) for name, fn in _specs(module).items()}


def _describe(name: str, value: Any) -> Any:
    if name == "error":
        return type(value).__name__
    return value


def _discovered_specs() -> list[tuple[str, Any]]:
    from hookfit import discovery

    return list(discovery.discovered_events())


def plugin_events() -> dict[str, list[str]]:
    """Every event the discovered plugins declare (:func:`hookfit.discovery.discovered_events`),
    enabled or not, with its argument names. Imports those plugins (and so torch)."""
    events: dict[str, list[str]] = {}
    for _, specs in _discovered_specs():
        events.update(spec_arguments(specs))
    return events


class Recorder:
    """A plugin that implements every event and records ``(event, {argument: value})`` for
    each call, without the loop itself, and ``(event, stage, training)`` as the loop saw it.
    Every event: the core's and those the discovered plugins declare (implemented with
    ``optionalhook=True``, so it works where such a plugin is not installed).

    ``stop_after=N`` makes it answer ``should_stop`` once the global step reaches N.
    ``agree_stop`` is left out unless ``agree=True``: only a plugin that runs several processes
    implements it, and the loop then asks it at every boundary (its answer here is always
    "no opinion"). ``results``, asked after ``fit_end``, is left out unless ``results=True``,
    so that a run's events still end with ``fit_end`` (it answers nothing)."""

    name = "recorder"

    def __init__(self, stop_after: int | None = None, agree: bool = False, results: bool = False) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.seen: list[tuple[str, str | None, bool]] = []
        self.stop_after = stop_after
        wanted = {"agree_stop": agree, "results": results}
        for event, spec in _specs(hookspecs).items():
            if wanted.get(event, True):
                setattr(self, event, self._make(event, spec))
        for _, specs in _discovered_specs():
            for event, spec in _specs(specs).items():
                setattr(self, event, self._make(event, spec, optional=True))

    def _make(self, event: str, spec: Callable[..., Any], optional: bool = False) -> Any:
        """An implementation of ``event`` taking every argument of its ``spec``: pluggy reads
        the argument names through ``__wrapped__`` (the spec itself) and passes them in order."""
        names = _arguments(spec)

        def record(*values: Any) -> Any:
            kwargs = dict(zip(names, values))
            loop = kwargs["loop"]
            self.events.append((event, {k: _describe(k, v) for k, v in kwargs.items() if k != "loop"}))
            self.seen.append((event, loop.state.stage, loop.training))
            if event == "should_stop" and self.stop_after is not None and loop.state.step >= self.stop_after:
                return f"recorder stops at step {loop.state.step}"
            return None

        record.__wrapped__ = spec  # type: ignore[attr-defined]  # where pluggy reads the argument names
        return hookimpl(optionalhook=optional)(record)

    def names(self) -> list[str]:
        """The events in the order they fired."""
        return [event for event, _ in self.events]


@pytest.fixture
def hookfit_isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Only the plugins a test gives take part: no discovered plugin is loaded. The test runs
    in its temporary folder (``tmp_path``): what its runs write stays there."""
    monkeypatch.setenv(ENV_ONLY, "")
    monkeypatch.delenv(ENV_DISABLE, raising=False)
    monkeypatch.delenv("HOOKFIT_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def hookfit_recorder() -> Recorder:
    """A fresh :class:`Recorder`."""
    return Recorder()


@pytest.fixture
def hookfit_run(hookfit_isolated: None, tmp_path: Any) -> Iterator[Callable[..., Any]]:
    """Run a real loop with exactly the given plugins; returns the finished loop."""
    import torch

    import hookfit

    def run(*plugins: Any, step: Callable[..., Any] | None = None, data: Any = None, expect_silenced: bool = False,
            **kwargs: Any) -> Any:
        step = kwargs.pop("train_step", None) if step is None else step  # the Loop's own names too
        data = kwargs.pop("train_data", None) if data is None else data
        generator = torch.Generator().manual_seed(0)
        model = torch.nn.Linear(3, 1)
        if data is None:
            data = [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(4)]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def tiny_step(loop: Any, batch: Any) -> dict[str, Any]:
            x, y = batch
            loss = torch.nn.functional.mse_loss(model(x), y)
            if loop.hooks.backward is not None:  # a plugin owns the backward pass: optim, or its replacement
                loop.backward(loss)
                loop.optimizers.step()
                loop.optimizers.zero_grad()
            else:
                optimizer.zero_grad()
                torch.autograd.backward(loss)  # loss.backward(), which torch leaves unannotated
                optimizer.step()
            return {"loss": loss}

        kwargs.setdefault("model", model)
        kwargs.setdefault("optimizers", optimizer)
        kwargs.setdefault("run_dir", tmp_path / "run")
        loop = hookfit.Loop(step or tiny_step, data, plugins=list(plugins), **kwargs)
        loop.fit()
        if loop.state.silenced and not expect_silenced:  # an observer's error is only a warning in a run
            pytest.fail("; ".join(f"{s.description} was switched off in {s.hook!r}: {type(s.error).__name__}: "
                                  f"{s.error}" for s in loop.state.silenced)
                        + " (hookfit_run(..., expect_silenced=True) where the test expects it)", pytrace=False)
        return loop

    yield run
