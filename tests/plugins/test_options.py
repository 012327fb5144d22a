"""Every option of every built-in plugin, and of the ``Loop``, is checked when the object is
built: a value of no meaning is refused there, the error naming the plugin, the
option and the value, never accepted to fail later, elsewhere, or never. The options come from
the signatures themselves, so a new option without a check fails here."""

from __future__ import annotations

import importlib
import inspect
import tomllib
from typing import Any

import pytest

import hookfit
from conftest import REPO


class Meaningless:
    """A value no option means anything with."""

    def __repr__(self) -> str:
        return "<meaningless>"


def _builtins() -> list[tuple[str, type]]:
    points = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["hookfit"]
    out = []
    for name, target in sorted(points.items()):
        module, attribute = target.split(":")
        out.append((name, getattr(importlib.import_module(module), attribute)))
    return out


def _options() -> list[Any]:
    cases = []
    for name, cls in _builtins():
        for option in list(inspect.signature(cls.__init__).parameters.values())[1:]:
            assert option.kind not in (option.VAR_POSITIONAL, option.VAR_KEYWORD), (name, option)
            cases.append(pytest.param(name, cls, option.name, id=f"{name}-{option.name}"))
    return cases


@pytest.mark.bad_input
@pytest.mark.parametrize("plugin, cls, option", _options())
def test_every_built_in_option_is_checked_when_the_plugin_is_built(plugin: str, cls: type, option: str) -> None:
    with pytest.raises((ValueError, TypeError)) as raised:
        cls(**{option: Meaningless()})
    message = str(raised.value)
    assert message.startswith(f"{plugin}: ") and option in message, message


def test_the_table_covers_every_built_in() -> None:
    names = {name for name, _ in _builtins()}
    assert {"optim", "metrics", "console", "tui", "checkpoint", "distributed", "interrupter", "ema",
            "early_stopping", "csv", "tensorboard", "mlflow", "wandb", "profile", "lr_find"} <= names
    assert len(_options()) > 60


def step(loop: Any, batch: Any) -> None:
    return None


@pytest.mark.bad_input
@pytest.mark.parametrize("option, value", [
    ("max_epochs", 0), ("max_epochs", 1.5), ("max_steps", -1), ("max_steps", "5"),
    ("val_every_n_epochs", 0), ("val_every_n_steps", True), ("val_grad_mode", "off"),
    ("run_dir", 3), ("run_dir", Meaningless()), ("name", "a/b"), ("name", ""),
    ("resume", 3), ("resume", Meaningless()), ("plugins", "metrics"), ("plugins", 3),
    ("disable", "metrics"), ("disable", 3), ("seed", "a"), ("seed", -1),
    ("deterministic", "yes"), ("smoke", 1), ("model", Meaningless()),
])
def test_every_loop_option_is_checked_when_the_loop_is_built(option: str, value: Any) -> None:
    with pytest.raises((ValueError, TypeError)) as raised:
        hookfit.Loop(step, [1], **{option: value})
    assert option in str(raised.value), str(raised.value)
