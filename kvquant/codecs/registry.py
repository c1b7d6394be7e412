"""The open codec registry: codecs added without editing kvquant.

Two ways in, one lookup (``get_codec`` tries the built-in families first, then these):

* ``register_codec(name, factory)`` in the running process; ``factory(dim, **options)`` returns a
  :class:`~kvquant.codecs.base.Codec`. Spawned worker processes and Dask workers do not see a
  registration made in the parent: for them, install the codec with an entry point.
* an entry point in the group ``kvquant.codecs`` (``name = "package.module:factory"`` in the
  codec package's metadata), loaded the first time a name is not found, in any process.

A name is what a spec starts with (``mycodec`` in ``mycodec:opt=1`` or ``mycodec@center``): a
lower-case letter, then letters, digits, ``_``, ``-``, ``.`` or ``+``; names the built-in families
parse (``tq4``, ``polar3``, ``kv8-g32``, ``q4_0+rot`` ...) are theirs.
"""
import re

ENTRY_POINT_GROUP = "kvquant.codecs"
_NAME = re.compile(r"[a-z][a-z0-9_.+-]*")

_registered = {}            # name -> factory, this process
_entry_points = None        # name -> EntryPoint, read once


def _check_name(name):
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"codec name {name!r}: a lower-case letter, then letters, digits, "
                         "'_', '-', '.' or '+' (no ':', ',', '/', '@' or '=': they are the "
                         "spec grammar's)")


def register_codec(name, factory, replace=False):
    """Make ``name`` a codec spec in this process.

    Parameters
    ----------
    name : str
        The spec's base name (see the module docstring).
    factory : callable
        ``factory(dim, **options) -> Codec``: the options are those of the spec
        (``name:key=value,...``, values as strings; ``seed``, ``group`` and ``bits`` as ints)
        and the keywords of ``get_codec`` (e.g. ``nonfinite``).
    replace : bool
        Allow replacing an earlier registration of ``name``.

    Raises
    ------
    ValueError
        A malformed name, a name of a built-in family, or one already registered.
    """
    from kvquant.codecs import builtin_codec
    _check_name(name)
    if not callable(factory):
        raise ValueError(f"the factory of codec {name!r} must be callable, got {factory!r}")
    if _claimed_by_builtin(name, builtin_codec):
        raise ValueError(f"codec name {name!r} is a built-in codec's spec; choose another name")
    if name in _registered and not replace:
        raise ValueError(f"codec {name!r} is registered already (replace=True to replace it)")
    _registered[name] = factory


def unregister_codec(name):
    """Remove a registration made with :func:`register_codec` (KeyError when there is none)."""
    del _registered[name]


def _claimed_by_builtin(name, builtin_codec):
    try:
        return builtin_codec(name, 64, {}) is not None
    except (ValueError, TypeError):
        return True             # a family parses the name and refuses its options or width


def _installed():
    global _entry_points
    if _entry_points is None:
        from importlib.metadata import entry_points
        _entry_points = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return _entry_points


def registered_factory(name):
    """The factory of ``name`` (registered here or installed as an entry point), or None."""
    if name in _registered:
        return _registered[name]
    ep = _installed().get(name)
    if ep is None:
        return None
    try:
        factory = ep.load()
    except Exception as exc:  # noqa: BLE001 - any import failure of a plug-in, named
        raise ValueError(f"codec {name!r}: its entry point {ep.value!r} (group "
                         f"{ENTRY_POINT_GROUP}) fails to load: {exc}") from None
    _registered[name] = factory
    return factory


def process_registrations():
    """``{name: factory}`` of the codecs registered in this process with :func:`register_codec`
    (entry points excluded: every process finds those itself)."""
    installed = _installed()
    return {name: f for name, f in _registered.items() if name not in installed}


def plugin_names():
    """Names registered in this process or installed as entry points, sorted."""
    return sorted(set(_registered) | set(_installed()))
