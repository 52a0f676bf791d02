"""The `first-fit-planner` planner as a component (WIT 0.3.0, world `planner-policy`).

The logic lives in `first_fit_planner_logic` (plain Python, tested by
`test_first_fit_planner.py`); this module binds it to the generated WIT
bindings. Build: ``componentize-py -d ../../wit/compat/v0.3.0 -w planner-policy componentize
first_fit_planner -o first-fit-planner.wasm``.
"""

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import host
from wit_world.imports.host import LogLevel
from wit_world.imports.types import ArenaPlan, StepProfile

import first_fit_planner_logic as logic


class Lifecycle(exports.Lifecycle):
    def name(self) -> str:
        return "first-fit-planner"

    def init(self, config: str) -> None:
        if config.strip():
            raise Err(f"first-fit-planner takes no configuration (got `{config}`)")

    def save_state(self) -> bytes:
        return b""

    def load_state(self, state: bytes) -> None:
        if state:
            raise Err("first-fit-planner keeps no state")


class Planner(exports.Planner):
    def plan(self, profile: StepProfile) -> ArenaPlan:
        try:
            requests = [(r.bytes, r.freed_at, r.wraps_to) for r in profile.requests]
            arena, offsets = logic.plan(requests)
            return ArenaPlan(arena_bytes=arena, offsets=offsets)
        except Exception as e:
            # Said first, so that the engine reports the failure with its text.
            host.log(LogLevel.ERROR, f"{type(e).__name__}: {e}")
            raise
