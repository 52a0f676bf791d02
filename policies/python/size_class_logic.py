"""Decision logic of the `size-class` placement policy, free of any binding.

Segregated size classes: a request goes to one of three pools by the log2
size class ``[2**k, 2**(k+1))`` of its byte count, and every field of the
decision is a function of that class alone. So every decision is cacheable:
the engine memoizes it per (kind, size class, stream, phase) and calls this
(comparatively slow, Python) policy once per key instead of once per request.

Pools, with the defaults:

========  =====================  ==============================================
pool      requests               segments and splitting
========  =====================  ==============================================
small     < 1 MiB                2 MiB segments; split when >= 512 B remain
medium    1 MiB ... < 16 MiB     at least ``medium_segment`` (32 MiB); split
                                 when >= 1 MiB remains
large     >= 16 MiB              a segment of the request's size (rounded to
                                 2 MiB); split when >= 1 MiB remains; a cached
                                 block serves a request only if it wastes at
                                 most a quarter of the class's lower bound
========  =====================  ==============================================

Sizes round to 512 B. Keeping small, medium and large blocks in separate
segments stops long-lived small tensors from pinning large segments.

Configuration (``key=value`` pairs separated by commas or blanks):
``medium_from`` and ``large_from`` (powers of two, bytes or with a
KiB/MiB/GiB suffix) and ``medium_segment`` (bytes or with a suffix).
"""

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
U64_MAX = (1 << 64) - 1

POOL_NAMES = ["small", "medium", "large"]

ROUND_TO = 512
SEGMENT_ROUND = 2 * MIB

_UNITS = {"": 1, "B": 1, "KiB": KIB, "MiB": MIB, "GiB": GIB}


class Config:
    """The policy's parameters."""

    def __init__(self, medium_from=MIB, large_from=16 * MIB, medium_segment=32 * MIB):
        self.medium_from = medium_from
        self.large_from = large_from
        self.medium_segment = medium_segment


def parse_bytes(text):
    """Parses ``4096``, ``512KiB``, ``20MiB`` or ``2GiB``; raises ValueError."""
    text = text.strip()
    digits = len(text) - len(text.lstrip("0123456789"))
    number, unit = text[:digits], text[digits:].strip()
    if not number or unit not in _UNITS:
        raise ValueError(f"invalid size `{text}` (expected bytes, or a number with KiB, MiB or GiB)")
    value = int(number) * _UNITS[unit]
    if value > U64_MAX:
        raise ValueError(f"size `{text}` is out of range")
    return value


def parse_config(text):
    """Parses the ``lifecycle.init`` string into a Config; raises ValueError."""
    values = {}
    for item in text.replace(",", " ").replace(";", " ").split():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"`{item}` is not of the form key=value")
        if key in values:
            raise ValueError(f"key `{key}` is given twice")
        values[key] = value
    config = Config()
    for key, value in values.items():
        if key not in ("medium_from", "large_from", "medium_segment"):
            raise ValueError(f"unknown configuration key `{key}`")
        setattr(config, key, parse_bytes(value))
    for key in ("medium_from", "large_from"):
        v = getattr(config, key)
        if v == 0 or v & (v - 1):
            raise ValueError(f"{key} = {v} is not a power of two (a size-class boundary)")
    if not config.medium_from < config.large_from:
        raise ValueError("medium_from must be below large_from")
    return config


def size_class(nbytes):
    """The lower bound ``2**k`` of the log2 size class of ``nbytes`` (0 for 0)."""
    return 1 << (nbytes.bit_length() - 1) if nbytes > 0 else 0


def decide(config, nbytes):
    """The placement decision for a request of ``nbytes`` as a dict of the
    WIT record's fields (snake_case)."""
    low = size_class(nbytes)
    if low < config.medium_from:
        pool, segment_min, split, max_waste = 0, 2 * MIB, ROUND_TO, U64_MAX
    elif low < config.large_from:
        pool, segment_min, split, max_waste = 1, config.medium_segment, MIB, U64_MAX
    else:
        pool, segment_min, split, max_waste = 2, 0, MIB, low // 4
    return {
        "pool": pool,
        "round_to": ROUND_TO,
        "segment_min": segment_min,
        "segment_round": SEGMENT_ROUND,
        "split_min_remainder": split,
        "max_waste": max_waste,
        "cacheable": True,
    }
