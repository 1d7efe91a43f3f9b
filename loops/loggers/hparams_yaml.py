"""A small YAML writer and reader for ``hparams.yaml`` (no PyYAML dependency).

``dump_yaml`` writes nested mappings and lists of ``None``, bools, ints, floats and strings
in block style; ``load_yaml`` reads that subset back, so ``load_yaml(dump_yaml(x)) == x``
(tuples come back as lists; NaN as NaN). The output is also standard YAML that PyYAML's
``safe_load`` reads to the same values: strings that could be taken for another type are
double-quoted, and floats always carry a ``.`` (``1.0e-05``), as YAML 1.1 needs.
Hyper-parameter values of other types are turned into plain data first (``to_plain``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["dump_yaml", "load_yaml", "to_plain"]

# Plain (unquoted) strings: a letter or "_" first, then a conservative character set.
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_./+-]*(?: [A-Za-z0-9_./+-]+)*")
# Words that YAML 1.1 or 1.2 read as booleans or null: always quoted.
_RESERVED = {"y", "n", "yes", "no", "true", "false", "on", "off", "null", "nan", "inf"}
_INT = re.compile(r"[-+]?[0-9]+")
_FLOAT = re.compile(
    r"[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"  # 1.5, .5, 1.0e-05
    r"|[-+]?[0-9]+[eE][-+]?[0-9]+"  # 1e-05 (not written here; read for convenience)
)
# Printable characters that YAML (and str.splitlines) would still take as a line break.
_LINE_BREAKS_AND_BOM = {0x2028, 0x2029, 0xFEFF}
_SPECIAL_FLOATS = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}


def to_plain(value: Any) -> Any:
    """``value`` as YAML-able data: mappings, lists and scalars.

    Namespaces and dataclass instances become mappings, tuples and sets lists, one-element
    tensors and numpy scalars numbers, other tensors nested lists; anything else its name
    (functions, classes) or ``str()``.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k if _is_scalar(k) else str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((to_plain(v) for v in value), key=repr)
    if hasattr(value, "tolist"):  # tensors, numpy arrays and numpy scalars
        return to_plain(value.tolist())
    return getattr(value, "__qualname__", None) or str(value)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


# --------------------------------------------------------------------------- writing


def _printable(code: int) -> bool:
    """Whether YAML allows code point ``code`` as is inside a double-quoted string."""
    return (
        0x20 <= code <= 0x7E
        or 0xA0 <= code <= 0xD7FF
        or 0xE000 <= code <= 0xFFFD
        or 0x10000 <= code <= 0x10FFFF
    )


def _escape(text: str) -> str:
    out = []
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif code in _LINE_BREAKS_AND_BOM:
            out.append(f"\\u{code:04x}")
        elif _printable(code):
            out.append(ch)
        elif code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:  # pragma: no cover - every code point is covered above
            out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def _format_float(value: float) -> str:
    if math.isnan(value):
        return ".nan"
    if math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    text = repr(value)
    mantissa, e, exponent = text.partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    return mantissa + (e + exponent if e else "")


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _format_float(value)
    if isinstance(value, str):
        plain = _PLAIN.fullmatch(value) and value.lower() not in _RESERVED
        return value if plain else _escape(value)
    raise TypeError(f"cannot write {type(value).__name__} {value!r} to YAML; use to_plain()")


def _emit(value: Any, indent: int, lines: list[str]) -> None:
    pad = " " * indent
    if isinstance(value, Mapping):
        for key, item in value.items():
            head = f"{pad}{_scalar(key)}:"
            if isinstance(item, (Mapping, list, tuple)) and item:
                lines.append(head)
                _emit(item, indent + 2, lines)
            else:
                lines.append(f"{head} {_inline(item)}")
    else:
        for item in value:
            if isinstance(item, (Mapping, list, tuple)) and item:
                lines.append(f"{pad}-")
                _emit(item, indent + 2, lines)
            else:
                lines.append(f"{pad}- {_inline(item)}")


def _inline(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, (list, tuple)):
        return "[]"
    return _scalar(value)


def dump_yaml(data: Any) -> str:
    """``data`` (a mapping, list or scalar of plain values) as block-style YAML text."""
    if isinstance(data, (Mapping, list, tuple)) and data:
        lines: list[str] = []
        _emit(data, 0, lines)
        return "\n".join(lines) + "\n"
    return _inline(data) + "\n"


# --------------------------------------------------------------------------- reading

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", '"': '"', "\\": "\\", "/": "/", " ": " "}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


def _unquote(text: str, line_no: int) -> tuple[str, str]:
    """Parse the quoted string at the start of ``text``; return it and the rest of the line."""
    quote = text[0]
    out, i = [], 1
    while i < len(text):
        ch = text[i]
        if quote == "'" and ch == "'":
            if text[i + 1 : i + 2] == "'":
                out.append("'")
                i += 2
                continue
            return "".join(out), text[i + 1 :]
        if quote == '"' and ch == '"':
            return "".join(out), text[i + 1 :]
        if quote == '"' and ch == "\\":
            code = text[i + 1 : i + 2]
            if code in _HEX_ESCAPES:
                width = _HEX_ESCAPES[code]
                out.append(chr(int(text[i + 2 : i + 2 + width], 16)))
                i += 2 + width
                continue
            if code not in _ESCAPES:
                raise ValueError(f"line {line_no}: unknown escape \\{code} in {text!r}")
            out.append(_ESCAPES[code])
            i += 2
            continue
        out.append(ch)
        i += 1
    raise ValueError(f"line {line_no}: unterminated string {text!r}")


def _parse_scalar(text: str, line_no: int) -> Any:
    text = text.strip()
    if text[:1] in ("'", '"'):
        value, rest = _unquote(text, line_no)
        if rest.strip():
            raise ValueError(f"line {line_no}: unexpected {rest.strip()!r} after a string")
        return value
    if text in ("", "~", "null", "Null", "NULL"):
        return None
    if text in ("true", "True", "TRUE"):
        return True
    if text in ("false", "False", "FALSE"):
        return False
    if text == "{}":
        return {}
    if text == "[]":
        return []
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    if text.lower() in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[text.lower()]
    return text


def _split_key(text: str, line_no: int) -> tuple[Any, str] | None:
    """``(key, rest)`` when ``text`` is ``key: rest`` / ``key:``; ``None`` otherwise."""
    if text[:1] in ("'", '"'):
        key, rest = _unquote(text, line_no)
        if rest == ":" or rest.startswith(": "):
            return key, rest[1:].strip()
        return None
    match = re.match(r"([^:#]*?[^\s:]):(?: |$)", text)
    if match is None:
        return None
    return _parse_scalar(match.group(1), line_no), text[match.end() :].strip()


def _parse_block(lines: list[tuple[int, int, str]], pos: int, indent: int) -> tuple[Any, int]:
    """Parse the block of lines at ``indent`` starting at ``pos``; return it and the next pos."""
    line_no, _, text = lines[pos]
    is_seq = text == "-" or text.startswith("- ")
    result: Any = [] if is_seq else {}
    while pos < len(lines):
        line_no, ind, text = lines[pos]
        if ind < indent:
            break
        if ind > indent:
            raise ValueError(f"line {line_no}: unexpected indentation")
        if is_seq:
            if not (text == "-" or text.startswith("- ")):
                raise ValueError(f"line {line_no}: expected a '- ' list item, got {text!r}")
            rest = text[1:].strip()
            pos += 1
            if rest:
                result.append(_parse_scalar(rest, line_no))
            else:
                value, pos = _nested(lines, pos, indent, line_no)
                result.append(value)
        else:
            split = _split_key(text, line_no)
            if split is None:
                raise ValueError(f"line {line_no}: expected 'key: value', got {text!r}")
            key, rest = split
            pos += 1
            if rest:
                result[key] = _parse_scalar(rest, line_no)
            else:
                result[key], pos = _nested(lines, pos, indent, line_no, allow_same=True)
    return result, pos


def _nested(lines, pos, indent, line_no, allow_same=False):
    """The block under a ``key:`` or ``-`` line (``None`` when nothing is nested)."""
    if pos < len(lines):
        _, ind, text = lines[pos]
        is_item = text == "-" or text.startswith("- ")
        if ind > indent or (allow_same and ind == indent and is_item):
            return _parse_block(lines, pos, ind)
    return None, pos


def load_yaml(text: str) -> Any:
    """Read YAML text in the block-style subset that ``dump_yaml`` writes.

    Comments on their own lines, blank lines and a leading ``---`` are skipped; flow
    collections other than ``{}`` and ``[]``, anchors and multi-line scalars are not supported.
    """
    lines = []
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#") or (not lines and stripped == "---"):
            continue
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise ValueError(f"line {number}: tabs are not allowed in indentation")
        lines.append((number, len(raw) - len(raw.lstrip(" ")), stripped))
    if not lines:
        return None
    first_no, first_indent, first = lines[0]
    is_item = first == "-" or first.startswith("- ")
    if len(lines) == 1 and _split_key(first, first_no) is None and not is_item:
        return _parse_scalar(first, first_no)
    value, pos = _parse_block(lines, 0, first_indent)
    if pos != len(lines):
        raise ValueError(f"line {lines[pos][0]}: unexpected indentation")
    return value
