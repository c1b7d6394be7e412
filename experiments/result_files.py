"""Result files read back: JSON a study did not just write (a path the user gives, a file of
another version), read only when it is a regular file and checked field by field before any
value is used, each error naming the file and the field.

A FIFO, a device or a folder is refused before anything is read from it (reading a FIFO waits
for a writer forever), as :mod:`kvquant.kvfile` refuses them. :class:`Fields` checks the fields
a reader uses: ``fields.get(meta, "meta", "text", OBJECT)`` is ``meta["text"]`` when it is an
object, else a ValueError such as ``run.json is not a frontier result of this version:
meta.text is 'pydoc', not an object``.
"""
import json
import os

from kvquant.kvfile.fileio import open_regular

__all__ = ["FLAG", "LIST", "NUMBER", "OBJECT", "TEXT", "WHOLE", "Fields", "is_kind",
           "read_json_file"]

NUMBER, WHOLE, TEXT = "a number", "a whole number", "a text"
OBJECT, LIST, FLAG = "an object", "a list", "true or false"

_TYPES = {NUMBER: (int, float), WHOLE: (int,), TEXT: (str,), OBJECT: (dict,), LIST: (list,),
          FLAG: (bool,)}


def read_json_file(path):
    """The JSON document in the regular file ``path``.

    Raises
    ------
    ValueError
        ``path`` cannot be opened, is not a regular file (a FIFO, a device, a folder: refused
        before it is read) or does not hold JSON; the message names it.
    """
    try:
        fd, kind = open_regular(path, os.O_RDONLY)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    if fd is None:
        raise ValueError(f"{path} is {kind}, not a JSON file: give a regular file")
    try:
        with os.fdopen(fd, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:       # not JSON, or not UTF-8
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def _shown(value):
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def is_kind(value, kind):
    """True when the JSON ``value`` is of ``kind`` (:data:`NUMBER`, :data:`WHOLE`, ...); a
    boolean is no number (JSON's ``true`` is not 1)."""
    if isinstance(value, bool) and kind != FLAG:
        return False
    return isinstance(value, _TYPES[kind])


class Fields:
    """The checks of one file's fields: errors read ``<path> is not <what> of this version:
    <field> ...``."""

    def __init__(self, path, what):
        self.path, self.what = path, what

    def error(self, problem):
        """The ValueError of ``problem`` (a field and what is wrong with it) in this file."""
        return ValueError(f"{self.path} is not {self.what} of this version: {problem}")

    def get(self, container, name, key, kind, required=True, null=False, least=None):
        """``container[key]`` when it is of ``kind`` (``name``: the container's dotted name in
        the file, ``""`` at the top) and, a number, at least ``least``; None when it is missing
        and not ``required``, or null and ``null`` allows it."""
        field = f"{name}.{key}" if name else key
        if key not in container:
            if required:
                raise self.error(f"{field} is missing (it must be {kind})")
            return None
        value = container[key]
        if value is None and null:
            return None
        if not is_kind(value, kind):
            raise self.error(f"{field} is {_shown(value)}, not {kind}")
        if least is not None and not value >= least:
            raise self.error(f"{field} is {_shown(value)}, not {kind} >= {least}")
        return value

    def each(self, container, name, keys, kind, required=True, null=False, least=None):
        """:meth:`get` of each of ``keys``."""
        return [self.get(container, name, key, kind, required, null, least) for key in keys]
