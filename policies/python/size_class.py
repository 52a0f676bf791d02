"""The `size-class` placement policy as a component (world `placement-policy`).

The logic lives in `size_class_logic` (plain Python, tested by
`test_size_class.py`); this module binds it to the generated WIT bindings.
Build: ``componentize-py -d ../../wit -w placement-policy componentize size_class -o size-class.wasm``.
"""

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports.types import AllocRequest, PlacementDecision, PolicyContext, PoolSpec

import size_class_logic as logic

# One component instance holds one configuration, shared by both exports.
_config = logic.Config()


class Lifecycle(exports.Lifecycle):
    def name(self) -> str:
        return "size-class"

    def init(self, config: str) -> None:
        global _config
        try:
            _config = logic.parse_config(config)
        except ValueError as e:
            raise Err(str(e))

    def save_state(self) -> bytes:
        return b""

    def load_state(self, state: bytes) -> None:
        if state:
            raise Err("size-class keeps no state")


class Placement(exports.Placement):
    def pools(self) -> list[PoolSpec]:
        return [PoolSpec(name=n, release_when_empty=False) for n in logic.POOL_NAMES]

    def place(self, req: AllocRequest, ctx: PolicyContext) -> PlacementDecision:
        return PlacementDecision(**logic.decide(_config, req.bytes))
