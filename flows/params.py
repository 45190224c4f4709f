"""Typed flow parameters: a pydantic model generated from a trainer's config dataclasses.

`params_model(DesignerConfig)` mirrors the config tree: one nested model per section, one field per key with the
dataclass's type (Literal, tuple, `X | None` as they are), its default and its help (the comment beside or above
the field in the dataclass's source, the section's docstring). Prefect turns the flow's signature into the
deployment's parameter schema, so the UI shows every section and key typed, and the server refuses a run whose
values do not fit the schema (`extra="forbid"`: an unknown key too) before any worker picks it up.

Only the keys a run sets are applied (pydantic's `model_fields_set`): `to_overrides` turns them into `--set`
items, which go on top of the config file, so a TOML path still works and explicit values beat it. The trainer's
own checks (`validate()`, ranges) still run on the merged config in the flow, naming the key.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from atelier_studio.pipeline.config import _toml_value


def field_help(cls: type) -> dict[str, str]:
    """Each field's help from the dataclass source: the comment lines right above it and the comment after it; a
    field a subclass inherits (the designer's `[train]` over the engine's) has its base class's help."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            out.update(_own_field_help(base))
    return out


def _own_field_help(cls: type) -> dict[str, str]:
    """The help of the fields `cls`'s own source declares."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}  # line → comment text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.add(tok.start[0])
    out: dict[str, str] = {}
    for stmt in ast.parse(source).body[0].body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, line = [], stmt.lineno - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        after = [comments[n] for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if n in comments]
        text = " ".join(above + after).strip()
        if text:
            out[stmt.target.id] = text
    return out


def _section_doc(cls: type) -> str | None:
    doc = inspect.getdoc(cls)
    if not doc or doc.startswith(f"{cls.__name__}("):  # dataclass's generated signature, no docstring
        return None
    return doc.split("\n\n")[0].replace("\n", " ")


def params_model(cls: type, name: str | None = None) -> type[BaseModel]:
    """The pydantic model of config dataclass `cls`, nested like it; every field optional to set."""
    hints = typing.get_type_hints(cls)
    helps = field_help(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            sub = params_model(tp, f"{name or cls.__name__}_{f.name}")
            fields[f.name] = (sub, Field(default_factory=sub, description=helps.get(f.name) or _section_doc(tp)))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:  # a key the config requires: unset here, the TOML file must give it
            tp, default = tp | None, None
        fields[f.name] = (tp, Field(default=default, description=helps.get(f.name)))
    model = create_model(name or f"{cls.__name__}Params", __config__=ConfigDict(extra="forbid"), **fields)
    model.__doc__ = _section_doc(cls)
    return model


def to_overrides(params: BaseModel | None, prefix: str = "") -> list[str]:
    """The keys set explicitly on `params` (at any depth) as `--set key=value` items, in field order."""
    if params is None:
        return []
    out: list[str] = []
    for key in type(params).model_fields:
        if key not in params.model_fields_set:
            continue
        value = getattr(params, key)
        if isinstance(value, BaseModel):
            out += to_overrides(value, f"{prefix}{key}.")
        elif value is None:
            out.append(f"{prefix}{key}=none")
        elif isinstance(value, str):
            out.append(f"{prefix}{key}={value}")
        else:
            out.append(f"{prefix}{key}={_toml_value(list(value) if isinstance(value, tuple) else value)}")
    return out


def params_from_sets(model: type[BaseModel], config_cls: type, items: list[str]) -> dict[str, Any]:
    """`--set a.b=c` items as the nested parameter dict of `model` (typed by the config's own override parser, so a
    bad key or value is a ConfigError naming it), checked against the model."""
    from atelier_studio.pipeline.config import ConfigError, _apply_override

    data: dict[str, Any] = {}
    for item in items:
        _apply_override(config_cls, data, item)
    data = _typed(config_cls, data, "")  # each value checked as the trainer's config checks it, naming the key
    try:
        model.model_validate(data)
    except ValueError as e:
        first = e.errors()[0] if hasattr(e, "errors") else None
        where = ".".join(str(p) for p in first["loc"]) if first else "?"
        raise ConfigError(f"--set {where}: {first['msg'] if first else e}") from None
    return _jsonable(data)


def _typed(cls: type, data: dict[str, Any], prefix: str) -> dict[str, Any]:
    from atelier_studio.pipeline.config import _coerce, _field_types

    hints = _field_types(cls)
    return {k: _typed(hints[k], v, f"{prefix}{k}.") if dataclasses.is_dataclass(hints[k])
            else _coerce(hints[k], v, f"{prefix}{k}") for k, v in data.items()}


def _jsonable(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _jsonable(v) for k, v in data.items()}
    if isinstance(data, tuple):
        return [_jsonable(v) for v in data]
    return data
