"""Shared helpers: an event recorder that implements every hook declared in hookspecs."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import hookfit
from hookfit import hookspecs


def spec_names() -> dict[str, list[str]]:
    """Every declared event with its argument names, in declaration order."""
    return {
        name: list(inspect.signature(fn).parameters)
        for name, fn in vars(hookspecs).items()
        if hasattr(fn, "hookfit_spec")
    }


def _describe(name: str, value: Any) -> Any:
    if name == "loop":
        return None
    if name == "error":
        return type(value).__name__
    return value


class Recorder:
    """Implements every event; records ``(event, {arg: value})`` without the loop, plus the
    loop's stage and training flag at that moment."""

    name = "recorder"

    def __init__(self, stop_after: int | None = None) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.seen: list[tuple[str, str | None, bool]] = []
        self.stop_after = stop_after
        for event, args in spec_names().items():
            setattr(self, event, self._make(event, args))

    def _make(self, event: str, args: list[str]) -> Any:
        def record(**kwargs: Any) -> Any:
            loop = kwargs["loop"]
            self.events.append((event, {k: _describe(k, v) for k, v in kwargs.items() if k != "loop"}))
            self.seen.append((event, loop.state.stage, loop.training))
            if event == "should_stop" and self.stop_after is not None:
                if loop.state.step >= self.stop_after:
                    return f"recorder stops at step {loop.state.step}"
            return None

        source = f"lambda {', '.join(args)}: record({', '.join(f'{a}={a}' for a in args)})"
        return hookfit.hookimpl(eval(source, {"record": record}))

    def names(self) -> list[str]:
        return [event for event, _ in self.events]


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(autouse=True)
def _no_env_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests choose their plugins explicitly: discovered plugins are loaded only where a test
    asks for them by unsetting this."""
    monkeypatch.setenv("HOOKFIT_PLUGINS", "")
    monkeypatch.delenv("HOOKFIT_DISABLE_PLUGINS", raising=False)
