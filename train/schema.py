"""The base of every raywright config: strict pydantic sections, read from YAML plus ``--set`` overrides.

A section is a pydantic model whose fields carry their types, ranges and Literals, and a docstring each
(the ``--help`` text). ``parse`` turns pydantic's errors into one line that names the key, e.g.
``deepspeed.zero_stage: 5 is not one of [0, 1, 2, 3, 'auto']``. Types are strict: ``true`` is not a count and
``"8"`` is not a number; ints widen to floats.
"""

import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from train import storage


class ConfigError(ValueError):
    """A config file, override or setting that names an unknown key or holds a bad value."""


def error_reason(exc: BaseException) -> str:
    """What a one-line error says of ``exc``: its message's first line, or its type where it has no message."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class Section(BaseModel):
    """A config section: unknown keys, mistyped values and NaN are errors; field docstrings are descriptions."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True)


def _check_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", name):
        raise ValueError("must be letters, digits, '.', '_' or '-', not starting with '.'")
    return name


Name = Annotated[str, AfterValidator(_check_name)]
"""A name that is also a directory name: no '/', not '.' or '..', nothing a shell would trip on."""

SectionT = TypeVar("SectionT", bound=Section)

# What a value of the wrong type should have been, by pydantic's error type.
_EXPECTED = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping of keys",
}


def _optional_of(hint: Any) -> Any:
    """``X`` for ``X | None`` (annotated or not), where pydantic's error location goes on into ``X``."""
    if typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [member for member in typing.get_args(hint) if member is not type(None)]
        return members[0] if len(members) == 1 else hint
    return hint


def _field_path(cls: type[BaseModel], loc: tuple) -> tuple[str, Any]:
    """The dotted key that pydantic's error location ``loc`` names, and the type hint found there.

    A location goes on past the key into a union's member names; those are dropped.
    """
    parts: list[str] = []
    hint: Any = cls
    for item in loc:
        hint = _optional_of(hint)
        origin = typing.get_origin(hint)
        if isinstance(hint, type) and issubclass(hint, BaseModel) and item in hint.model_fields:
            hint = hint.model_fields[item].annotation
        elif origin is dict:
            hint = typing.get_args(hint)[1]
        elif origin is list and isinstance(item, int):
            hint = typing.get_args(hint)[0]
        else:
            break
        parts.append(str(item))
    return ".".join(parts), hint


def _describe(cls: type[BaseModel], errors: list[dict[str, Any]]) -> str:
    """One line for the first key that failed; a union's failures become 'is not X or Y'."""
    key, hint = _field_path(cls, errors[0]["loc"])
    same_key = [e for e in errors if _field_path(cls, e["loc"])[0] == key]
    error, value = same_key[0], same_key[0]["input"]
    kind = error["type"]
    where = f"{key}: " if key else ""
    if kind == "extra_forbidden":
        parent, parent_hint = _field_path(cls, error["loc"][:-1])
        unknown = ".".join([*filter(None, [parent]), str(error["loc"][-1])])
        return f"unknown key {unknown}; {parent or 'the top level'} allows: {sorted(parent_hint.model_fields)}"
    if kind == "missing":
        return f"{key}: required"
    if kind == "literal_error":
        return f"{where}{value!r} is not one of {list(typing.get_args(hint))}"
    if all(e["type"] in _EXPECTED for e in same_key):
        expected = " or ".join(dict.fromkeys(_EXPECTED[e["type"]] for e in same_key))
        return f"{where}{value!r} is not {expected}"
    message = re.sub(r"^\w+ should", "must", error["msg"].removeprefix("Value error, ")).replace(
        " after validation", ""
    )
    if isinstance(hint, type) and issubclass(hint, BaseModel):  # a rule across the fields of a section
        return f"{where}{message}"
    return f"{where}{message}, got {value!r}"


def parse(cls: type[SectionT], values: dict[str, Any]) -> SectionT:
    """``cls`` validated from nested ``values``; ConfigError with one line naming the key otherwise."""
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(_describe(cls, exc.errors())) from None


def read_record(cls: type[SectionT], path: str, what: str) -> SectionT | None:
    """``cls`` validated from the JSON file at ``path`` (local or URI; its object keys may stand for numbers); None
    where there is none. ConfigError ``<path> is not <what> this raywright reads (<the field, or why it is not
    JSON>)`` otherwise."""
    data = storage.read_if_exists(path)
    if data is None:
        return None
    try:
        return cls.model_validate_json(data)
    except ValidationError as exc:
        errors = exc.errors()
        unreadable = (
            f"not JSON: {errors[0]['ctx']['error']}" if errors[0]["type"] == "json_invalid" else _describe(cls, errors)
        )
        raise ConfigError(f"{path} is not {what} this raywright reads ({unreadable})") from None


def replace(section: SectionT, **changes: Any) -> SectionT:
    """A copy of ``section`` with ``changes``, validated again (pydantic's model_copy does not)."""
    return parse(type(section), {**section.model_dump(), **changes})


class _YAML12Loader(yaml.SafeLoader):
    """Reads ``1e-3`` as a number, as YAML 1.2 does (YAML 1.1 wants ``1.0e-3``, or it is a string)."""


_YAML12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def load_yaml(text: str, where: str) -> Any:
    """Parse YAML text; ConfigError naming ``where`` and the line if it is malformed."""
    try:
        return yaml.load(text, Loader=_YAML12Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML{at}: {problem}") from None


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Apply ``section.key=value`` to the nested dict ``tree``; the value is parsed as YAML."""
    path, sep, raw = override.partition("=")
    if not sep or not path:
        raise ConfigError(f"override {override!r} must look like section.key=value")
    *parents, leaf = path.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {part} is not a section")
    node[leaf] = load_yaml(raw, f"override {override!r}") if raw else ""


def read_tree(path: str | None, overrides: list[str], what: str) -> dict[str, Any]:
    """The mapping in the YAML file ``path`` (none: empty) with ``key=value`` overrides applied.

    ``what`` names the kind of file in errors ("recipe", "serve config", "sweep config").
    """
    tree: dict[str, Any] = {}
    if path:
        try:
            text = storage.read_bytes(path).decode()
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {what} {path}: {error_reason(exc)}") from None
        tree = load_yaml(text, path) or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: a {what} must be a mapping of keys")
    for override in overrides:
        apply_override(tree, override)
    return tree


def shipped_names(directory: Path) -> list[str]:
    """The names of the YAML files shipped in ``directory`` (package data)."""
    return sorted(p.stem for p in directory.glob("*.yaml"))


def find_config_file(name: str, directory: Path, what: str) -> str:
    """A YAML path or URI as given, or the name of a file shipped in ``directory`` (``tiny`` -> tiny.yaml there).

    ``what`` names the kind of file in errors ("recipe", "sweep").
    """
    if "://" in name:
        return name
    path = Path(name).expanduser()
    if path.suffix not in (".yaml", ".yml"):
        if path.is_file() and path.parent != Path():  # a name alone is a shipped file's, whatever is here
            raise ConfigError(f"--config: {name} is not a YAML file (a {what} path ends in .yaml or .yml)")
        path = directory / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"--config: no {what} {name!r} (looked for {path}); shipped {what}s: {shipped_names(directory)}"
        )
    return str(path)


def _type_label(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Annotated:
        return _type_label(typing.get_args(hint)[0])
    if origin is Literal:
        return "|".join(str(v) for v in typing.get_args(hint))
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_label(h) for h in typing.get_args(hint))
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_label(h) for h in typing.get_args(hint))}]"
    return getattr(hint, "__name__", str(hint))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default is PydanticUndefined else field.default
    return f"default {value}" if value != "" else 'default ""'


def fields_help(cls: type[BaseModel], prefix: str = "") -> str:
    """Every field of ``cls``, sections included, as ``key  type = default`` and its description."""
    lines = []
    for name, field in cls.model_fields.items():
        hint = field.annotation
        if isinstance(hint, type) and issubclass(hint, BaseModel):
            lines += ["", f"{prefix}{name}:", fields_help(hint, f"{prefix}{name}.")]
            continue
        lines.append(f"  {prefix}{name}  ({_type_label(hint)}, {_default(field)})")
        lines.append(f"      {' '.join((field.description or '').split())}")
    return "\n".join(lines)
