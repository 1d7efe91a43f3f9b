"""Bound what DCP's ``.metadata`` pickle expands to, before it is unpickled.

The pickle is scanned opcode by opcode (``check_expansion``: nothing built, nothing called)
for what it would expand to, every reference to a memoized container counted once per use
as if the structure were a tree: at most ``MAX_METADATA_VALUES`` values, or one per byte of
the file where that is more. Otherwise a few kilobytes could describe a tuple nested 30 deep
with each level holding the one below twice: unpickling it as a dict key hashes it
``2**30`` times, and the checks of ``dcp_index`` (or an error message's ``repr``) would walk
it as often.
"""

from __future__ import annotations

import pickle
from typing import Any

from .codec import CheckpointError

__all__ = ["MAX_METADATA_VALUES", "check_expansion"]

#: The most values the ``.metadata`` pickle may expand to (``check_expansion``), every
#: reference to a memoized container counted once per use, unless the file has more bytes
#: than this: a pickle that shares no container expands to at most one value per byte (each
#: value takes an opcode), so the bound never refuses one, and it keeps hashing and walking
#: the metadata linear in its size. DCP writes about 70 values per tensor chunk: 4 million
#: values is about 57,000 chunks, past which the file's size is the bound.
MAX_METADATA_VALUES = 4_000_000


class _Garbled(Exception):
    """Raised by ``_expanded`` where the bytes are not a pickle it can follow."""


def _codes(spec: str) -> dict[int, int]:
    """``{opcode: width}`` of the space-separated ``NAME:width`` (or ``NAME``, width 0)."""
    pairs = (item.partition(":") for item in spec.split())
    return {getattr(pickle, name)[0]: int(width or 0) for name, _, width in pairs}


# Opcodes that push one value holding no other (a number, a string, a global, a buffer),
# by how their argument is read: a fixed number of bytes; a length of that many bytes,
# then as many bytes; or a line (text protocol 0).
_ATOM_FIXED = _codes(
    "BININT:4 BININT1:1 BININT2:2 BINFLOAT:8 NONE NEWTRUE NEWFALSE EXT1:1 EXT2:2 EXT4:4 NEXT_BUFFER"
)
_ATOM_SIZED = _codes(
    "LONG1:1 SHORT_BINSTRING:1 SHORT_BINBYTES:1 SHORT_BINUNICODE:1 LONG4:4 BINSTRING:4 "
    "BINBYTES:4 BINUNICODE:4 BINBYTES8:8 BYTEARRAY8:8 BINUNICODE8:8"
)
_ATOM_LINE = set(_codes("INT LONG STRING UNICODE FLOAT PERSID"))
# Opcodes that make a new container of the values above the topmost mark (OBJ: a call).
_FROM_MARK = set(_codes("TUPLE LIST DICT FROZENSET OBJ"))
# Opcodes that add the values above the topmost mark to the container below it.
_ADD_FROM_MARK = set(_codes("APPENDS SETITEMS ADDITEMS"))
_MEMOIZE = pickle.MEMOIZE[0]
_BINGET, _LONG_BINGET, _GET = pickle.BINGET[0], pickle.LONG_BINGET[0], pickle.GET[0]
_BINPUT, _LONG_BINPUT, _PUT = pickle.BINPUT[0], pickle.LONG_BINPUT[0], pickle.PUT[0]
_EMPTY = set(_codes("EMPTY_TUPLE EMPTY_LIST EMPTY_DICT EMPTY_SET"))
_TUPLE1, _TUPLE2, _TUPLE3 = pickle.TUPLE1[0], pickle.TUPLE2[0], pickle.TUPLE3[0]
_MARK, _POP, _POP_MARK, _DUP = pickle.MARK[0], pickle.POP[0], pickle.POP_MARK[0], pickle.DUP[0]
_CALL = set(_codes("NEWOBJ REDUCE"))
_NEWOBJ, _OBJ, _EMPTY_TUPLE = pickle.NEWOBJ[0], pickle.OBJ[0], pickle.EMPTY_TUPLE[0]
_NEWOBJ_EX, _BUILD = pickle.NEWOBJ_EX[0], pickle.BUILD[0]
_APPEND, _SETITEM = pickle.APPEND[0], pickle.SETITEM[0]
_GLOBAL, _STACK_GLOBAL, _INST = pickle.GLOBAL[0], pickle.STACK_GLOBAL[0], pickle.INST[0]
_BINPERSID, _READONLY_BUFFER = pickle.BINPERSID[0], pickle.READONLY_BUFFER[0]
_FRAME, _PROTO, _STOP = pickle.FRAME[0], pickle.PROTO[0], pickle.STOP[0]


def check_expansion(data: bytes, path: str) -> None:
    """Refuse (``CheckpointError`` naming the folder ``path``) the ``.metadata`` pickle
    ``data`` if it expands to more than ``MAX_METADATA_VALUES`` values (or one per byte of
    ``data``, where that is more), every reference to a memoized container counted once
    per use; or if it cannot be followed (truncated, garbled, or built as no pickler
    writes DCP's metadata: see ``_expanded``). Reads the opcodes only and keeps one number
    per value on the unpickler's stack and memo: linear in ``len(data)``, whatever the
    pickle would expand to."""
    limit = max(MAX_METADATA_VALUES, len(data))
    try:
        _expanded(data, limit)
    except _TooLarge:
        raise CheckpointError(
            f"{path}: refused to read .metadata: its pickle expands to more than {limit:,} "
            "values (each reference to a shared container counted once per use: a few "
            "kilobytes can describe an exponentially large structure, which unpickling, "
            "hashing or walking would not finish); DCP writes no such metadata"
        ) from None
    except _Garbled as err:
        raise CheckpointError(f"{path}: refused to read .metadata: {err}") from None
    except IndexError:
        raise CheckpointError(
            f"{path}: refused to read .metadata: its pickle is truncated or garbled (it "
            "reads past its end or its stack)"
        ) from None
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(
            f"{path}: refused to read .metadata: not a pickle that can be read "
            f"({type(err).__name__} following its opcodes)"
        ) from None


class _TooLarge(Exception):
    """Raised by ``_expanded`` when a value expands past the limit."""


def _placed(values: list[Any], limit: int) -> int:
    """The expanded size of ``values`` (``_expanded``'s stack values), now placed in a
    container: each open container among them is marked placed (it may no longer grow).
    ``_TooLarge`` past ``limit``: so no size grows much past it (no huge ints)."""
    total = 0
    for value in values:
        if value.__class__ is int:
            total += value
        else:
            value[1] = True
            total += value[0]
    if total > limit:
        raise _TooLarge
    return total


def _grow(node: Any, by: int, limit: int) -> None:
    """Add ``by`` values to the open container ``node`` (``_expanded``)."""
    if node.__class__ is int or node[1]:
        raise _Garbled(
            "its pickle adds to a value that is not an open container (a built value, or "
            "one already placed in another: a cycle or out-of-order pickle, which DCP's "
            "metadata never is)"
        )
    node[0] += by
    if node[0] > limit:
        raise _TooLarge


def _expanded(data: bytes, limit: int) -> int:
    """The number of values the pickle ``data`` expands to, every reference to a memoized
    container counted once per use (``_TooLarge`` past ``limit``). Follows the unpickler's
    stack, marks and memo, keeping for each value its expanded size: an int for a value
    that no longer changes (a number, string, global, tuple, a call's result), a list
    ``[size, placed]`` for a container the pickle may still fill (a list, dict or set, an
    object made by NEWOBJ, which BUILD gives its state). Counting sizes as they are built
    holds because a pickler writes each container whole before placing it in another:
    ``_Garbled`` where a pickle fills a container already placed (only a cycle does that,
    and DCP's metadata has none), BUILDs other than a new object (it would set attributes
    on a class or a shared value), or fails on its stack or bytes. Flat loop, branches
    ordered by how often DCP's metadata holds each opcode (it runs once per opcode)."""
    stack: list[Any] = []
    push = stack.append
    marks: list[int] = []
    memo: dict[int, Any] = {}
    at = 0
    while True:  # past the end (no STOP, or an argument cut short): an IndexError here
        op = data[at]
        at += 1
        if op == _MEMOIZE:
            memo[len(memo)] = stack[-1]
        elif op == _BINGET:
            push(memo[data[at]])
            at += 1
        elif op == _LONG_BINGET:
            push(memo[int.from_bytes(data[at : at + 4], "little")])
            at += 4
        elif op == _TUPLE1:  # inlined ``_placed`` (adding 1 cannot pass the limit fast)
            value = stack[-1]
            if value.__class__ is not int:
                value[1] = True
                value = value[0]
            stack[-1] = value + 1
        elif op == _MARK:
            marks.append(len(stack))
        elif op in _ATOM_FIXED:
            at += _ATOM_FIXED[op]
            push(1)
        elif op in _EMPTY:
            push(1 if op == _EMPTY_TUPLE else [1, False])
        elif op in _CALL:
            args = stack.pop()
            func = stack[-1]
            if args.__class__ is int and func.__class__ is int and args + func < limit:
                size = 1 + args + func  # the common case, inlined
            else:
                size = 1 + _placed([func, args], limit)
            stack[-1] = [size, False] if op == _NEWOBJ else size
        elif op == _BUILD:
            state = stack.pop()
            _grow(stack[-1], _placed([state], limit), limit)
        elif op in _ADD_FROM_MARK:
            start = marks.pop()
            items = stack[start:]
            del stack[start:]
            _grow(stack[-1], _placed(items, limit), limit)
        elif op in _ATOM_SIZED:
            width = _ATOM_SIZED[op]
            at += width + int.from_bytes(data[at : at + width], "little")
            push(1)
        elif op == _STACK_GLOBAL:
            del stack[-2:]
            push(1)
        elif op in _FROM_MARK:
            start = marks.pop()
            size = 1 + _placed(stack[start:], limit)
            del stack[start:]
            push([size, False] if op == _OBJ else size)
        elif op in (_TUPLE2, _TUPLE3):
            width = 2 if op == _TUPLE2 else 3
            if len(stack) < width:
                raise _Garbled("a tuple of more values than the stack holds")
            stack[-width:] = [1 + _placed(stack[-width:], limit)]
        elif op == _APPEND:
            value = stack.pop()
            _grow(stack[-1], _placed([value], limit), limit)
        elif op == _SETITEM:
            items = stack[-2:]
            del stack[-2:]
            _grow(stack[-1], _placed(items, limit), limit)
        elif op == _BINPUT:
            memo[data[at]] = stack[-1]
            at += 1
        elif op == _LONG_BINPUT:
            memo[int.from_bytes(data[at : at + 4], "little")] = stack[-1]
            at += 4
        elif op in _ATOM_LINE:
            at = data.index(b"\n", at) + 1
            push(1)
        elif op in (_PUT, _GET):
            line = data.index(b"\n", at)
            index = int(data[at:line])
            at = line + 1
            if op == _PUT:
                memo[index] = stack[-1]
            else:
                push(memo[index])
        elif op == _GLOBAL:
            at = data.index(b"\n", data.index(b"\n", at) + 1) + 1
            push(1)
        elif op == _INST:
            at = data.index(b"\n", data.index(b"\n", at) + 1) + 1
            start = marks.pop()
            size = 2 + _placed(stack[start:], limit)
            del stack[start:]
            push([size, False])
        elif op == _NEWOBJ_EX:
            size = 1 + _placed(stack[-3:], limit)
            del stack[-2:]
            stack[-1] = [size, False]
        elif op == _DUP:
            push(stack[-1])
        elif op == _POP:
            if stack and (not marks or len(stack) > marks[-1]):
                stack.pop()
            else:
                marks.pop()
        elif op == _POP_MARK:
            del stack[marks.pop() :]
        elif op == _BINPERSID:
            stack[-1] = 1
        elif op == _READONLY_BUFFER:
            if stack[-1].__class__ is not int:
                raise _Garbled("a buffer opcode on a container")
        elif op == _FRAME:
            at += 8
        elif op == _PROTO:
            at += 1
        elif op == _STOP:
            if len(stack) != 1 or marks:
                raise _Garbled("the pickle stops with a stack of other than one value")
            return _placed(stack, limit)
        else:
            raise _Garbled(f"unknown pickle opcode {op:#04x} at byte {at - 1}")
