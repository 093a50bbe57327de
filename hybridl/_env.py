"""Settings read from the environment (``HYBRIDL_*``): one parser, one kind of error."""
import os

__all__ = ["env_int"]


def env_int(name, default, minimum, meaning, maximum=None):
    """The integer in environment variable ``name`` (``default`` when unset or blank).

    Args:
        name (str): the variable, e.g. ``"HYBRIDL_NUM_WORKERS"``.
        default (int): the value when it is not set.
        minimum (int): the smallest value accepted.
        meaning (str): what the number counts, for the error (``"worker threads per device"``).
        maximum (int or None): the largest value accepted (None: no bound).

    Raises:
        ValueError: not an integer in ``[minimum, maximum]``; the message names the variable,
            its value, what was expected and the default.
    """
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        n = None
    if n is None or n < minimum or (maximum is not None and n > maximum):
        want = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name}={v!r}: expected an integer {want} ({meaning}), or unset: "
                         f"{default}")
    return n
