#!/usr/bin/env node
// `npm run gen`: regenerate src/gen/ from ../../protos (ts-proto, driven by the buf CLI; both
// come from node_modules, so this works offline after `npm ci`).
// `npm run check-gen`: generate into a temporary folder and fail if src/gen/ differs (stale
// or hand-edited generated code).
import { execFileSync } from "node:child_process";
import { mkdtempSync, readdirSync, readFileSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, relative, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const protos = resolve(root, "../../protos");
const genDir = join(root, "src", "gen");
const check = process.argv.includes("--check");

function buf(outBase) {
  const bin = join(root, "node_modules", ".bin", process.platform === "win32" ? "buf.cmd" : "buf");
  execFileSync(bin, ["generate", protos, "--template", "buf.gen.yaml", "-o", outBase], {
    cwd: root,
    stdio: "inherit",
  });
}

function files(dir) {
  const out = new Map();
  const walk = (d) => {
    for (const name of readdirSync(d)) {
      const p = join(d, name);
      if (statSync(p).isDirectory()) walk(p);
      else out.set(relative(dir, p).split("\\").join("/"), readFileSync(p, "utf8"));
    }
  };
  try {
    walk(dir);
  } catch (e) {
    if (e.code !== "ENOENT") throw e;
  }
  return out;
}

if (!check) {
  rmSync(genDir, { recursive: true, force: true });
  buf(root);
  console.log(`generated ${[...files(genDir).keys()].map((f) => `src/gen/${f}`).join(", ")}`);
} else {
  const tmp = mkdtempSync(join(tmpdir(), "hotloop-gen-"));
  try {
    buf(tmp);
    const fresh = files(join(tmp, "src", "gen"));
    const current = files(genDir);
    const problems = [];
    for (const [name, text] of fresh) {
      if (!current.has(name)) problems.push(`missing: src/gen/${name}`);
      else if (current.get(name) !== text) problems.push(`stale:   src/gen/${name}`);
    }
    for (const name of current.keys()) if (!fresh.has(name)) problems.push(`extra:   src/gen/${name}`);
    if (problems.length) {
      console.error(`src/gen/ does not match protos/ (run \`npm run gen\` in clients/typescript):\n  ${problems.join("\n  ")}`);
      process.exit(1);
    }
    console.log(`src/gen/ is up to date with protos/ (${fresh.size} files)`);
  } finally {
    rmSync(tmp, { recursive: true, force: true });
  }
}
