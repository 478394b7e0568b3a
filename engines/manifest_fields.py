"""Typed reads of an engine manifest's JSON (`engines.manifest`): each read checks one field's
type and bounds and, when it fails, names where (e.g. `manifest.limits.max_seq_len`)."""
from __future__ import annotations

from typing import Any

from kiln.dtypes import torch_dtype


class ManifestError(ValueError):
    """The manifest's JSON does not have the shape this Kiln writes; the message names the field."""


class Fields:
    """Typed reads of one JSON object, each naming where it failed (e.g. `manifest.limits.max_seq_len`)."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ManifestError(f"{where} must be an object, got {type(data).__name__}")
        self.data, self.where = data, where

    def _get(self, key: str, optional: bool = False) -> Any:
        if key not in self.data:
            if optional:
                return None
            raise ManifestError(f"{self.where} has no {key!r}")
        return self.data[key]

    def _bad(self, key: str, what: str) -> ManifestError:
        return ManifestError(f"{self.where}.{key} must be {what}, got {self.data.get(key)!r}")

    def integer(self, key: str, low: int = 1, default: int | None = None) -> int:
        if default is not None and key not in self.data:
            return default
        value = self._get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise self._bad(key, f"an integer >= {low}")
        return value

    def string(self, key: str, optional: bool = False) -> str | None:
        value = self._get(key, optional)
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise self._bad(key, "a string")
        return value

    def dtype(self, key: str) -> str:
        name = self.string(key)
        try:
            torch_dtype(name)
        except ValueError:
            raise self._bad(key, "a torch dtype name") from None
        return name

    def strs(self, key: str) -> tuple[str, ...]:
        value = self._get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._bad(key, "a list of strings")
        return tuple(value)

    def shape(self, key: str, symbols: bool = False) -> tuple:
        value = self._get(key)
        ok = (int, str) if symbols else (int,)
        if not isinstance(value, list) or not all(isinstance(d, ok) and not isinstance(d, bool) for d in value):
            raise self._bad(key, "a list of dims")
        return tuple(value)

    def inputs(self, key: str) -> dict[str, str | None]:
        value = self.obj(key).data
        if not all(v is None or isinstance(v, str) for v in value.values()):
            raise self._bad(key, "an object of tensor names")
        return dict(value)

    def obj(self, key: str, optional: bool = False) -> Fields | None:
        value = self._get(key, optional)
        if value is None and optional:
            return None
        return Fields(value, f"{self.where}.{key}")

    def objs(self, key: str) -> list[tuple[str, Fields]]:
        inner = self.obj(key)
        return [(name, inner.obj(name)) for name in inner.data]

    def items(self) -> list[tuple[str, StrList]]:
        return [(k, StrList(v, f"{self.where}.{k}")) for k, v in self.data.items()]

    def list_of_objs(self, key: str) -> list[Fields]:
        value = self._get(key)
        if not isinstance(value, list):
            raise self._bad(key, "a list")
        return [Fields(v, f"{self.where}.{key}[{i}]") for i, v in enumerate(value)]


class StrList:
    """A JSON value that should be a list of strings (a target's kernel keys)."""

    def __init__(self, data: Any, where: str) -> None:
        self.data, self.where = data, where

    def strs_value(self) -> tuple[str, ...]:
        if not isinstance(self.data, list) or not all(isinstance(v, str) for v in self.data):
            raise ManifestError(f"{self.where} must be a list of strings, got {self.data!r}")
        return tuple(self.data)
