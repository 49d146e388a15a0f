"""The checks of the run's `model` section: each fails with a ConfigError naming the option."""

from __future__ import annotations

from typing import Any

from dspark_ds.errors import ConfigError


class Checker:
    """`check(field, ok, why)` raises `<prefix>.<field>: <why>, got <value>` unless `ok`."""

    def __init__(self, cfg: Any, prefix: str | None):
        self.cfg, self.prefix = cfg, prefix

    def name(self, field: str) -> str:
        """The option as the user writes it (`model.block_size`; the bare field without a
        prefix)."""
        return f"{self.prefix}.{field}" if self.prefix else field

    def __call__(self, field: str, ok: bool, why: str) -> None:
        if not ok:
            raise ConfigError(f"{self.name(field)}: {why}, got {getattr(self.cfg, field)!r}")

    def at_least_1(self, *fields: str) -> None:
        for field in fields:
            self(field, getattr(self.cfg, field) >= 1, "must be >= 1")
