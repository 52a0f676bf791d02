"""A placement policy that raises on purpose (see README.md)."""
from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import host
from wit_world.imports.host import LogLevel
from wit_world.imports.types import PlacementDecision, PoolSpec

GUARDED = False


def reported(method):
    """The decorator `wasmem policy new --lang python` generates."""

    def call(*args):
        if not GUARDED:
            return method(*args)
        try:
            return method(*args)
        except Err:
            raise
        except BaseException as e:
            host.log(LogLevel.ERROR, f"{type(e).__name__}: {e}")
            raise

    return call


class Lifecycle(exports.Lifecycle):
    def name(self) -> str:
        return "raiser"

    def init(self, config: str) -> None:
        global GUARDED
        if config not in ("", "mode=guarded"):
            raise Err(f"unknown configuration {config!r}")
        GUARDED = config == "mode=guarded"

    def save_state(self) -> bytes:
        return b""

    def load_state(self, state: bytes) -> None:
        if state:
            raise Err("no state")


class Placement(exports.Placement):
    def pools(self):
        return [PoolSpec(name="all", release_when_empty=False)]

    @reported
    def place(self, req, ctx):
        if req.bytes > 1000:
            # An escape sequence and a newline: the engine must strip them.
            raise ValueError(f"raiser refuses {req.bytes} bytes \x1b[31mred\x1b[0m\nsecond line")
        return PlacementDecision(pool=0, round_to=512, segment_min=2 << 20, segment_round=2 << 20,
                                 split_min_remainder=512, max_waste=(1 << 64) - 1, cacheable=False)
