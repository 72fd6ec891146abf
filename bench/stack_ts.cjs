// bench/stack.py's TypeScript row: the same decode measurement as its Python SDK rows, through
// the TypeScript client (clients/typescript, built to dist/ by `npm run build`).
//
//   node bench/stack_ts.cjs ADDRESS MODEL SESSIONS TOKENS PROMPT
//
// Prints one JSON line: {"streams": [[first_s, last_s, tokens], ...], "cpu_s": client CPU seconds
// while streaming}. Times are seconds on a monotonic clock, only their differences matter.
"use strict";

const path = require("node:path");
const { Client } = require(path.join(__dirname, "..", "clients", "typescript", "dist", "src", "index.js"));

function now() {
  return Number(process.hrtime.bigint()) / 1e9;
}

async function main() {
  const [address, modelName, sessionsArg, tokensArg, prompt] = process.argv.slice(2);
  const n = Number(sessionsArg);
  const client = new Client(address);
  try {
    const model = client.model(modelName);
    const settings = { temperature: 0, sampleLen: Number(tokensArg), repeatPenalty: 1.0 };
    const sessions = [];
    for (let i = 0; i < n; i++) sessions.push(await model.newSession({ settings }));
    const histories = sessions.map((_, i) => [{ role: "user", content: `${prompt} (ts list ${i})` }]);
    for (let i = 0; i < n; i++) await sessions[i].warmup(histories[i]);
    const cpu0 = process.cpuUsage();
    const one = async (i) => {
      let first = 0;
      let last = 0;
      let count = 0;
      for await (const chunk of sessions[i].generate(histories[i])) {
        last = now();
        if (!first) first = last;
        if (chunk.usage) count = chunk.usage.completionTokens;
      }
      return [first, last, count];
    };
    const streams = await Promise.all(sessions.map((_, i) => one(i)));
    const cpu = process.cpuUsage(cpu0);
    for (const s of sessions) await s.close();
    process.stdout.write(`${JSON.stringify({ streams, cpu_s: (cpu.user + cpu.system) / 1e6 })}\n`);
  } finally {
    client.close();
  }
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
