// Decision logic of the `dtr-evict` eviction policy, free of any binding
// (tested by dtr_evict.test.mjs with node; bound to WIT by dtr-evict.js).
//
// Inspired by Dynamic Tensor Rematerialization's heuristic h = c / (m · s)
// (evict the tensor with the least cost per byte and per unit of staleness).
// Eviction here moves a tensor off the device, so the cost of an eviction is
// bringing it back: proportional to how often it is used. The score of an
// evictable candidate is
//
//     score = bytes × staleness / (1 + use_count) × kind_weight
//
// with staleness = clock − last_use + 1, and victims are taken by decreasing
// score until they cover the need (ties: least recently used, then id).
// kind_weight favours evicting what is idle between uses: activations and
// optimizer states (idle outside the optimizer step) 1, gradients and
// temporaries 1/2, parameters 1/4 (used by every forward and backward).
//
// Configuration (key=value pairs): `param`, `grad`, `optim`, `activation`,
// `temp`, `other` override the weight of that kind (a number > 0).

export const DEFAULT_WEIGHTS = Object.freeze({
  param: 0.25,
  grad: 0.5,
  optim: 1,
  activation: 1,
  temp: 0.5,
  other: 1,
});

// Parses the lifecycle.init string into a weight table; throws a string on error.
export function parseConfig(text) {
  const weights = { ...DEFAULT_WEIGHTS };
  const seen = new Set();
  for (const item of text.split(/[\s,;]+/).filter((s) => s.length > 0)) {
    const eq = item.indexOf('=');
    if (eq <= 0) throw `\`${item}\` is not of the form key=value`;
    const key = item.slice(0, eq);
    const value = item.slice(eq + 1);
    if (!(key in DEFAULT_WEIGHTS)) throw `unknown configuration key \`${key}\``;
    if (seen.has(key)) throw `key \`${key}\` is given twice`;
    seen.add(key);
    const w = Number(value);
    if (value.trim() === '' || !Number.isFinite(w) || w <= 0) {
      throw `invalid weight \`${value}\` for \`${key}\` (expected a number > 0)`;
    }
    weights[key] = w;
  }
  return weights;
}

// Candidates are WIT eviction-candidate records as componentize-js lifts
// them: u64 fields are BigInt, `kind` is the case name ('param', …).
// Returns the victims' ids (BigInt) in eviction order. Sizes and clocks are
// scored as Numbers (exact below 2^53); ids stay BigInt.
export function chooseVictims(weights, needBytes, candidates, clock) {
  const now = Number(clock);
  const scored = [];
  for (const c of candidates) {
    if (c.inUse || c.pinned) continue;
    const lastUse = Number(c.lastUse);
    const bytes = Number(c.bytes);
    const staleness = now >= lastUse ? now - lastUse + 1 : 1;
    const score = (bytes * staleness * (weights[c.kind] ?? 1)) / (1 + Number(c.useCount));
    scored.push({ id: c.id, bytes, lastUse, score });
  }
  scored.sort((a, b) => b.score - a.score || a.lastUse - b.lastUse || (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
  const need = Number(needBytes);
  const victims = [];
  let got = 0;
  for (const s of scored) {
    if (got >= need) break;
    got += s.bytes;
    victims.push(s.id);
  }
  return victims;
}
