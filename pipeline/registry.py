"""A table of model families: the one place a trainer looks up a family by config name, size or args class.

Each trainer (designer/registry.py, imagegen/registry.py) keeps one `FamilyRegistry` of its own family
records. A family is found by

  - a config value: the model_type of a transformers config.json, the `_class_name` of a diffusers one;
  - a named size (`atelier designer init --size ...`);
  - the type of its args (the frozen dataclass a model is built from): `type(args)` exactly, so a family
    whose args class subclasses another family's is still told apart.

Names, config values, sizes and args classes are unique across the registered families; `register`
refuses a family that repeats one. The errors for an unknown config value or size list what is
registered. This module knows no family: the records are the trainers' (pipeline/ imports no model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from atelier_studio.pipeline.errors import ModelLoadError, UsageError


class FamilyRecord(Protocol):
    """What the registry reads of a family record (designer/family.py, imagegen/family.py)."""

    name: str
    sizes: Mapping[str, Any]
    args_cls: type


F = TypeVar("F", bound=FamilyRecord)


class FamilyRegistry(Generic[F]):
    """The families of one trainer. `config_key` names the config field that selects a family (for errors);
    `config_values(family)` gives the values of that field a family reads."""

    def __init__(self, trainer: str, config_key: str, config_values: Callable[[F], Iterable[str]]) -> None:
        self.trainer = trainer
        self.config_key = config_key
        self._config_values = config_values
        self._families: dict[str, F] = {}

    def register(self, family: F) -> F:
        """Add `family`; ValueError if its name, a config value, a size or its args class is taken."""
        clashes = []
        for other in self._families.values():
            if other.name == family.name:
                clashes.append(f"name {family.name!r}")
            shared = set(self._config_values(other)) & set(self._config_values(family))
            if shared:
                clashes.append(f"{self.config_key} {sorted(shared)} (of {other.name})")
            sizes = set(other.sizes) & set(family.sizes)
            if sizes:
                clashes.append(f"sizes {sorted(sizes)} (of {other.name})")
            if other.args_cls is family.args_cls:
                clashes.append(f"args class {family.args_cls.__name__} (of {other.name})")
        if not tuple(self._config_values(family)):
            clashes.append(f"no {self.config_key}")
        if clashes:
            raise ValueError(f"cannot register the {self.trainer} family {family.name!r}: {'; '.join(clashes)}")
        self._families[family.name] = family
        return family

    def unregister(self, family: F) -> None:
        """Remove `family` (a test's temporary family); KeyError if it is not registered."""
        if self._families.get(family.name) is not family:
            raise KeyError(f"the {self.trainer} family {family.name!r} is not registered")
        del self._families[family.name]

    def families(self) -> tuple[F, ...]:
        """The registered families, in registration order."""
        return tuple(self._families.values())

    def by_config(self, value: object, source: str) -> F:
        """The family that reads config value `value` (e.g. config.json's model_type); `source` names the file."""
        for family in self._families.values():
            if value in tuple(self._config_values(family)):
                return family
        known = "; ".join(f"{f.name}: {', '.join(self._config_values(f))}" for f in self._families.values())
        raise ModelLoadError(f"{source}: {self.config_key} {value!r} is not a registered {self.trainer} family "
                             f"(registered {self.config_key}s — {known})")

    def by_size(self, size: str) -> F:
        """The family with the named size; UsageError listing every registered size."""
        for family in self._families.values():
            if size in family.sizes:
                return family
        raise UsageError(f"unknown {self.trainer} size {size!r}; known: {self.describe_sizes()}")

    def by_args(self, args: object) -> F:
        """The family whose args class is exactly `type(args)`.

        A model built from args of no registered family is a programming error (TypeError), not bad input.
        """
        for family in self._families.values():
            if type(args) is family.args_cls:
                return family
        names = ", ".join(f"{f.name} ({f.args_cls.__name__})" for f in self._families.values())
        raise TypeError(f"{type(args).__name__} is not the args class of a registered {self.trainer} family: {names}")

    def describe_sizes(self) -> str:
        """Every registered size by family: "Qwen3: tiny, demo, ...; Qwen3.5: ..."."""
        return "; ".join(f"{f.name}: {', '.join(f.sizes)}" for f in self._families.values())
