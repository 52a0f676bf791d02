// Builds one JavaScript policy into a component with componentize-js's API
// (the `jco componentize` command cannot take a --wit folder path).
//
//   node build.mjs SOURCE.js WORLD OUT.wasm [WIT-FOLDER]
//
// WIT-FOLDER defaults to the repository's wit/ (the newest WIT version);
// build.sh passes wit/compat/v0.1.0 for policies that stay on 0.1.0.
// Every WASI feature but `stdio` is disabled: the component imports what its
// world imports from wasmem:policy plus wasi:cli's stdout/stderr (and the
// wasi:io streams behind them), which the engine serves with a bounded
// in-memory buffer. StarlingMonkey prints an uncaught exception's message and
// stack there before it traps, so the engine's error names the exception
// (without stdio the trap is a bare `unreachable`).
import { writeFile } from 'node:fs/promises';
import { dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { componentize } from '@bytecodealliance/componentize-js';

const [source, worldName, out, witFolder] = process.argv.slice(2);
if (!source || !worldName || !out) {
  console.error('usage: node build.mjs SOURCE.js WORLD OUT.wasm [WIT-FOLDER]');
  process.exit(2);
}
const here = dirname(fileURLToPath(import.meta.url));
const { component } = await componentize({
  sourcePath: resolve(source),
  witPath: witFolder ? resolve(witFolder) : resolve(here, '../../wit'),
  worldName,
  disableFeatures: ['random', 'clocks', 'http', 'fetch-event'],
});
await writeFile(out, component);
console.log(`${out}: ${component.length} bytes`);
