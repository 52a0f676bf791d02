// The `dtr-evict` eviction policy as a component (world `eviction-policy`).
// Logic: dtr_evict_logic.js. Build: node build.mjs.

import { clock } from 'wasmem:policy/host@0.1.0';
import { DEFAULT_WEIGHTS, chooseVictims, parseConfig } from './dtr_evict_logic.js';

let weights = { ...DEFAULT_WEIGHTS };

// A thrown object with a `payload` becomes the `err` of a result.
function refuse(message) {
  return { payload: message };
}

export const lifecycle = {
  name() {
    return 'dtr-evict';
  },
  init(config) {
    try {
      weights = parseConfig(config);
    } catch (e) {
      throw refuse(String(e));
    }
  },
  saveState() {
    return new Uint8Array(0);
  },
  loadState(state) {
    if (state.length > 0) throw refuse('dtr-evict keeps no state');
  },
};

export const eviction = {
  chooseVictims(needBytes, candidates, ctx) {
    // ctx.clock is the clock of the snapshot; the host's clock is the same
    // logical clock, read here to show the import (they agree within a call).
    const now = ctx.clock > 0n ? ctx.clock : clock();
    return chooseVictims(weights, needBytes, candidates, now);
  },
};
