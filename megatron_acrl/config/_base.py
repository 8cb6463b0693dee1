"""The base of every config section and the one error type of the config."""

from __future__ import annotations


class ConfigError(ValueError):
    """One or more invalid config entries; ``errors`` holds (key path, message) pairs."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        lines = [f"  {path}: {msg}" if path else f"  {msg}" for path, msg in errors]
        super().__init__("invalid config:\n" + "\n".join(lines))


def _check(errors: list[tuple[str, str]], cond: bool, key: str, msg: str) -> None:
    if not cond:
        errors.append((key, msg))


def _raise_if(errors: list[tuple[str, str]]) -> None:
    if errors:
        raise ConfigError(errors)


class _Section:
    """Base of the config sections: an instance that exists is a valid one."""

    def validate(self) -> list[tuple[str, str]]:
        return []

    def __post_init__(self) -> None:
        _raise_if(self.validate())
