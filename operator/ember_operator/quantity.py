"""Kubernetes quantities: parse them, print them the way the API server does, compare them.

The API server rewrites quantities into a canonical form ("1024Mi" comes back as "1Gi",
"1000m" as "1"); comparing desired against live objects by value, and rendering canonical
strings in the first place, is what lets a steady-state reconcile issue zero writes.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
_RE = re.compile(
    r"^(?P<num>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?P<suffix>[KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)
MIB = 2**20
MAX_EXPONENT = 30


class OutOfRange(ValueError):
    """A well-formed quantity whose exponent no spec can mean (see `parse`)."""


def parse(value: str | int | float) -> Fraction:
    """The exact value of a quantity; ValueError when it is not one."""
    if isinstance(value, int | float):
        return Fraction(value)
    match = _RE.match(value.strip())
    if not match:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    number = Fraction(match["num"])
    suffix = match["suffix"] or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    exponent = int(suffix[1:])
    # 10**exponent is exact big-integer arithmetic: "1e999999999" (which the API server's
    # pattern accepts) would hold the GIL for hours and stall the whole operator. Nothing a
    # spec sizes comes near 1e±30; int64, the API server's own range, ends near 9.2e18.
    if abs(exponent) > MAX_EXPONENT:
        raise OutOfRange(f"{value!r} is out of range (exponent beyond ±{MAX_EXPONENT})")
    return number * Fraction(10) ** exponent


def same(a: object, b: object) -> bool:
    """Equal as quantities when both parse, else plain equality."""
    if a == b:
        return True
    if isinstance(a, str | int) and isinstance(b, str | int) and not isinstance(a, bool):
        try:
            return parse(str(a)) == parse(str(b))
        except ValueError:
            return False
    return False


def format_bytes(n: int) -> str:
    """Canonical binary form the API server would print (largest exact suffix)."""
    for suffix, factor in sorted(_BINARY.items(), key=lambda kv: -kv[1]):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{suffix}"
    return str(n)


def ceil_mib(n: int | Fraction) -> int:
    """Round bytes up to a whole MiB (keeps rendered memory sizes short and canonical)."""
    mib = -(-Fraction(n) // MIB)
    return int(mib) * MIB


def format_cpu(value: Fraction) -> str:
    """Canonical decimal CPU form: whole cores as '2', else millicores as '500m'."""
    if value.denominator == 1:
        return str(value.numerator)
    milli = value * 1000
    return f"{-(-milli.numerator // milli.denominator)}m"
