"""Settings read from the environment (``HYBRIDL_*``): one parser, one kind of error."""
import os

__all__ = ["env_int"]


def env_int(name, default, minimum, meaning):
    """The integer in environment variable ``name`` (``default`` when unset or blank).

    Args:
        name (str): the variable, e.g. ``"HYBRIDL_NUM_WORKERS"``.
        default (int): the value when it is not set.
        minimum (int): the smallest value accepted.
        meaning (str): what the number counts, for the error (``"worker threads per device"``).

    Raises:
        ValueError: not an integer >= ``minimum``; the message names the variable, its value,
            what was expected and the default.
    """
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        n = None
    if n is None or n < minimum:
        raise ValueError(f"{name}={v!r}: expected an integer >= {minimum} ({meaning}), or unset: "
                         f"{default}")
    return n
