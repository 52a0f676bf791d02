// Unit tests of the dtr-evict logic: `npm test` (node --test) in policies/js.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { DEFAULT_WEIGHTS, chooseVictims, parseConfig } from './dtr_evict_logic.js';

function cand(id, bytes, lastUse, useCount, kind = 'activation', inUse = false) {
  return { id: BigInt(id), bytes: BigInt(bytes), kind, tier: 'device', lastUse: BigInt(lastUse), useCount: BigInt(useCount), inUse, pinned: false };
}

test('prefers large, stale, rarely used tensors', () => {
  const cs = [cand(1, 100, 90, 0), cand(2, 100, 10, 0), cand(3, 1000, 90, 0), cand(4, 100, 10, 50)];
  assert.deepEqual(chooseVictims(DEFAULT_WEIGHTS, 1n, cs, 100n), [3n]);
  assert.deepEqual(chooseVictims(DEFAULT_WEIGHTS, 1050n, cs, 100n), [3n, 2n]);
});

test('never picks tensors in use or pinned, stops when covered', () => {
  const cs = [cand(1, 100, 0, 0, 'activation', true), cand(2, 10, 0, 0), { ...cand(3, 10, 0, 0), pinned: true }];
  assert.deepEqual(chooseVictims(DEFAULT_WEIGHTS, 1000n, cs, 5n), [2n]);
  assert.deepEqual(chooseVictims(DEFAULT_WEIGHTS, 0n, cs, 5n), []);
});

test('kind weights and deterministic ties', () => {
  const cs = [cand(5, 100, 0, 0, 'param'), cand(4, 100, 0, 0, 'activation'), cand(3, 100, 0, 0, 'activation')];
  assert.deepEqual(chooseVictims(DEFAULT_WEIGHTS, 300n, cs, 9n), [3n, 4n, 5n]);
  const w = parseConfig('param=4');
  assert.deepEqual(chooseVictims(w, 1n, cs, 9n), [5n]);
});

test('configuration', () => {
  assert.deepEqual(parseConfig(''), DEFAULT_WEIGHTS);
  assert.equal(parseConfig('grad=2, temp=0.1').temp, 0.1);
  for (const bad of ['x', 'colour=1', 'grad=0', 'grad=-1', 'grad=abc', 'grad=1 grad=2', 'grad=']) {
    assert.throws(() => parseConfig(bad), undefined, bad);
  }
});
