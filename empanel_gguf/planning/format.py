"""Units and the one way sizes are written for people: format_bytes(3 << 30) -> "3.00 GiB"."""

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

_UNITS = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def format_bytes(n, unit=None, missing="?"):
    """n bytes in the largest binary unit it reaches (or `unit`), two decimals; `missing` for None."""
    if n is None:
        return missing
    n = float(n)
    if unit is None:
        unit = next((name for name, size in _UNITS if abs(n) >= size), "B")
    if unit == "B":
        return f"{int(n)} B"
    return f"{n / dict(_UNITS)[unit]:.2f} {unit}"
