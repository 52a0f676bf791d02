// An eviction policy that throws on purpose (see README.md).
export const lifecycle = {
  name() { return 'jsraiser'; },
  init(config) { if (config) throw { payload: 'no configuration' }; },
  saveState() { return new Uint8Array(0); },
  loadState(state) { if (state.length) throw { payload: 'no state' }; },
};

export const eviction = {
  chooseVictims(needBytes, candidates, ctx) {
    if (candidates.length > 3) throw new RangeError(`jsraiser refuses ${candidates.length} candidates \u001b[1mbold\u001b[0m`);
    return [];
  },
};
