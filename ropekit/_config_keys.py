"""Keys of a configuration read back from a mapping: renamed keys mapped, unknown keys refused or ignored.

A configuration a user types (command-line options, a config file, keyword arguments) must name only fields that
exist: a typo is an error. A configuration read back from a saved run or checkpoint may come from another ropekit
version: its keys renamed since then are mapped to their new names, and keys this version does not know are ignored
after one warning that names them, so that the run still loads.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Iterable, Mapping

__all__ = ["known_keys"]


def known_keys(d: Mapping[str, Any], fields: Iterable[str], renamed: Mapping[str, str], *, source: str,
               strict: bool, what: str = "option") -> Dict[str, Any]:
    """``d`` with renamed keys under their new names and, when it was saved (not ``strict``), unknown keys dropped.

    Args:
        d: the mapping read (left unchanged).
        fields: the names the configuration has.
        renamed: old name -> new name for keys moved since configurations were first written; a key present under
            both names keeps the new one.
        source: where ``d`` comes from, the start of every message (e.g. ``"config.json"``).
        strict: ``True`` for options a user typed (an unknown key is an error); ``False`` for a saved run or
            checkpoint (one warning naming the unknown keys, which are ignored).
        what: what a key is called in the messages, e.g. ``"option"`` or ``"field"``.

    Returns:
        a new dict holding only known keys.

    Raises:
        ValueError: ``strict`` and a key that is neither a field nor a renamed one (every such key is named).
    """
    out = dict(d)
    for old, new in renamed.items():
        if old in out and new not in out:
            out[new] = out.pop(old)
        out.pop(old, None)
    unknown = sorted(set(out) - set(fields))
    if unknown:
        if strict:
            raise ValueError(f"{source}: unknown {what}(s) {', '.join(unknown)}")
        warnings.warn(f"{source}: ignoring unknown {what}(s) {', '.join(unknown)} (written by another ropekit "
                      f"version?)", stacklevel=3)
        out = {k: v for k, v in out.items() if k not in unknown}
    return out
